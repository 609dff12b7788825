"""Sampler: greedy, temperature, top-k, top-p, seeded reproducibility, frequencies, params checks.

The references below are plain float64 PyTorch (softmax, sort, cumsum) written for a reviewer.
Distribution checks draw a whole batch of rows at once (one `sample` call) and compare the
empirical frequencies with the reference through a chi-square statistic.
"""
from __future__ import annotations

import math

import pytest
import torch

from fastmamba.generation.sampling import GREEDY_BELOW, Sampler, SamplingParams, _mix_seed, finish_reason, stop_reached

# Chi-square threshold. Every distribution test uses a 5-token vocabulary, so the statistic has at
# most 4 degrees of freedom, where P(chi2_4 > x) = exp(-x/2) * (1 + x/2) exactly: at x = 40 that is
# 21 * exp(-20) ~ 4e-8 (and smaller for fewer degrees of freedom). So a correct sampler fails with
# negligible probability whatever its random stream, while real errors (a wrong temperature, a token
# leaking past a mask) push the statistic into the hundreds or thousands at 20k draws.
CHI2_MAX = 40.0
N_DRAWS = 20_000
LOGITS5 = [1.0, 0.5, 0.0, -0.5, -1.5]


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """[V] float64: softmax(logits / T), cut to the top-k (renormalised), then to the nucleus (renormalised)."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    order = p.argsort(descending=True)
    ps = p[order]
    if top_k:
        ps[top_k:] = 0
        ps = ps / ps.sum()
    if top_p < 1:
        before = ps.cumsum(0) - ps
        ps[before >= top_p] = 0
        ps = ps / ps.sum()
    out = torch.zeros_like(p)
    out[order] = ps
    return out


def nucleus_margin(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> float:
    """Distance between top_p and the nearest prefix mass: rows used by exact-support tests must keep
    it well above fp32 rounding, so fp32 (sampler) and fp64 (reference) agree on the nucleus."""
    if top_p == 1:
        return math.inf
    p = reference_probs(logits, temperature, top_k)
    mass = p.sort(descending=True).values.cumsum(0)
    return (mass - top_p).abs().min().item()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic over the tokens with probability > 0 (others must have zero counts)."""
    n = counts.sum().double()
    support = probs > 0
    expected = n * probs[support]
    return (((counts[support].double() - expected) ** 2) / expected).sum().item()


def draws(sampler: Sampler, logits_row: list[float], n: int, params: SamplingParams, device) -> torch.Tensor:
    logits = torch.tensor(logits_row, device=device).expand(n, -1)  # stride-0 rows are fine: read only
    return sampler.sample(logits, [params] * n, [0] * n)


# ---------------------------------------------------------------------------------------------- greedy


def test_greedy_equals_argmax(device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 300, generator=g).to(device)
    sampler = Sampler(300, device, 8, seed=0)
    expect = logits.argmax(dim=-1)
    assert torch.equal(sampler.sample_greedy(logits), expect)
    assert torch.equal(sampler.sample(logits, [SamplingParams()] * 8, list(range(8))), expect)
    out = sampler.sample(logits, [SamplingParams(seed=3)] * 8, [0] * 8)  # a seed means nothing to greedy rows
    assert out.dtype == torch.int64 and out.device == logits.device and torch.equal(out, expect)


def test_temperature_zero_rows_ignore_top_k_and_top_p(device):
    g = torch.Generator().manual_seed(1)
    B, V = 12, 257
    logits = torch.randn(B, V, generator=g).to(device)
    greedy_rows = [SamplingParams(temperature=0.0, top_k=3, top_p=0.1, seed=5),
                   SamplingParams(temperature=0.0, top_p=0.2),
                   SamplingParams(temperature=0.0, top_k=1)]
    sampled_rows = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, seed=9)]
    params = [greedy_rows[0], sampled_rows[0], greedy_rows[1], sampled_rows[1], greedy_rows[2], sampled_rows[0]] * 2
    out = Sampler(V, device, B, seed=0).sample(logits, params, list(range(B)))
    greedy = torch.tensor([p.temperature == 0 for p in params], device=device)
    assert torch.equal(out[greedy], logits.argmax(dim=-1)[greedy])


@pytest.mark.parametrize("temperature", [0.05, 1.0, 20.0])
def test_top_k_1_equals_greedy(device, temperature):
    g = torch.Generator().manual_seed(2)
    B, V = 64, 101
    logits = torch.randn(B, V, generator=g).to(device)
    params = [SamplingParams(temperature=temperature, top_k=1, seed=b if b % 2 else None) for b in range(B)]
    out = Sampler(V, device, B, seed=0).sample(logits, params, list(range(B)))
    assert torch.equal(out, logits.argmax(dim=-1))


# -------------------------------------------------------------------------------------- support checks


def test_top_k_never_leaves_the_k_largest(device):
    # 64 random rows, each drawn 50 times in one batch, with per-row k (and a k=0 row for contrast);
    # temperature 2 flattens the distribution so a token leaking past the mask would show up
    g = torch.Generator().manual_seed(3)
    R, reps, V = 64, 50, 50
    base = torch.randn(R, V, generator=g) * 2
    ks = [1, 2, 5, 17, 49, 0]
    logits = base.repeat_interleave(reps, dim=0).to(device)
    params = [SamplingParams(temperature=2.0, top_k=ks[(b // reps) % len(ks)]) for b in range(R * reps)]
    out = Sampler(V, device, R * reps, seed=0).sample(logits, params, [0] * (R * reps)).cpu()
    for r in range(R):
        k = ks[r % len(ks)] or V
        allowed = set(base[r].topk(k).indices.tolist())
        seen = set(out[r * reps:(r + 1) * reps].tolist())
        assert seen <= allowed, f"row {r}, k={k}: tokens {sorted(seen - allowed)} are outside the top-k"
        if k >= 5:
            assert len(seen) > 1, f"row {r}, k={k}: 50 draws gave one token; nothing was sampled"


@pytest.mark.parametrize("top_k", [0, 7], ids=["p-only", "k7-then-p"])
def test_top_p_never_leaves_the_nucleus(device, top_k):
    g = torch.Generator().manual_seed(4)
    R, reps, V, T = 48, 50, 64, 1.5
    base = torch.randn(R, V, generator=g) * 2
    ps = [0.05, 0.3, 0.6, 0.9, 0.99]
    for r in range(R):
        # fp32 cumsum over 64 tokens is off by ~1e-7: a 1e-5 margin keeps the two nuclei equal
        assert nucleus_margin(base[r], T, top_k, ps[r % len(ps)]) > 1e-5, "test data sits on a nucleus boundary"
    logits = base.repeat_interleave(reps, dim=0).to(device)
    params = [SamplingParams(temperature=T, top_k=top_k, top_p=ps[(b // reps) % len(ps)]) for b in range(R * reps)]
    out = Sampler(V, device, R * reps, seed=0).sample(logits, params, [0] * (R * reps)).cpu()
    for r in range(R):
        ref = reference_probs(base[r], T, top_k, ps[r % len(ps)])
        allowed = set(ref.nonzero().flatten().tolist())
        seen = set(out[r * reps:(r + 1) * reps].tolist())
        assert seen <= allowed, (
            f"row {r}, top_p={ps[r % len(ps)]}: tokens {sorted(seen - allowed)} are outside the nucleus"
        )


def test_padded_vocab_columns_are_never_sampled(device):
    # the lm head may produce V rounded up; columns >= vocab_size are not tokens
    B, V = 30, 40
    logits = torch.zeros(B, V + 8, device=device)
    logits[:, V:] = 100.0
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=3, seed=1)] * 10
    sampler = Sampler(V, device, B, seed=0)
    assert sampler.sample(logits, params, [0] * B).max().item() < V
    assert sampler.sample_greedy(logits).max().item() < V


def test_logits_are_not_modified_and_low_precision_is_accepted(device):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 90, generator=g).to(device)
    before = logits.clone()
    params = [SamplingParams(temperature=0.8, top_k=10, top_p=0.9), SamplingParams(temperature=1.0, seed=1),
              SamplingParams()] * 2
    sampler = Sampler(90, device, 6, seed=0)
    sampler.sample(logits, params, [0] * 6)
    assert torch.equal(logits, before)
    out = sampler.sample(logits.bfloat16(), [SamplingParams()] * 6, [0] * 6)
    assert torch.equal(out, logits.bfloat16().argmax(dim=-1))
    out = sampler.sample(logits.half(), params, [0] * 6)
    assert out.dtype == torch.int64 and out.shape == (6,)


def test_empty_batch(device):
    out = Sampler(10, device, 4).sample(torch.zeros(0, 10, device=device), [], [])
    assert out.shape == (0,) and out.dtype == torch.int64


# -------------------------------------------------------------------------------------------- seeding


def test_seeded_rows_do_not_depend_on_the_batch(device):
    g = torch.Generator().manual_seed(6)
    V, n = 1000, 16
    own = torch.randn(n, V, generator=g).mul(0.5).to(device)  # flat-ish: many tokens are plausible
    mine = [SamplingParams(temperature=[1.0, 0.7, 1.3, 2.0][b % 4], top_k=[0, 0, 50, 300][b // 4 % 4],
                           top_p=[1.0, 0.9][b % 2], seed=1000 + b) for b in range(n)]
    steps = [3 + 5 * b for b in range(n)]

    alone = Sampler(V, device, 1, seed=0)
    expect = torch.cat([alone.sample(own[b:b + 1], [mine[b]], [steps[b]]) for b in range(n)])
    assert torch.equal(torch.cat([alone.sample(own[b:b + 1], [mine[b]], [steps[b]]) for b in range(n)]), expect)

    # neighbours: unseeded, greedy, a k=2 row (top-k candidate path), a top-p-only row (full sort path)
    others = [SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=1.0, top_k=2),
              SamplingParams(temperature=0.9, top_p=0.5), SamplingParams(temperature=1.0, seed=1000)]
    for trial in range(3):
        perm = torch.randperm(2 * n, generator=g).tolist()  # where each of the 2n rows goes
        logits = torch.empty(2 * n, V, device=device)
        params, st = [None] * (2 * n), [0] * (2 * n)
        for i in range(2 * n):
            dst = perm[i]
            if i < n:
                logits[dst], params[dst], st[dst] = own[i], mine[i], steps[i]
            else:
                logits[dst] = torch.randn(V, generator=g).to(device)
                params[dst], st[dst] = others[(i + trial) % len(others)], i
        out = Sampler(V, device, 2 * n, seed=trial + 1).sample(logits, params, st)
        assert torch.equal(out[perm[:n]], expect), f"trial {trial}: seeded rows changed with their neighbours"


def test_seed_and_step_change_the_draw(device):
    V = 1000
    sampler = Sampler(V, device, 64, seed=0)
    flat = torch.zeros(64, V, device=device)
    p = [SamplingParams(temperature=1.0, seed=s) for s in range(64)]
    over_seeds = sampler.sample(flat, p, [0] * 64)
    over_steps = sampler.sample(flat, [SamplingParams(temperature=1.0, seed=5)] * 64, list(range(64)))
    # 64 uniform draws from 1000 tokens have ~62 distinct values; a draw stuck on seed or step has 1
    assert over_seeds.unique().numel() > 50
    assert over_steps.unique().numel() > 50
    assert len({_mix_seed(s, t) for s in range(100) for t in range(100)}) == 100 * 100
    assert all(0 <= _mix_seed(s, t) < 2**63 for s in (-1, 0, 2**70) for t in (0, 10**12))


def test_seeded_draws_follow_the_distribution(device):
    # one seed, 4000 successive steps: per-step seeding must still give draws from softmax(logits)
    n = 4000
    sampler = Sampler(5, device, n, seed=0)
    out = draws(sampler, LOGITS5, n, SamplingParams(temperature=1.0, seed=11), device)
    out2 = sampler.sample(torch.tensor(LOGITS5, device=device).expand(n, -1),
                          [SamplingParams(temperature=1.0, seed=11)] * n, list(range(n)))
    assert out.unique().numel() == 1  # same seed, same step (0) in every row: one token
    counts = out2.bincount(minlength=5).cpu()
    assert chi_square(counts, reference_probs(torch.tensor(LOGITS5), 1.0)) < CHI2_MAX


# ------------------------------------------------------------------------------------ distributions


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [
        (1.0, 0, 1.0),
        (0.5, 0, 1.0),
        (2.0, 3, 1.0),
        (1.5, 0, 0.75),
        (0.8, 4, 0.7),
    ],
    ids=["T1", "T0.5", "T2-k3", "T1.5-p0.75", "T0.8-k4-p0.7"],
)
def test_frequencies_match_the_reference(device, temperature, top_k, top_p):
    logits = torch.tensor(LOGITS5)
    assert nucleus_margin(logits, temperature, top_k, top_p) > 1e-3
    ref = reference_probs(logits, temperature, top_k, top_p)
    out = draws(Sampler(5, device, N_DRAWS, seed=1234), LOGITS5, N_DRAWS,
                SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), device)
    counts = out.bincount(minlength=5).cpu()
    assert counts[ref == 0].sum().item() == 0, f"tokens outside the kept set were drawn: {counts.tolist()}"
    stat = chi_square(counts, ref)
    assert stat < CHI2_MAX, f"chi2 = {stat:.1f}; counts {counts.tolist()}, expected {(ref * N_DRAWS).tolist()}"
    if (temperature, top_k, top_p) != (1.0, 0, 1.0):
        # the test has power: the same counts are far from the untempered, unfiltered softmax
        assert chi_square(counts, reference_probs(logits, 1.0)) > 10 * CHI2_MAX


def test_mixed_batch_frequencies(device):
    # three settings interleaved in one call, each following its own distribution. The top-p-only
    # row makes the call take the full-sort path, so the k=3 rows sit among 5 candidates: their
    # nucleus must come from the top-3 distribution renormalised (cumulative 0.51, 0.81: two
    # tokens at p=0.75), not from the whole softmax (0.44, 0.70, 0.87: three tokens)
    settings = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.6, top_k=3),
                SamplingParams(temperature=1.0, top_k=3, top_p=0.75)]
    n = 3 * 7000
    logits = torch.tensor(LOGITS5, device=device).expand(n, -1)
    out = Sampler(5, device, n, seed=7).sample(logits, settings * (n // 3), [0] * n).cpu()
    for i, p in enumerate(settings):
        assert nucleus_margin(torch.tensor(LOGITS5), p.temperature, p.top_k, p.top_p) > 1e-3
        ref = reference_probs(torch.tensor(LOGITS5), p.temperature, p.top_k, p.top_p)
        counts = out[i::3].bincount(minlength=5)
        assert counts[ref == 0].sum().item() == 0, f"{p}: tokens outside the kept set: {counts.tolist()}"
        assert chi_square(counts, ref) < CHI2_MAX, f"{p}: counts {counts.tolist()}"


# ------------------------------------------------------------------------------------ params, errors


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", float("nan")),
        ("seed", 1.5),
        ("max_new_tokens", 0),
        ("stop_token_ids", (-1,)),
        ("stop_token_ids", 5),
        ("temperature", "1.0"),
        ("temperature", True),
        ("top_k", True),
        ("max_new_tokens", 2.0),
        ("max_new_tokens", None),
        ("seed", "7"),
        ("stop", [""]),
        ("stop", ["a", 3]),
        ("stop", 5),
        ("ignore_eos", 1),
        ("ignore_eos", "yes"),
    ],
)
def test_invalid_params_raise(field, value):
    with pytest.raises(ValueError, match=field) as err:
        SamplingParams(**{field: value})
    assert repr(value) in str(err.value)


def test_params_are_normalised_and_hashable():
    p = SamplingParams(temperature=1, stop_token_ids=[2, 0], stop=["ab", "c"])
    assert p.stop_token_ids == (2, 0) and isinstance(p.temperature, float) and p.stop == ("ab", "c")
    assert p == SamplingParams(temperature=1.0, stop_token_ids=(2, 0), stop=("ab", "c"))
    assert hash(p) == hash(SamplingParams(temperature=1.0, stop_token_ids=(2, 0), stop=("ab", "c")))
    assert SamplingParams(stop="a b").stop == ("a b",)  # one string is one stop string, not its characters
    assert SamplingParams().ignore_eos is False and SamplingParams(ignore_eos=True).ignore_eos is True


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-45, True), (1e-39, True), (GREEDY_BELOW, False),
                                                 (1e-30, False), (1.0, False)])
def test_greedy_below_the_smallest_normal_fp32(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy


# ------------------------------------------------------------------------------------ tiny temperatures


@pytest.mark.parametrize("temperature", [1e-45, 1e-39, 2e-38, 1e-30, 1e-12, 1e-6])
def test_tiny_temperatures_give_the_argmax_never_nan(device, temperature):
    """The limit of softmax(l / T) as T -> 0 is the argmax: no overflow to inf / inf = NaN (which
    made every draw token 0 at T = 1e-39), whatever the size of the logits."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 50, generator=g) * 10).to(device)
    logits[:, 0] = -100.0  # token 0 is never the answer
    sampler = Sampler(50, device, 6, seed=1)
    params = [SamplingParams(temperature=temperature, seed=s) for s in range(3)] + \
             [SamplingParams(temperature=temperature, top_k=5), SamplingParams(temperature=temperature, top_p=0.5),
              SamplingParams(temperature=temperature)]
    expect = logits.argmax(dim=-1)
    assert torch.equal(sampler.sample(logits, params, [0] * 6), expect)
    probs = sampler.probs(logits, params)
    assert torch.equal(probs, torch.nn.functional.one_hot(expect, 50).float())


def test_tiny_temperature_splits_tied_maxima(device):
    """At T = 2e-38 (above GREEDY_BELOW: sampled) two equal maxima of size 10 share the mass; the old
    division overflowed (10 / 2e-38 = inf) and gave NaN."""
    row = torch.full((20,), -3.0)
    row[[4, 11]] = 10.0
    row[7] = 9.999  # close, but infinitely less likely at this temperature
    logits = row.to(device).expand(2000, -1)
    sampler = Sampler(20, device, 2000, seed=3)
    params = SamplingParams(temperature=2e-38)
    probs = sampler.probs(logits[:1], [params])[0].cpu()
    want = torch.zeros(20)
    want[[4, 11]] = 0.5
    torch.testing.assert_close(probs, want, atol=1e-6, rtol=0)
    counts = torch.bincount(sampler.sample(logits, [params] * 2000, [0] * 2000).cpu(), minlength=20)
    assert counts.sum() == counts[4] + counts[11] and min(counts[4], counts[11]) > 800, counts.tolist()


@pytest.mark.parametrize(
    "token, produced, params, eos, expect",
    [
        (5, 1, SamplingParams(max_new_tokens=4), (), None),
        (5, 4, SamplingParams(max_new_tokens=4), (), "length"),
        (2, 1, SamplingParams(), (2,), "eos"),
        (2, 4, SamplingParams(max_new_tokens=4, stop_token_ids=(2,)), (2, 9), "eos"),
        (2, 1, SamplingParams(ignore_eos=True), (2,), None),
        (2, 1, SamplingParams(ignore_eos=True, stop_token_ids=(2,)), (2,), "stop"),
        (3, 4, SamplingParams(max_new_tokens=4, stop_token_ids=(3,)), (), "stop"),
        (2, 4, SamplingParams(max_new_tokens=4, ignore_eos=True), (2,), "length"),
    ],
    ids=["running", "length", "eos", "eos-first", "ignore-eos", "ignore-eos-stop-id", "stop-before-length",
         "ignore-eos-length"],
)
def test_finish_reason(token, produced, params, eos, expect):
    assert finish_reason(token, produced, params, eos) == expect
    assert stop_reached(token, produced, params, eos) is (expect is not None)


@pytest.mark.parametrize(
    "token, produced, params, expect",
    [
        (5, 1, SamplingParams(max_new_tokens=4), False),
        (5, 4, SamplingParams(max_new_tokens=4), True),
        (5, 9, SamplingParams(max_new_tokens=4), True),
        (2, 1, SamplingParams(max_new_tokens=4, stop_token_ids=(0, 2)), True),
        (3, 1, SamplingParams(max_new_tokens=4, stop_token_ids=(0, 2)), False),
        (0, 1, SamplingParams(max_new_tokens=1), True),
    ],
    ids=["running", "at-max", "past-max", "stop-token", "other-token", "max-1"],
)
def test_stop_reached(token, produced, params, expect):
    assert stop_reached(token, produced, params) is expect


def test_sampler_argument_errors(device):
    s = Sampler(10, device, 4)
    ok = [SamplingParams(temperature=1.0)] * 2
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        s.sample(torch.zeros(10, device=device), ok, [0, 0])
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        s.sample(torch.zeros(2, 10, dtype=torch.int64, device=device), ok, [0, 0])
    with pytest.raises(ValueError, match="vocab_size=10"):
        s.sample(torch.zeros(2, 9, device=device), ok, [0, 0])
    with pytest.raises(ValueError, match="2 params and 1 steps"):
        s.sample(torch.zeros(2, 10, device=device), ok, [0])
    with pytest.raises(ValueError, match="1 params"):
        s.sample(torch.zeros(2, 10, device=device), ok[:1], [0, 0])
    with pytest.raises(ValueError, match="max_batch=4"):
        s.sample(torch.zeros(5, 10, device=device), [ok[0]] * 5, [0] * 5)
    with pytest.raises(TypeError, match="params\\[1\\]"):
        s.sample(torch.zeros(2, 10, device=device), [ok[0], {"temperature": 1.0}], [0, 0])
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler(0, device, 4)
    with pytest.raises(ValueError, match="max_batch"):
        Sampler(10, device, 0)
    if device.type == "cuda":
        with pytest.raises(ValueError, match="cpu"):
            s.sample(torch.zeros(2, 10), ok, [0, 0])


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_sample_does_not_synchronise():
    dev = torch.device("cuda")
    V, B = 5000, 8
    logits = torch.randn(B, V, device=dev)
    mixed = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, seed=3),
             SamplingParams(temperature=1.0, top_k=40), SamplingParams(temperature=0.9, top_p=0.8, seed=4),
             SamplingParams(temperature=1.2, top_k=100, top_p=0.95), SamplingParams(top_k=5),
             SamplingParams(temperature=1.0, seed=5)]
    top_k_only = [SamplingParams(temperature=1.0, top_k=20, seed=b % 2 or None) for b in range(B)]
    sampler = Sampler(V, dev, B, seed=0)
    sampler.sample(logits, mixed, list(range(B)))  # warm-up: first CUDA kernels, pinned-memory pool
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        # new params (pinned copy), cached params, the top-k-only path, the greedy fast path
        for params in (top_k_only, mixed, mixed, [SamplingParams()] * B):
            out = sampler.sample(logits, params, list(range(B)))
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    assert torch.equal(out, logits.argmax(dim=-1))
