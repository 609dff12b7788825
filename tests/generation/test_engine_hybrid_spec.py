"""Speculative decoding of a hybrid model (NemotronHLM): ``verify`` scores T tokens per request (the
attention layers write all T tokens' K/V and attend causally over the cache plus the tokens before;
the Mamba layers as Mamba2LM: replay or legacy), ``commit`` keeps the accepted ones and drops the
rest of the K/V; through the engine, greedy speculative output equals plain greedy, with every
draft accepted (oracle) or some rejected, and every page comes back."""
from __future__ import annotations

import pytest
import torch

from fastmamba.generation.drafters import OracleDrafter
from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import SamplingParams
from tests.generation.test_engine_hybrid import CFG, PAGE, PROMPTS, assert_all_free, greedy_reference
from tests.generation.test_engine_hybrid import model  # noqa: F401  (the module fixture)
from tests.helpers import CorruptedOracle, run_to_completion, tol

FP32 = tol(torch.float32)


@pytest.mark.parametrize("path", ["replay", "legacy"])
def test_verify_equals_full_forward_across_commits(model, path):  # noqa: F811
    """Two requests (slots 3 and 1, pages of 4): each verify's logits equal a full forward over the
    accepted history plus the step's inputs, after commits that kept 1..T of them; the KV
    lengths follow the accepted history."""
    check_verify_across_commits(model, path, PROMPTS)


def check_verify_across_commits(model, path: str, prompts: list[list[int]]) -> None:
    """Speculative verify with K = 2 (T = 3) for two requests in slots 3 and 1 (pages of 4), their
    histories prompts[1][:4] and prompts[3][:7]: every verify's logits equal a full forward over the
    accepted history plus the step's inputs, through commits that keep 1..T of them; the KV lengths
    follow the accepted history (fp32)."""
    K = 2
    T = K + 1
    g = torch.Generator().manual_seed(5)
    hist = [prompts[1][:4], prompts[3][:7]]
    cache = model.new_cache(4, max_seq_len=64, page_size=PAGE, speculate=K)
    if path == "legacy":
        cache.reserve_legacy(2)
    cache.alloc(4)
    slots = torch.tensor([3, 1], dtype=torch.int32)
    model.prefill_varlen(torch.tensor(hist[0] + hist[1]), torch.tensor([0, 4, 11], dtype=torch.int32), cache, slots)
    for acc in ([T, 1], [2, T], [1, 2]):
        toks = torch.randint(0, model.cfg.vocab_size, (2, T), generator=g)
        logits = model.verify(toks, cache, slots, path=path)
        for b in range(2):
            full = model(torch.tensor([hist[b] + toks[b].tolist()]))[0, -T:]
            torch.testing.assert_close(logits[b], full, **FP32)
        model.commit(cache, slots, torch.tensor(acc, dtype=torch.int32), path=path)
        for b in range(2):
            hist[b] += toks[b, :acc[b]].tolist()
        assert [cache.length(3), cache.length(1)] == [len(h) for h in hist]
        cache.kv.check()
    if path == "replay":
        cache.flush(slots)  # the plain step reads the SSM state
    nxt = torch.randint(0, CFG.vocab_size, (2, 1), generator=g)
    logits = model.verify(nxt, cache, slots, path="plain")
    model.commit(cache, slots, torch.ones(2, dtype=torch.int32), path="plain")
    for b in range(2):
        torch.testing.assert_close(logits[b, 0], model(torch.tensor([hist[b] + nxt[b].tolist()]))[0, -1], **FP32)


@pytest.mark.parametrize("verify_path", ["replay", "legacy"])
@pytest.mark.parametrize("wrong_at", [None, lambda step: [1, 3, 0, 2][step % 4]], ids=["oracle", "partial"])
def test_speculative_greedy_equals_plain_greedy(model, verify_path, wrong_at):  # noqa: F811
    """K=3, three requests in two slots (the third joins a reused slot and its pages), drafts from
    the plain greedy run: all accepted (oracle), or 1, 3, 0, 2 of 3 accepted in turn (the
    rejected drafts' K/V rolled back). Outputs equal plain greedy; every page comes back."""
    K = 3
    prompts = PROMPTS[1:4]
    n_new = (6, 9, 5)
    plain = [greedy_reference(model, p, n) for p, n in zip(prompts, n_new)]
    drafter = OracleDrafter.from_runs(prompts, plain)
    if wrong_at is not None:
        drafter = CorruptedOracle(drafter, wrong_at, CFG.vocab_size)
    engine = Engine(model, max_batch=2, speculate=K, drafter=drafter, verify_path=verify_path,
                    kv_page_size=PAGE, max_seq_len=64)
    reqs = run_to_completion(engine, prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in n_new])
    assert [r.output for r in reqs] == plain
    assert engine.stats["steps"][verify_path] > 0
    if wrong_at is None:  # every step but a request's last (its oracle runs out) accepts all K drafts
        assert all(a == K for r in reqs for a in r.accepted[:-1])
    else:
        assert {a for r in reqs for a in r.accepted} >= {0, 1}
    assert_all_free(engine)


def test_speculation_needs_room_for_the_drafts(model):  # noqa: F811
    engine = Engine(model, max_batch=1, speculate=3, kv_page_size=PAGE, max_seq_len=16)
    with pytest.raises(ValueError, match="needs 17 KV positions"):  # 10 + 5 - 1 + 3 drafts
        engine.add_request(list(range(10)), SamplingParams(max_new_tokens=5))
    engine.add_request(list(range(10)), SamplingParams(max_new_tokens=4))


@pytest.mark.gpu
@pytest.mark.parametrize("verify_path", ["replay", "legacy"])
def test_graphed_speculative_equals_plain_on_gpu(verify_path):
    """On a GPU: the prompts' prefills replay from GraphedPrefill's graphs, the verify and commit
    steps from GraphedVerifier's (the KV grown before and shrunk after, outside them); the tokens
    equal plain eager greedy decoding, with all drafts accepted or some rejected."""
    from fastmamba.models.nemotron_h import NemotronHLM, random_init

    m = random_init(NemotronHLM(CFG, device="cuda", dtype=torch.float32)).eval()
    prompts, n_new = PROMPTS[1:4], (6, 9, 5)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in n_new]
    kv = dict(kv_page_size=PAGE, max_seq_len=64)
    plain = Engine(m, max_batch=2, cuda_graphs=False, **kv).generate(prompts, params)
    for wrong_at in (None, lambda step: [1, 3, 0, 2][step % 4]):
        drafter = OracleDrafter.from_runs(prompts, plain)
        if wrong_at is not None:
            drafter = CorruptedOracle(drafter, wrong_at, CFG.vocab_size)
        engine = Engine(m, max_batch=2, speculate=3, drafter=drafter, verify_path=verify_path, cuda_graphs=True, **kv)
        assert engine.verifier is not None and engine.prefiller is not None
        assert engine.generate(prompts, params) == plain
        assert engine.stats["steps"][verify_path] > 0 and engine.prefiller.captured.count > 0
        assert_all_free(engine)
