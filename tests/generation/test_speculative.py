"""Speculative decoding: verify + commit keep exactly the accepted tokens' state; greedy speculative
generation emits the tokens of plain greedy generation whatever the drafter proposes; with
temperature > 0, speculative (rejection) sampling emits tokens distributed as plain sampling."""
from __future__ import annotations

import pytest
import torch

from fastmamba.generation.drafters import NgramDrafter, OracleDrafter
from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import Sampler, SamplingParams, speculative_accept
from tests.helpers import CorruptedOracle, run_to_completion, scaled_tiny_model

FP32 = dict(atol=1e-4, rtol=1e-4)
PROMPT_LENS = (3, 9, 5)
REF_TOKENS = 10  # plain greedy tokens per prompt; greedy is prefix-consistent, tests use prefixes


@pytest.fixture(scope="module")
def model():
    """mamba2-tiny in fp32 with its mixers scaled up (tests.helpers.scaled_tiny_model)."""
    return scaled_tiny_model()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    out = [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    out[1] = [7, 8, 9, 7, 8, 9, 7, 8, 9]  # repetitive: the n-gram drafter proposes real continuations
    return out


@pytest.fixture(scope="module")
def plain(model, prompts):
    """Plain (non-speculative) greedy continuations, REF_TOKENS each."""
    return Engine(model, max_batch=len(prompts)).generate(prompts, SamplingParams(max_new_tokens=REF_TOKENS))


def run(engine, prompts, params):
    """Run to completion; returns (outputs, accepted-drafts-per-step lists) in prompt order."""
    reqs = run_to_completion(engine, prompts, params)
    return [r.output for r in reqs], [r.accepted for r in reqs]


def test_verify_then_commit_matches_the_accepted_history(model):
    """LM level: a verify's logits equal a full forward over the accepted history plus the step's
    inputs (after a fresh prefill, then after replaying 1 and 3 inputs); after the commits the conv window at the
    accepted offset and (after a flush) the SSM state equal a prefill of only the accepted tokens."""
    K = 2
    T, W = K + 1, model.cfg.d_conv
    dev = model.lm_head.weight.device
    g = torch.Generator().manual_seed(3)
    hist = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (4, 7)]
    cache = model.new_cache(4, speculate=K)
    assert cache.conv[0].shape[-1] == W - 1 + K
    slots = torch.tensor([3, 1], dtype=torch.int32, device=dev)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32, device=dev)
    model.prefill_varlen(torch.tensor(hist[0] + hist[1], device=dev), cu, cache, slots, has_initial_state=False)
    accepted = [[T, 1], [2, T], [1, 2]]  # inputs kept per step (last token + accepted drafts)
    windows = None  # per layer and request: the conv window after the last commit
    for step, acc in enumerate(accepted):
        toks = torch.randint(0, 256, (2, T), generator=g).to(dev)
        if step == 2:  # the replay histories (steps 0 and 1) applied and stored: only accepted tokens
            cache.flush(slots)
            fresh = model.new_cache(2)
            lens = [len(h) for h in hist]
            cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=dev)
            model.prefill_varlen(torch.tensor(hist[0] + hist[1], device=dev), cu, fresh,
                                 torch.tensor([0, 1], dtype=torch.int32, device=dev), has_initial_state=False)
            for layer in range(model.cfg.n_layer):
                torch.testing.assert_close(cache.ssm[layer][slots.long()], fresh.ssm[layer], **FP32)
                for b in range(2):  # conv inputs come from in_proj over differently shaped batches
                    torch.testing.assert_close(windows[layer][b], fresh.conv[layer][b, :, 1:], **FP32)
        logits = model.verify(toks, cache, slots)
        for b in range(2 if step < 2 else 0):  # step 2 is checked through the state (saves interpreter time)
            full = model(torch.tensor([hist[b] + toks[b].tolist()], device=dev))[0, -T:]
            torch.testing.assert_close(logits[b], full, **FP32)
        model.commit(cache, slots, torch.tensor(acc, dtype=torch.int32, device=dev))
        for b in range(2):
            hist[b] += toks[b, :acc[b]].tolist()
        # the conv history now ends at column a+W-3: its last W-1 inputs start at column a-1
        windows = [[cache.conv[layer][s, :, a - 1:a + W - 2].clone() for s, a in zip(slots.tolist(), acc)]
                   for layer in range(model.cfg.n_layer)]
    assert cache.conv_accepted[slots.long()].tolist() == accepted[-1]
    assert cache.prev_accepted[slots.long()].tolist() == accepted[-1]


@pytest.mark.parametrize("K", [1, 3], ids=["K1", "K3"])
def test_ngram_matches_plain_greedy_in_continuous_batch(model, prompts, plain, K):
    """Two slots for three requests of different prompt lengths: the third joins (prefill into a
    reused slot) while another is mid-generation."""
    n_new = (3, 6, 5)
    engine = Engine(model, max_batch=2, speculate=K)
    outs, acc = run(engine, prompts, [SamplingParams(max_new_tokens=n) for n in n_new])
    assert outs == [p[:n] for p, n in zip(plain, n_new)]
    assert all(0 <= a <= K for steps in acc for a in steps)


def test_oracle_accepts_everything_and_stops_mid_run(model, prompts, plain):
    """K=3 with the plain greedy continuation as drafts: every draft accepted (4 tokens a step).
    max_new_tokens=6 ends inside the second step's run (1 from prefill + 4 + 1 of 4); the second
    request stops on a stop token inside a run; the third ends exactly at a step boundary."""
    K = 3
    stop = plain[1][2]
    assert stop not in plain[1][:2]
    params = [SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=REF_TOKENS, stop_token_ids=(stop,)),
              SamplingParams(max_new_tokens=5)]
    engine = Engine(model, max_batch=3, speculate=K, drafter=OracleDrafter.from_runs(prompts, plain))
    outs, acc = run(engine, prompts, params)
    assert outs == [plain[0][:6], plain[1][:3], plain[2][:5]]
    assert acc == [[K, K], [K], [K]]


@pytest.mark.parametrize("wrong_at,K,expected", [
    (lambda step: 0, 2, [0, 0, 0]),             # adversarial: every draft wrong, one token a step
    (lambda step: [1, 3, 0, 2][step % 4], 3, [1, 3, 0]),  # partial acceptance, every count 0..K
], ids=["adversarial-K2", "partial-K3"])
def test_wrong_drafts_are_rejected(model, prompts, plain, wrong_at, K, expected):
    n_new = 1 + sum(a + 1 for a in expected)  # the prefill token, then a + 1 per step
    drafter = CorruptedOracle(OracleDrafter.from_runs(prompts[:1], plain[:1]), wrong_at, 256)
    engine = Engine(model, max_batch=1, speculate=K, drafter=drafter)
    outs, acc = run(engine, prompts[:1], [SamplingParams(max_new_tokens=n_new)])
    assert outs == [plain[0][:n_new]]
    assert acc == [expected]


def test_ngram_drafter():
    d = NgramDrafter()
    assert d.draft([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]        # 3-gram match, continuation
    assert d.draft([5, 2, 3, 4, 6, 6, 2, 3], 2) == [4, 6]        # 2-gram (no earlier 3-gram)
    assert d.draft([1, 2, 3, 1, 2, 4, 1, 2], 2) == [4, 1]        # most recent occurrence wins
    assert d.draft([4, 7, 4], 3) == [7, 4, 4]                    # runs into the end: padded
    assert d.draft([1, 2, 3], 2) == [3, 3]                       # no match: last token repeated
    assert d.draft([8], 2) == [8, 8]
    oracle = OracleDrafter({(1, 2): [5, 6, 7]})

    class R:
        prompt, output = [1, 2], [5]

    assert oracle.propose([R()], 3) == [[6, 7, 7]]


def test_speculation_errors(model):
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA device"):
            Engine(model, max_batch=1, speculate=2, cuda_graphs=True)
    with pytest.raises(ValueError, match="drafter needs speculate"):
        Engine(model, max_batch=1, drafter=NgramDrafter())
    cache = model.new_cache(2, speculate=2)
    slots = cache.alloc(1)
    with pytest.raises(ValueError, match=r"T = K\+1 = 3"):
        model.verify(torch.zeros(1, 2, dtype=torch.int64, device=slots.device), cache, slots)
    with pytest.raises(ValueError, match=r"\[1, 3\]"):
        model.commit(cache, slots, torch.tensor([4], device=slots.device))
    with pytest.raises(ValueError, match="without speculation"):
        model.verify(torch.zeros(1, 1, dtype=torch.int64, device=slots.device), model.new_cache(1), slots)


def test_cli_generate_speculate_oracle(capsys):
    """``fastmamba generate --speculate 2 --drafter oracle``: the oracle replays the plain greedy run,
    so every draft is accepted (6 tokens: 1 from prefill, then 2 verify steps of 3, the second cut
    to 2)."""
    from fastmamba.cli import main

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    argv = ["generate", "--model", "mamba2-tiny", "--prompt-ids", "5,6,7", "--max-new-tokens", "6",
            "--speculate", "2", "--drafter", "oracle", "--device", dev]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert len(out.split()) == 6
    assert "2 verify steps, 4 of 4 drafts accepted (100%)" in err


# ------------------------------------------------------------------ speculative sampling (temperature > 0)

@pytest.mark.parametrize("draft1", [0, 3], ids=["likely-draft", "unlikely-draft"])
def test_speculative_accept_keeps_the_target_distribution(draft1):
    """Pure function, 20000 seeded draws of hand-made distributions (K=2): the first emitted token
    (d1 if accepted, else the residual draw) follows p0, the second (among rows that accepted d1)
    follows p1; P(accept d1) = p0(d1); with all drafts accepted the bonus token follows p2."""
    N, tol = 20000, 0.015  # binomial sd <= 0.0036 at N=20000: tol is about 4 sd
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0],
                      [0.1, 0.2, 0.0, 0.3, 0.4],
                      [0.25, 0.25, 0.25, 0.0, 0.25]])
    drafts = torch.tensor([draft1, 1])  # d2 = 1: p1(1) = 0.2, rejected mostly
    g = torch.Generator().manual_seed(123)
    u = torch.rand(N, 2, generator=g)
    noise = torch.empty(N, 5).exponential_(generator=g)
    n, tok = speculative_accept(p.expand(N, 3, 5), drafts.expand(N, 2), u, noise)
    assert n.dtype == tok.dtype == torch.int64 and 0 <= n.min() and n.max() <= 2
    first = torch.where(n >= 1, drafts[0], tok)
    torch.testing.assert_close(torch.bincount(first, minlength=5) / N, p[0], atol=tol, rtol=0)
    assert abs((n >= 1).float().mean().item() - p[0, draft1].item()) < tol
    took1 = n >= 1
    second = torch.where(n[took1] >= 2, drafts[1], tok[took1])
    torch.testing.assert_close(torch.bincount(second, minlength=5) / took1.sum(), p[1], atol=2 * tol, rtol=0)
    bonus = tok[n == 2]
    assert bonus.numel() > 100
    torch.testing.assert_close(torch.bincount(bonus, minlength=5) / bonus.numel(), p[2], atol=0.06, rtol=0)
    # a rejected draft is never the emitted token, and zero-probability tokens never appear
    assert not (tok[n == 0] == draft1).any() and not (first == 4).any()


def test_speculative_accept_edge_cases():
    # a certain draft (p = 1) is always accepted; an impossible one (p = 0) always rejected
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]]).expand(4, 2, 3)
    u = torch.tensor([[0.0], [0.5], [0.999], [0.3]])
    noise = torch.ones(4, 3)
    n, tok = speculative_accept(p, torch.tensor([[1], [1], [0], [2]]), u, noise)
    assert n.tolist() == [1, 1, 0, 0] and tok.tolist() == [2, 2, 1, 1]
    # rounding: p(d) = 1 - eps with no other mass; a rejection falls back to d instead of token 0
    q = torch.tensor([[[0.0, 0.99999994, 0.0], [1.0, 0.0, 0.0]]])
    n, tok = speculative_accept(q, torch.tensor([[1]]), torch.tensor([[0.99999997]]), torch.ones(1, 3))
    assert n.tolist() == [0] and tok.tolist() == [1]


def test_sampler_probs_and_speculative_sample():
    V = 6
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, V + 2, generator=g)  # two padding columns
    params = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=2),
              SamplingParams(temperature=1.0, top_p=0.5, seed=1)]
    s = Sampler(V, "cpu", 8, seed=0)
    pr = s.probs(logits, params)
    assert pr.shape == (4, V)
    torch.testing.assert_close(pr.sum(-1), torch.ones(4))
    x = logits[:, :V]
    assert pr[0].tolist() == torch.nn.functional.one_hot(x[0].argmax(), V).float().tolist()
    torch.testing.assert_close(pr[1], (x[1] / 0.7).softmax(-1))
    assert (pr[2] > 0).sum() == 2 and set(pr[2].nonzero().flatten().tolist()) == set(x[2].topk(2).indices.tolist())
    top = x[3].softmax(-1).sort(descending=True)
    keep = (top.values.cumsum(-1) - top.values) < 0.5
    assert set(pr[3].nonzero().flatten().tolist()) == set(top.indices[keep].tolist())
    # seeded rows are reproducible and independent of the sampler's own generator
    K = 3
    lg = torch.randn(2, K + 1, V, generator=g)
    dr = torch.randint(0, V, (2, K), generator=g)
    sp = [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=2.0, seed=9, top_k=3)]
    a = Sampler(V, "cpu", 8, seed=1).speculative_sample(lg, dr, sp, [4, 7])
    b = Sampler(V, "cpu", 8, seed=2).speculative_sample(lg, dr, sp, [4, 7])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert ((0 <= a[0]) & (a[0] <= K)).all()
    with pytest.raises(ValueError, match=r"\[B, K\+1, V\]"):
        s.speculative_sample(lg, dr[:, :2], sp, [0, 0])


def test_sampled_speculation_runs_and_is_reproducible(model, prompts, plain):
    """temperature > 0 with fixed seeds (K=3, n-gram drafts, one greedy request in the batch): every
    request emits max_new_tokens tokens, accepted counts lie in 0..K, the same seeds give the same
    tokens, and the greedy request still matches greedy decoding."""
    K, n_new = 3, 5
    params = [SamplingParams(temperature=0.9, top_k=50, seed=11, max_new_tokens=n_new),
              SamplingParams(temperature=1.2, top_p=0.9, seed=12, max_new_tokens=n_new),
              SamplingParams(max_new_tokens=n_new)]
    outs, acc = run(Engine(model, max_batch=3, speculate=K), prompts, params)
    assert [len(o) for o in outs] == [n_new] * 3
    assert all(0 <= a <= K for steps in acc for a in steps)
    assert all(0 <= t < model.cfg.vocab_size for o in outs for t in o)
    assert outs[2] == plain[2][:n_new]
    again, _ = run(Engine(model, max_batch=3, speculate=K), prompts[:2], params[:2])
    assert again == outs[:2]


def test_sampled_speculation_at_low_temperature_equals_greedy(model, prompts, plain):
    """temperature 1e-4 makes each p_i (nearly) one-hot at the argmax: with the plain greedy run as
    oracle drafts, every draft is accepted and the tokens are the greedy ones."""
    K = 3
    engine = Engine(model, max_batch=3, speculate=K, drafter=OracleDrafter.from_runs(prompts, plain))
    params = [SamplingParams(temperature=1e-4, seed=s, max_new_tokens=REF_TOKENS) for s in range(3)]
    outs, acc = run(engine, prompts, params)
    assert outs == plain
    assert all(a == K for steps in acc for a in steps[:-1])
