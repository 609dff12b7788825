"""Logprobs: every emitted token's log-probability and the top-k alternatives, from the model's
distribution at that position (checked against a full forward of the prompt and output)."""
from __future__ import annotations

import pytest
import torch

import fastmamba
from fastmamba.generation.drafters import NgramDrafter
from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import MAX_LOGPROBS, SamplingParams


@pytest.fixture(scope="module")
def model():
    return fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cpu")


def expected(model, prompt, output):
    """log-softmax of the full forward's logits at the positions that produced each output token."""
    logits = model(torch.tensor([prompt + output]))[0]
    return torch.log_softmax(logits[len(prompt) - 1:len(prompt) + len(output) - 1].float(), -1)


def collect(engine, prompts, params):
    rids = [engine.add_request(p, params) for p in prompts]
    outs = {rid: [] for rid in rids}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.rid].append(o)
    return [outs[r] for r in rids]


@pytest.mark.parametrize("speculate", [None, 3])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_match_the_model_distribution(model, speculate, temperature):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 12)]
    prompts.append(prompts[0] * 3)  # repetitive: the n-gram drafter proposes, verify runs runs of tokens
    params = SamplingParams(max_new_tokens=7, ignore_eos=True, logprobs=3, temperature=temperature, seed=5)
    eng = Engine(model, max_batch=4, cuda_graphs=False, speculate=speculate,
                 drafter=NgramDrafter() if speculate else None)
    for prompt, outs in zip(prompts, collect(eng, prompts, params)):
        tokens = [o.token for o in outs]
        want = expected(model, prompt, tokens)
        got = torch.tensor([o.logprob for o in outs])
        torch.testing.assert_close(got, want[torch.arange(len(tokens)), torch.tensor(tokens)], rtol=1e-4, atol=1e-4)
        for pos, o in enumerate(outs):
            ids = [t for t, _ in o.top_logprobs]
            vals = torch.tensor([v for _, v in o.top_logprobs])
            assert len(ids) == 3 and vals.tolist() == sorted(vals.tolist(), reverse=True)
            torch.testing.assert_close(vals, want[pos].topk(3).values, rtol=1e-4, atol=1e-4)
            if temperature == 0:
                assert ids[0] == o.token  # greedy picks the most likely token


def test_no_logprobs_unless_asked_and_zero_alternatives(model):
    eng = Engine(model, max_batch=2, cuda_graphs=False)
    plain, zero = collect(eng, [[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=2, ignore_eos=True)), None
    assert all(o.logprob is None and o.top_logprobs is None for outs in plain for o in outs)
    zero = collect(eng, [[1, 2, 3]], SamplingParams(max_new_tokens=2, ignore_eos=True, logprobs=0))[0]
    assert all(o.logprob <= 0 and o.top_logprobs == () for o in zero)


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, 2.0, True])
def test_bad_logprobs_are_refused(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)
