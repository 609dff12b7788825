"""``min_tokens``, ``repetition_penalty`` and the ``max_tokens`` alias of ``SamplingParams``: the
logits processing against transformers' own processors, and the engine's tokens against a
step-by-step reference that applies the same rule to the full forward's logits."""
from __future__ import annotations

import pytest
import torch

from fastmamba.generation.sampling import Sampler, SamplingParams


def test_max_tokens_is_max_new_tokens():
    assert SamplingParams(max_tokens=7).max_new_tokens == 7
    assert SamplingParams(max_tokens=7) == SamplingParams(max_new_tokens=7) == SamplingParams(max_new_tokens=7,
                                                                                           max_tokens=7)
    assert SamplingParams().max_new_tokens == 128
    with pytest.raises(ValueError, match="max_tokens.*max_new_tokens.*differ"):
        SamplingParams(max_tokens=7, max_new_tokens=8)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize("kw, fragment", [
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=5, max_new_tokens=4), "min_tokens"),
    (dict(min_tokens=1.5), "min_tokens"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"), (dict(repetition_penalty="2"), "repetition_penalty"),
])
def test_bad_values_are_named(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**kw)


def test_penalise_matches_transformers():
    """The penalty is transformers' RepetitionPenaltyLogitsProcessor; the min_tokens ban its
    MinNewTokensLengthLogitsProcessor (for the EOS and the stop ids alike)."""
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor, \
        RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    B, V = 3, 37
    logits = torch.randn(B, V + 3)  # padded columns are never returned
    seqs = [torch.randint(0, V, (n,)) for n in (5, 1, 9)]
    seen = torch.zeros(B, V, dtype=torch.bool)
    for b, s in enumerate(seqs):
        seen[b, s] = True
    params = [SamplingParams(repetition_penalty=1.7), SamplingParams(repetition_penalty=0.6, min_tokens=3,
                                                                     stop_token_ids=(4,)),
              SamplingParams(min_tokens=2)]
    steps = [0, 2, 2]
    got = Sampler(V, "cpu", 4).penalise(logits, params, steps, seen=seen, eos_token_ids=(1, 2))
    for b, (p, s) in enumerate(zip(params, seqs)):
        want = logits[b:b + 1, :V].clone()
        if p.repetition_penalty != 1:
            want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(s[None], want)
        if steps[b] < p.min_tokens:
            ids = [1, 2, *p.stop_token_ids]
            want = MinNewTokensLengthLogitsProcessor(0, p.min_tokens, ids)(torch.zeros(1, steps[b], dtype=torch.long),
                                                                            want)
        torch.testing.assert_close(got[b:b + 1], want, atol=0, rtol=0)
    assert torch.isinf(got[1, [1, 2, 4]]).all() and torch.isfinite(got[2]).all()  # row 2: min_tokens reached


def test_engine_repetition_penalty_and_min_tokens_follow_the_reference(reference_model):
    """Greedy tokens with a penalty equal the argmax of the penalised full-forward logits at every step,
    for a penalised request next to a plain one (the plain one keeps its own tokens)."""
    from fastmamba.generation.engine import Engine

    model = reference_model
    prompt = [5, 9, 13, 17, 5]

    def reference(penalty: float, n: int) -> list[int]:
        seq = list(prompt)
        for _ in range(n):
            lg = model(torch.tensor([seq]))[0, -1, :model.cfg.vocab_size]
            hit = torch.zeros_like(lg, dtype=torch.bool)
            hit[torch.tensor(seq)] = True
            lg = torch.where(hit, torch.where(lg > 0, lg / penalty, lg * penalty), lg)
            seq.append(int(lg.argmax()))
        return seq[len(prompt):]

    engine = Engine(model, max_batch=2, cuda_graphs=False)
    plain = engine.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    got = engine.generate([prompt, prompt], [SamplingParams(max_new_tokens=6, repetition_penalty=1.5, ignore_eos=True),
                                             SamplingParams(max_new_tokens=6, ignore_eos=True)])
    assert got[0] == reference(1.5, 6) and got[1] == plain
    # min_tokens: the first greedy token made a stop token, held back for 3 tokens
    stop = plain[0]
    assert engine.generate([prompt], SamplingParams(max_new_tokens=6, stop_token_ids=(stop,)))[0] == [stop]
    held = engine.generate([prompt], SamplingParams(max_new_tokens=6, stop_token_ids=(stop,), min_tokens=3))[0]
    assert len(held) >= 3 and stop not in held[:3]
    with pytest.raises(ValueError, match="speculative"):
        Engine(model, max_batch=1, cuda_graphs=False, speculate=2).add_request(prompt,
                                                                              SamplingParams(repetition_penalty=1.2))


@pytest.fixture
def reference_model(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the model's ops as their PyTorch references
    import fastmamba

    return fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cpu")


@pytest.mark.gpu
def test_penalise_does_not_wait_for_the_device():
    """penalise then sample on CUDA under sync debug mode "error": no host synchronisation."""
    B, V = 4, 1000
    sampler = Sampler(V, "cuda", B)
    logits = torch.randn(B, V, device="cuda")
    seen = torch.rand(B, V, device="cuda") < 0.1
    params = [SamplingParams(repetition_penalty=1.3, min_tokens=2, stop_token_ids=(3,)),
              SamplingParams(temperature=0.7, seed=1, repetition_penalty=0.8), SamplingParams(), SamplingParams()]
    sampler.penalise(logits, params, [0, 1, 2, 3], seen=seen, eos_token_ids=(0,))  # warm (pinned pool)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x = sampler.penalise(logits, params, [0, 1, 2, 3], seen=seen, eos_token_ids=(0,))
        sampler.sample(x, params, [0, 1, 2, 3])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isinf(x[0, [0, 3]]).all()
