"""Chunked prefill: a prompt longer than the step's token budget is fed over several steps from its
slot's state, running requests keep decoding meanwhile, and the tokens equal unchunked prefill (fp32)."""
from __future__ import annotations

import pytest
import torch

from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import SamplingParams
from tests.helpers import scaled_tiny_model


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # scheduling, not kernels: the PyTorch references (fast)


@pytest.fixture(scope="module")
def model():
    return scaled_tiny_model("cpu")


PROMPTS = [[5, 9, 2], list(range(30, 52)), [7, 7, 1, 3, 200, 4, 4]]  # 3, 22 and 7 tokens


def test_chunked_tokens_equal_unchunked(model):
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    want = Engine(model, max_batch=4).generate(PROMPTS, params)
    for chunk in (1, 5, 8, 64):
        got = Engine(model, max_batch=4, prefill_chunk=chunk).generate(PROMPTS, params)
        assert got == want, f"prefill_chunk={chunk}"


def test_running_requests_decode_while_a_long_prompt_prefills(model):
    engine = Engine(model, max_batch=4, prefill_chunk=4)
    short = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=40, ignore_eos=True))
    engine.step()  # the short prompt: prefilled whole, its first token out
    assert [r.rid for r in engine.running] == [short]
    long_rid = engine.add_request(list(range(10, 30)), SamplingParams(max_new_tokens=3, ignore_eos=True))
    steps = 0
    while not any(r.rid == long_rid for r in engine.running):
        outs = engine.step()
        steps += 1
        assert [o.rid for o in outs if o.rid == short] == [short]  # one token for the running request every step
        assert steps <= 5
    assert steps == 5  # 20 prompt tokens at 4 per step
    long_req = next(r for r in engine.running if r.rid == long_rid)
    assert long_req.prefilled == 20 and len(long_req.output) == 1


def test_chunk_budget_is_shared_and_slots_come_back(model):
    engine = Engine(model, max_batch=3, prefill_chunk=6)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in PROMPTS + [[9] * 10]]
    seen = []
    while engine.has_unfinished():
        fed_before = sum(r.prefilled for r in engine.prefilling + engine.running)
        engine.step()
        fed = sum(r.prefilled for r in engine.prefilling + engine.running) - fed_before
        seen.append(fed)
        assert len(engine.prefilling) + len(engine.running) <= 3
    assert max(seen) <= 6
    assert engine.cache.free_slots == 3
    assert sorted(r.rid for r in engine.pop_finished()) == rids


def test_bad_chunk_budget(model):
    with pytest.raises(ValueError, match="prefill_chunk"):
        Engine(model, max_batch=2, prefill_chunk=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the chunk's kernels run asynchronously)")
def test_a_chunk_step_ends_with_its_chunk_done():
    """A step that feeds a chunk and completes no prompt returns only once the chunk has run: the
    next step's gap then holds one chunk, not this one's tail and its own."""
    m = scaled_tiny_model("cuda")
    engine = Engine(m, max_batch=4, prefill_chunk=8)
    short = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=40, ignore_eos=True))
    engine.step()
    engine.add_request(list(range(10, 50)), SamplingParams(max_new_tokens=2, ignore_eos=True))
    for _ in range(4):  # 40 prompt tokens at 8 per step: the first four steps complete nothing
        outs = engine.step()
        assert [o.rid for o in outs] == [short] and engine.prefilling
        assert torch.cuda.current_stream().query()  # nothing of the step left on the GPU
