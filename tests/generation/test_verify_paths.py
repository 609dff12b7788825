"""Speculative verification paths (issue 5, items 5-7): replay, legacy (a state per position, then a
copy of the accepted one) and plain (nothing drafted: one input per request), chosen per step by
the engine; each emits exactly the tokens of plain greedy decoding, whichever path a step takes
and however the paths alternate on a slot; the legacy commit leaves the state of a plain decode of
the accepted tokens; CUDA graphs per (path, batch bucket) on a GPU."""
from __future__ import annotations

import pytest
import torch

from fastmamba.generation.drafters import OracleDrafter
from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import SamplingParams
from tests.helpers import run_to_completion, scaled_tiny_model

FP32 = dict(atol=1e-4, rtol=1e-4)
K = 2  # drafts per step: T = 3 inputs verified per step
PROMPTS = ([11, 12, 13], [7, 8, 9, 7, 8, 9, 7, 8, 9], [40, 3, 250, 17, 5])
# A finishes after one verify step, C then takes its slot; B finishes while C runs on alone
NEW_TOKENS = (4, 10, 12)
# per verify step: (real drafts per request, index of the wrong one; >= K: none wrong)
SCRIPT = [(2, 9), (0, 0), (2, 1), (1, 9), (2, 0)]


@pytest.fixture(scope="module")
def model():
    """mamba2-tiny in fp32 with its mixers scaled up (tests.helpers.scaled_tiny_model)."""
    return scaled_tiny_model()


@pytest.fixture(scope="module")
def plain(model):
    """Plain (non-speculative, eager) greedy continuations of PROMPTS."""
    engine = Engine(model, max_batch=len(PROMPTS), cuda_graphs=False)
    return engine.generate(list(PROMPTS), SamplingParams(max_new_tokens=max(NEW_TOKENS)))


class ScriptedOracle:
    """The oracle's drafts, per step cut to ``n`` real ones (0: an empty proposal) with draft
    ``wrong`` made wrong, from SCRIPT; records the drafts it proposed per step."""

    def __init__(self, oracle: OracleDrafter, script=SCRIPT):
        self.oracle, self.script, self.proposed = oracle, script, []

    def propose(self, requests, k):
        n, wrong = self.script[len(self.proposed) % len(self.script)]
        drafts = [d[:n] for d in self.oracle.propose(requests, k)]
        for d in drafts:
            if wrong < n:
                d[wrong] = (d[wrong] + 1) % 256
        self.proposed.append(n * len(requests))
        return drafts


def run_script(model, plain, **engine_kw):
    """Run PROMPTS through a 2-slot speculative engine with the scripted drafter; check the tokens
    against plain greedy and the stats against the drafter's record; returns the engine."""
    drafter = ScriptedOracle(OracleDrafter.from_runs(PROMPTS, plain))
    engine = Engine(model, max_batch=2, speculate=K, drafter=drafter, **engine_kw)
    reqs = run_to_completion(engine, PROMPTS, [SamplingParams(max_new_tokens=n) for n in NEW_TOKENS])
    assert [r.output for r in reqs] == [p[:n] for p, n in zip(plain, NEW_TOKENS)]
    st = engine.stats
    assert sum(st["steps"].values()) == len(drafter.proposed)
    assert st["steps"]["plain"] == drafter.proposed.count(0)
    assert st["drafts_proposed"] == sum(drafter.proposed)
    assert st["drafts_accepted"] == sum(r.accepted_drafts for r in reqs)
    assert all(0 <= a <= K for r in reqs for a in r.accepted)
    return engine


# A: verify (replay at batch 2: A ends); C joins; plain; 3 verify steps at batch 2 (B ends); C alone:
# verify (batch 1), plain, verify. So the slots switch replay -> plain, replay -> batch-1 path, and back.
EXPECTED_STEPS = {  # verify_path -> steps per path
    "replay": {"replay": 6, "legacy": 0, "plain": 2},
    "legacy": {"replay": 0, "legacy": 6, "plain": 2},
    "auto": {"replay": 4, "legacy": 2, "plain": 2},  # crossover at batch 2: legacy only for C alone
}


@pytest.mark.parametrize("path", [pytest.param("replay", marks=pytest.mark.gpu), "legacy", "auto"])
def test_paths_match_plain_greedy(model, plain, path):
    """Eager. Forced replay runs on the GPU only: "auto" covers its switches on the CPU."""
    table = {K + 1: 2} if path == "auto" else None
    engine = run_script(model, plain, verify_path=path, verify_table=table, cuda_graphs=False)
    assert engine.stats["steps"] == EXPECTED_STEPS[path]
    assert engine.stats["drafts_accepted"] < engine.stats["drafts_proposed"]  # some drafts were wrong
    assert engine.legacy_max_batch == {"replay": 0, "legacy": 2, "auto": 1}[path]


def test_plain_and_legacy_steps_equal_plain_decode(model):
    """Model level, with a pad row and a cache larger than the batch: prompts fed through plain
    steps give decode's logits and states; then after a legacy verify and its commit, each slot's
    SSM state and conv window equal a plain decode of exactly the accepted tokens (and the verify
    logits equal decode's at the accepted positions); other slots are untouched."""
    dev = model.lm_head.weight.device
    T, W, L = K + 1, model.cfg.d_conv, model.cfg.n_layer
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 256, (2, 3), generator=g).to(dev)
    cache = model.new_cache(5, speculate=K)
    cache.reserve_legacy(3)
    live = torch.tensor([4, 1], dtype=torch.int32, device=dev)
    ref = model.new_cache(2)  # plain cache, decoded token by token
    ref_slots = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    for t in range(prompt.shape[1]):  # a fresh slot needs no flush: its replay history is empty
        got = model.verify(prompt[:, t:t + 1], cache, live, path="plain")[:, 0]
        model.commit(cache, live, torch.ones(2, dtype=torch.int32, device=dev), path="plain")
        torch.testing.assert_close(got, model.decode(prompt[:, t], ref, ref_slots), **FP32)
    assert cache.conv_accepted[live.long()].tolist() == [T, T]  # history ends at the last column
    before = [t.clone() for t in cache.ssm + cache.conv]

    slots = torch.tensor([4, -1, 1], dtype=torch.int32, device=dev)
    toks = torch.randint(0, 256, (3, T), generator=g).to(dev)
    logits = model.verify(toks, cache, slots, path="legacy")
    assert torch.equal(cache.ssm[0], before[0])  # the verify writes only the per-position buffers
    accepted = [2, 0, 3]  # the pad row's count is not read
    model.commit(cache, slots, torch.tensor(accepted, dtype=torch.int32, device=dev), path="legacy")
    for b, row in ((0, 0), (1, 2)):
        for t in range(accepted[row]):
            want = model.decode(toks[row, t:t + 1], ref, ref_slots[b:b + 1])
            torch.testing.assert_close(logits[row, t], want[0], **FP32)
    for layer in range(L):
        for b, (slot, a) in enumerate(((4, 2), (1, 3))):
            torch.testing.assert_close(cache.ssm[layer][slot], ref.ssm[layer][b], **FP32)
            # the conv history ends at column a+W-3: its last W-1 inputs start at column a-1
            torch.testing.assert_close(cache.conv[layer][slot, :, a - 1:a + W - 2], ref.conv[layer][b, :, 1:], **FP32)
    untouched = [0, 2, 3]
    for old, new in zip(before, cache.ssm + cache.conv):
        assert torch.equal(old[untouched], new[untouched])
    assert cache.conv_accepted[live.long()].tolist() == [2, 3]
    assert cache.prev_accepted[live.long()].tolist() == [0, 0] and cache.hist_len[live.long()].tolist() == [0, 0]


def test_engine_legacy_bound_from_table(model):
    kw = dict(max_batch=4, speculate=K, cuda_graphs=False)
    assert Engine(model, verify_table={K + 1: 3}, **kw).legacy_max_batch == 2
    assert Engine(model, verify_table={K + 1: None}, **kw).legacy_max_batch == 4  # replay never wins
    assert Engine(model, verify_table={K + 1: 1}, **kw).legacy_max_batch == 0
    assert Engine(model, verify_path="legacy", **kw).legacy_max_batch == 4
    engine = Engine(model, verify_table={K + 1: None}, legacy_max_batch=2, **kw)
    assert engine.cache.legacy_max_batch == 2
    assert [engine.spec.choose_path(b) for b in (1, 2, 3)] == ["legacy", "legacy", "replay"]  # replay above the bound


def test_verify_path_errors(model):
    dev = model.lm_head.weight.device
    with pytest.raises(ValueError, match="verify_path expected"):
        Engine(model, max_batch=1, speculate=K, verify_path="fast")
    with pytest.raises(ValueError, match="legacy_max_batch=1"):
        Engine(model, max_batch=2, speculate=K, verify_path="legacy", legacy_max_batch=1)
    cache = model.new_cache(4, speculate=K)
    cache.reserve_legacy(2)
    slots = cache.alloc(3)
    toks = torch.zeros(3, K + 1, dtype=torch.int64, device=dev)
    with pytest.raises(ValueError, match=r"legacy_max_batch=2.*got a step of 3"):
        model.verify(toks, cache, slots, path="legacy")
    with pytest.raises(ValueError, match="T = 1 on the plain path"):
        model.verify(toks, cache, slots, path="plain")
    with pytest.raises(ValueError, match="`path` expected"):
        model.verify(toks, cache, slots, path="fast")
    with pytest.raises(ValueError, match=r"\[1, 3\]"):
        model.commit(cache, slots[:2], torch.tensor([0, 1], device=dev), path="legacy")
    with pytest.raises(ValueError, match="every slot is pad"):
        cache.commit_legacy(torch.full((2,), -1, dtype=torch.int32, device=dev), torch.ones(2, device=dev))

    class TooMany:
        def propose(self, requests, k):
            return [[1] * (k + 1) for _ in requests]

    engine = Engine(model, max_batch=1, speculate=K, drafter=TooMany(), cuda_graphs=False)
    engine.add_request([1, 2])
    engine.step()  # prefill
    with pytest.raises(ValueError, match="at most K=2"):
        engine.step()


# ------------------------------------------------------------------ CUDA graphs (GPU)

@pytest.mark.gpu
@pytest.mark.parametrize("path", ["replay", "legacy", "auto"])
def test_graphed_paths_match_plain_greedy(model, plain, path):
    """The scripted run from CUDA graphs: buckets 1 and 2 (max_batch 2) per path, the legacy commit
    graph, flushes at the switches; the same tokens as plain greedy."""
    table = {K + 1: 2} if path == "auto" else None
    engine = run_script(model, plain, verify_path=path, verify_table=table)
    assert engine.verifier is not None
    assert engine.stats["steps"] == EXPECTED_STEPS[path]
    captured = {p for p, _ in engine.verifier.graphs}
    assert captured == {p for p, n in EXPECTED_STEPS[path].items() if n}


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["replay", "legacy"])
def test_graphed_padded_buckets_match_plain_greedy(model, plain, path):
    """Three requests in a max_batch=4 engine: the bucket-4 graph runs with a padded row, then
    buckets 2 and 1 as requests finish; n-gram drafts (rejections) and oracle drafts."""
    n_new = (3, 8, 12)
    for drafter in (None, OracleDrafter.from_runs(PROMPTS, plain)):
        engine = Engine(model, max_batch=4, speculate=K, drafter=drafter, verify_path=path)
        outs = engine.generate(list(PROMPTS), [SamplingParams(max_new_tokens=n) for n in n_new])
        assert outs == [p[:n] for p, n in zip(plain, n_new)]
        assert {b for _, b in engine.verifier.graphs} >= {4, 2, 1}
        assert {p for p, _ in engine.verifier.commit_graphs} == {path}
        assert {b for _, b in engine.verifier.commit_graphs} >= {4, 2, 1}


@pytest.mark.gpu
def test_graphed_verify_matches_eager(model):
    """GraphedVerifier against eager verify + commit on a copy of the cache, per path, a padded
    bucket (3 of 4): the same logits and, after the commits, the same states."""
    from fastmamba.generation.cuda_graphs import GraphedVerifier

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(2)
    caches = [model.new_cache(6, speculate=K) for _ in range(2)]
    slots = torch.tensor([5, 0, 3], dtype=torch.int32, device=dev)
    prompt = torch.randint(0, 256, (3, 7), generator=g).to(dev)
    for c in caches:
        c.reserve_legacy(4)
        model.prefill(prompt, c, slots)
    verifier = GraphedVerifier(model, caches[1], max_batch=4)
    for step, path in enumerate(["legacy", "replay", "replay", "plain", "legacy", "legacy"]):
        ntok = 1 if path == "plain" else K + 1
        toks = torch.randint(0, 256, (3, ntok), generator=g).to(dev)
        accepted = torch.randint(1, ntok + 1, (3,), generator=g).to(device=dev, dtype=torch.int32)
        if path != "replay":
            for c in caches:
                c.flush(slots)
        want = model.verify(toks, caches[0], slots, path=path)
        got = verifier.verify(toks, slots, path)
        torch.testing.assert_close(got, want, **FP32)
        model.commit(caches[0], slots, accepted, path=path)
        verifier.commit(slots, accepted, path)
    caches[0].flush(slots)
    caches[1].flush(slots)
    for a, b in zip(caches[0].ssm + caches[0].conv, caches[1].ssm + caches[1].conv):
        torch.testing.assert_close(a, b, **FP32)
    assert torch.equal(caches[0].conv_accepted, caches[1].conv_accepted)


@pytest.mark.gpu
def test_bf16_graphed_legacy_verify_reproduces_graphed_plain_decoding():
    """bf16 weights (a step's projections run as fastmamba's gemv, PDL on by default in both kinds
    of graph): a legacy verify step's logits equal, bit for bit, those of plain decode steps over
    the same tokens. The oracle drafter's acceptance in bf16 rests on it (gemv.configs.ONE_ROW_FMA)."""
    import fastmamba
    from fastmamba.generation.cuda_graphs import GraphedDecoder, GraphedVerifier

    model = fastmamba.load_model("mamba2-tiny", device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 256, (2, 5), generator=g).cuda()
    slots = torch.tensor([1, 3], dtype=torch.int32, device="cuda")
    dec_cache, spec_cache = model.new_cache(4), model.new_cache(4, speculate=K)
    spec_cache.reserve_legacy(2)
    model.prefill(prompt, dec_cache, slots)
    model.prefill(prompt, spec_cache, slots)
    decoder = GraphedDecoder(model, dec_cache, max_batch=2)
    verifier = GraphedVerifier(model, spec_cache, max_batch=2)
    toks = torch.randint(0, 256, (2, K + 1), generator=g).cuda()
    got = verifier.verify(toks, slots, "legacy").clone()
    for t in range(K + 1):
        assert torch.equal(got[:, t], decoder.decode(toks[:, t], slots)), f"position {t}"
