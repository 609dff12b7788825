"""Prefix caching in the engine: block snapshots taken during prefill, end-of-request snapshots,
hits that skip the cached tokens, exactness (fp32), multi-turn conversations, bounded memory."""
from __future__ import annotations

import pytest
import torch

import fastmamba
from fastmamba.cache.prefix_cache import SnapshotPlan
from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    m = fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cpu")
    assert m.cfg.chunk_size == 16
    return m


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_logits(model, cache, slot, ids, *, continue_=False, snapshots=None):
    return model.prefill_varlen(torch.tensor(ids), torch.tensor([0, len(ids)], dtype=torch.int32), cache,
                                torch.tensor([slot], dtype=torch.int32), has_initial_state=continue_,
                                snapshots=snapshots)


def test_snapshots_from_the_scan_equal_a_prefill_that_stops_there(model):
    """The states a prefill copies out at chunk ends are the states of a prefill of just that prefix
    (bit-equal to the slot's own final state when the snapshot is at the end of the sequence)."""
    cache = model.new_cache(4)
    pool = model.new_cache(3)  # rows to write the snapshots into
    a, b = tokens(41, 1), tokens(32, 2)
    ids = a + b
    cu = torch.tensor([0, len(a), len(ids)], dtype=torch.int32)
    plan = SnapshotPlan(seq=(0, 1, 0), ends=(16, 32, 32), rows=(2, 0, 1), conv=pool.conv, ssm=pool.ssm)
    for layer in range(model.cfg.n_layer):
        pool.conv[layer].fill_(float("nan"))
        pool.ssm[layer].fill_(float("nan"))
    model.prefill_varlen(torch.tensor(ids), cu, cache, torch.tensor([0, 1], dtype=torch.int32),
                         has_initial_state=False, snapshots=plan)
    for layer in range(model.cfg.n_layer):  # sequence 1 ends at its snapshot: the very same values
        assert torch.equal(pool.ssm[layer][0], cache.ssm[layer][1])
        assert torch.equal(pool.conv[layer][0], cache.conv[layer][1])
    for seq, end, row in zip(plan.seq, plan.ends, plan.rows):
        prefill_logits(model, cache, 3, (a, b)[seq][:end])
        for layer in range(model.cfg.n_layer):
            # another call, other row counts: the projections round differently in the last bits
            torch.testing.assert_close(pool.ssm[layer][row], cache.ssm[layer][3], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(pool.conv[layer][row], cache.conv[layer][3], rtol=1e-5, atol=1e-6)


def test_bad_snapshot_plans_are_refused_before_anything_runs(model):
    cache = model.new_cache(2)
    before = [s.clone() for s in cache.ssm]
    pool = model.new_cache(2)
    for ends, match in (((8,), "multiple of the chunk size 16"), ((32,), "at most the sequence's 20 tokens")):
        plan = SnapshotPlan((0,), ends, (0,), pool.conv, pool.ssm)
        with pytest.raises(ValueError, match=match):
            prefill_logits(model, cache, 0, tokens(20, 3), snapshots=plan)
    with pytest.raises(ValueError, match=r"rows in \[0, 2\)"):
        prefill_logits(model, cache, 0, tokens(20, 3), snapshots=SnapshotPlan((0,), (16,), (5,), pool.conv, pool.ssm))
    assert all(torch.equal(x, y) for x, y in zip(before, cache.ssm))


def test_a_hit_gives_bit_equal_logits_in_fp32(model):
    """A restored snapshot holds its source's states bit for bit, so prefilling the rest of a prompt
    from it gives the logits that prefilling the rest from the source slot gives, bit for bit; and
    they match one unsplit prefill of the whole prompt to fp32 rounding. (Bit-equality with the
    unsplit call is not to be had from any cache: the projections' GEMMs block by row count, so a
    41-row and a 9-row product of the same rows may differ in their last bits, as two differently
    packed batches do.)"""
    cache = model.new_cache(4)
    pool = model.new_cache(1)
    shared, tail = tokens(32, 4), tokens(9, 5)
    plan = SnapshotPlan((0,), (32,), (0,), pool.conv, pool.ssm)
    prefill_logits(model, cache, 1, shared, snapshots=plan)  # without a cache: the prefix, then the rest
    for layer in range(model.cfg.n_layer):
        cache.conv[layer][2] = pool.conv[layer][0]  # with one: restore, then the rest
        cache.ssm[layer][2] = pool.ssm[layer][0]
    split = prefill_logits(model, cache, 1, tail, continue_=True)
    hit = prefill_logits(model, cache, 2, tail, continue_=True)
    assert torch.equal(hit, split)
    for layer in range(model.cfg.n_layer):
        assert torch.equal(cache.ssm[layer][2], cache.ssm[layer][1])
        assert torch.equal(cache.conv[layer][2], cache.conv[layer][1])
    whole = prefill_logits(model, cache, 3, shared + tail)
    torch.testing.assert_close(hit, whole, rtol=1e-5, atol=1e-5)


def run(engine: Engine, prompts, params=GREEDY):
    return engine.generate(prompts, params)


@pytest.mark.parametrize("prefill_chunk", [None, 16])
def test_engine_hits_skip_the_cached_tokens_and_keep_the_output(model, prefill_chunk):
    shared = tokens(48, 7)
    first, second = shared + tokens(11, 8), shared + tokens(6, 9)
    plain = Engine(model, max_batch=2, cuda_graphs=False, prefill_chunk=prefill_chunk)
    want = run(plain, [first]) + run(plain, [second])
    eng = Engine(model, max_batch=2, cuda_graphs=False, prefill_chunk=prefill_chunk, prefix_cache_entries=8,
                 prefix_block=16)
    assert run(eng, [first]) == want[:1]
    before = eng.stats["prefill_tokens"]
    assert before == len(first)
    assert run(eng, [second]) == want[1:]
    assert eng.stats["prefill_tokens"] - before == len(second) - 48  # the block snapshot at 48 was hit
    st = eng.prefix_stats
    assert st["hits"] == 1 and st["hit_tokens"] == 48 and st["lookups"] == 2


def test_multi_turn_conversation_prefills_only_the_new_tokens(model):
    """Five turns: each turn's prompt is the history (prompt and reply) plus new user tokens; with
    the end-of-request snapshot only the new tokens and the last reply token (which the state had
    not consumed yet) are prefilled, whatever the block size."""
    eng = Engine(model, max_batch=2, cuda_graphs=False, prefix_cache_entries=16, prefix_block=64)
    ref = Engine(model, max_batch=2, cuda_graphs=False)
    history: list[int] = []
    for turn in range(5):
        new = tokens(7 + 3 * turn, 20 + turn)
        prompt = history + new
        before = eng.stats["prefill_tokens"]
        reply = run(eng, [prompt])[0]
        assert reply == run(ref, [prompt])[0]  # same output as without the cache
        prefilled = eng.stats["prefill_tokens"] - before
        assert prefilled == (len(new) if turn == 0 else len(new) + 1), (turn, prefilled)
        history = prompt + reply
    assert eng.prefix_stats["hits"] == 4


def test_a_prompt_that_is_exactly_a_cached_prefix_still_runs_its_last_token(model):
    eng = Engine(model, max_batch=1, cuda_graphs=False, prefix_cache_entries=4, prefix_block=16)
    ref = Engine(model, max_batch=1, cuda_graphs=False)
    p = tokens(32, 30)
    assert run(eng, [p + [1, 2]]) == run(ref, [p + [1, 2]])  # snapshots at 16 and 32
    assert run(eng, [p]) == run(ref, [p])  # the 32-token snapshot cannot serve a 32-token prompt
    assert eng.prefix_stats["hit_tokens"] == 16
    eng.prefix.stats["saves"] = 0
    assert run(eng, [tokens(48, 31)]) and eng.prefix.stats["saves"] == 3  # 16, 32 and the end of the request


def test_pool_stays_bounded_and_aborted_or_failed_requests_save_nothing(model):
    eng = Engine(model, max_batch=4, cuda_graphs=False, prefix_cache_entries=3, prefix_block=16)
    prompts = [tokens(40, 40 + i) for i in range(6)]
    run(eng, prompts)
    assert len(eng.prefix) == 3 and eng.prefix.stats["evictions"] > 0
    rid = eng.add_request(tokens(20, 50), GREEDY)
    saves = eng.prefix.stats["saves"]
    eng.abort(rid)
    assert eng.prefix.stats["saves"] == saves
    assert eng.cache.free_slots == 4


def test_prefix_cache_with_speculation_takes_block_snapshots_only(model):
    shared = tokens(32, 60)
    eng = Engine(model, max_batch=2, cuda_graphs=False, speculate=2, prefix_cache_entries=4, prefix_block=16)
    ref = Engine(model, max_batch=2, cuda_graphs=False, speculate=2)
    for tail_seed in (61, 62):
        p = shared + tokens(5, tail_seed)
        assert run(eng, [p]) == run(ref, [p])
    assert eng.prefix_stats["hit_tokens"] == 32
    assert all(e.length in (16, 32) for e in eng.prefix._by_key.values())  # no end-of-request snapshot


def test_engine_checks_prefix_options(model):
    with pytest.raises(ValueError, match="multiple of the model's chunk_size 16"):
        Engine(model, cuda_graphs=False, prefix_cache_entries=2, prefix_block=24)
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        Engine(model, cuda_graphs=False, prefix_cache_bytes=-1)
    assert Engine(model, cuda_graphs=False).prefix is None
    assert Engine(model, cuda_graphs=False, prefix_cache_entries=1).prefix_block == 512


@pytest.mark.kernels
def test_snapshots_through_the_triton_kernels(model):
    """The same snapshot points through the kernels' path (the interpreter on a CPU): the scan's
    chunk_states_out and the conv gather give the states of a prefill that stops there."""
    test_snapshots_from_the_scan_equal_a_prefill_that_stops_there(model)


@pytest.mark.gpu
def test_engine_prefix_cache_on_gpu_keeps_the_output():
    m = fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cuda")
    shared = tokens(64, 70)
    prompts = [shared + tokens(9, 71), shared + tokens(20, 72), shared + tokens(3, 73)]
    ref = Engine(m, max_batch=4)
    eng = Engine(m, max_batch=4, prefix_cache_entries=8, prefix_block=32)
    want = [run(ref, [p])[0] for p in prompts]
    assert [run(eng, [p])[0] for p in prompts] == want
    assert eng.prefix_stats["hit_tokens"] == 2 * 64


@pytest.mark.gpu
def test_engine_snapshot_prefills_replay_graphs():
    """Prompt chunks that take block snapshots replay CUDA graphs too (they ran eagerly before), with
    the output of an engine without graphs and the same cache hits afterwards."""
    m = fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cuda")
    shared = tokens(96, 80)
    prompts = [shared + tokens(7, 81), shared + tokens(40, 82)]
    ref = Engine(m, max_batch=4, cuda_graphs=False, prefix_cache_entries=8, prefix_block=32)
    eng = Engine(m, max_batch=4, prefix_cache_entries=8, prefix_block=32, prefill_chunk=64)
    want = [run(ref, [p])[0] for p in prompts]
    assert [run(eng, [p])[0] for p in prompts] == want
    assert any(key[2] for key in eng.prefiller.graphs)  # a graph with snapshots ran
    assert eng.prefix_stats["hit_tokens"] == ref.prefix_stats["hit_tokens"] > 0


def test_warm_up_leaves_nothing_behind(model):
    """Engine.warm_up runs one request and keeps nothing of it: no request, no slot, no snapshot, no
    counted prefill token; it refuses to run next to queued requests."""
    eng = Engine(model, max_batch=2, cuda_graphs=False, prefix_cache_entries=4, prefix_block=16)
    free = eng.cache.free_slots
    eng.warm_up()
    assert not eng.has_unfinished() and not eng.finished and eng.cache.free_slots == free
    assert eng.stats["prefill_tokens"] == 0 and eng.prefix_stats["lookups"] == 0
    assert eng.prefix.match([0] * 40) is None  # the warm-up prompt is zeros
    eng.add_request(tokens(5, 91), GREEDY)
    with pytest.raises(RuntimeError, match="warm up before adding any"):
        eng.warm_up()


@pytest.mark.gpu
def test_warm_up_captures_a_long_prompts_graphs():
    """With CUDA graphs, the warm-up prefills a whole chunk (with the prefix cache: its snapshot graph)
    and decodes, so a client's prompt of that size meets graphs that exist; its output is unchanged."""
    m = fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cuda")
    eng = Engine(m, max_batch=4, prefix_cache_entries=8, prefix_block=32, prefill_chunk=64)
    eng.warm_up()
    warm = set(eng.prefiller.graphs)
    assert any(k[0] == 64 and k[2] > 0 for k in warm), warm  # the 64-token chunk with its snapshot
    assert eng.graph_captures["count"] > len(warm)  # a decode graph too
    prompt = tokens(64 + 9, 92)
    ref = Engine(m, max_batch=4, cuda_graphs=False, prefix_cache_entries=8, prefix_block=32, prefill_chunk=64)
    assert run(eng, [prompt]) == run(ref, [prompt])
    first_chunk = [k for k in eng.prefiller.graphs if k[0] == 64 and k[2] > 0]
    assert first_chunk and set(first_chunk) <= warm  # the request's first chunk replayed the warm-up's graph
