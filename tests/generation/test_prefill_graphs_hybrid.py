"""Graphed prefill of a hybrid model (Mamba-2 + attention + MLP, paged KV): the staged call a graph
replays (padding requests on slot -1, metadata on the device, the cache grown by the caller) gives
the real requests what the eager call gives them, continued prompts included (CPU, interpreter);
the capture and replay, with and without prefix-cache snapshots, and the engine run on a GPU."""
from __future__ import annotations

import itertools

import pytest
import torch

from fastmamba.generation.prefill_graphs import padded_layout
from fastmamba.models.nemotron_h import StagedPrefill, prefill_kv_values
from fastmamba.ops.attention import PrefillWork, prefill_work, work_items_bound
from tests.generation.test_engine_hybrid import CFG, PAGE, build_model, engine_of
from tests.helpers import seeded, tol


def cu_of(lengths):
    return list(itertools.accumulate(lengths, initial=0))


def kv_rows(cache, slot):
    """Every cached token's K and V of ``slot``, layer by layer: [L_attn, n, Hkv, Dh] each."""
    n, pages = cache.length(slot), cache.kv.pages_of(slot)
    ks = torch.stack([k[pages].flatten(0, 1)[:n] for k in cache.kv.k])
    vs = torch.stack([v[pages].flatten(0, 1)[:n] for v in cache.kv.v])
    return ks, vs


def assert_same_caches(got, want, slots, **kw):
    for a, b in zip((*got.conv, *got.ssm), (*want.conv, *want.ssm)):
        torch.testing.assert_close(a[slots], b[slots], **kw)
    for s in slots:
        assert got.length(s) == want.length(s)
        for a, b in zip(kv_rows(got, s), kv_rows(want, s)):
            torch.testing.assert_close(a, b, **kw)


def staged_call(model, cache, prompts, slots, tb, rb):
    """What ``GraphedPrefill`` replays, run eagerly: grow the cache, pad the batch to (tb, rb)
    with requests on slot -1, stage the metadata (``prefill_kv_values``, as it does) as tensors."""
    lengths = [len(p) for p in prompts]
    layout = padded_layout(lengths, tb, rb)
    cu = cu_of(layout)
    ctx = cache.grow(slots, lengths)
    bm = model.prefill_block_tokens()
    items = work_items_bound(tb, rb, bm)
    v = prefill_kv_values(ctx, layout, cu, bm, items)
    staged = StagedPrefill(torch.tensor(v["positions"]), torch.tensor(v["token_rows"]), torch.tensor(v["ctx"]),
                           PrefillWork(torch.tensor(v["work"]).view(items, 2), bm))
    ids = torch.tensor([t for p in prompts for t in p] + [0] * (tb - sum(lengths)))
    flags = torch.tensor([c > 0 for c in ctx] + [False] * (rb - len(slots)))
    sl = slots + [-1] * (rb - len(slots))
    return model.prefill_varlen(ids, torch.tensor(cu, dtype=torch.int32), cache, torch.tensor(sl, dtype=torch.int32),
                                flags, cu_seqlens_host=cu, slots_host=sl, staged=staged)


def test_prefill_kv_values_layout():
    """Two real requests (3 tokens after 5 cached, 2 fresh) and a padding request of 3 tokens."""
    v = prefill_kv_values([5, 0], [3, 2, 3], [0, 3, 5, 8], 2, capacity=7)
    assert v["positions"] == [5, 6, 7, 0, 1, 0, 0, 0]
    assert v["token_rows"] == [0, 0, 0, 1, 1, 2, 2, 2]
    assert v["ctx"] == [5, 0, 0]
    assert v["work"] == [0, 0, 0, 2, 1, 0, 2, 0, 2, 2, -1, 0, -1, 0]


def test_staged_padded_call_equals_eager():
    """Two prompts, then a second chunk of one of them (continuing its states and attending to its
    cached K/V) next to a new prompt: logits, Mamba rows and K/V equal the eager calls'."""
    m = build_model()
    g = seeded(5)
    first = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 3)]
    second = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (6, 11)]
    want_cache = m.new_cache(6, max_seq_len=64, page_size=PAGE)
    got_cache = m.new_cache(6, max_seq_len=64, page_size=PAGE)
    for c in (want_cache, got_cache):
        c.take(5)
    for prompts, slots, (tb, rb) in ((first, [4, 1], (16, 4)), (second, [1, 2], (24, 4))):
        lengths = [len(p) for p in prompts]
        want = m.prefill_varlen(torch.tensor([t for p in prompts for t in p]),
                                torch.tensor(cu_of(lengths), dtype=torch.int32), want_cache,
                                torch.tensor(slots, dtype=torch.int32))
        got = staged_call(m, got_cache, prompts, slots, tb, rb)
        torch.testing.assert_close(got[:len(prompts)], want, **tol(torch.float32))
        assert_same_caches(got_cache, want_cache, [1, 2, 4], **tol(torch.float32))
    got_cache.kv.check()


def test_staged_call_rejects_bad_metadata():
    m = build_model()
    cache = m.new_cache(2, max_seq_len=64, page_size=PAGE)
    s = cache.take(1)
    ids, cu = torch.tensor([1, 2, 3]), torch.tensor([0, 3], dtype=torch.int32)
    slots, flags = torch.tensor(s, dtype=torch.int32), torch.tensor([False])
    bm = m.prefill_block_tokens()
    work = PrefillWork(torch.tensor(prefill_work([0, 3], bm)).view(-1, 2), bm)
    good = StagedPrefill(torch.arange(3), torch.zeros(3, dtype=torch.long), torch.zeros(1, dtype=torch.long), work)
    with pytest.raises(TypeError, match="`staged` expected a StagedPrefill or None, got tuple"):
        m.prefill_varlen(ids, cu, cache, slots, flags, staged=tuple(good))
    with pytest.raises(ValueError, match=r"with `staged`, `has_initial_state` must be a \[B\]=\[1\] bool tensor"):
        m.prefill_varlen(ids, cu, cache, slots, None, staged=good)
    with pytest.raises(ValueError, match=r"`staged.positions` expected a tensor of shape \(3,\), got \(2,\)"):
        m.prefill_varlen(ids, cu, cache, slots, flags, staged=good._replace(positions=torch.arange(2)))
    with pytest.raises(ValueError, match=f"`staged.work` expected a PrefillWork for blocks of {bm} query tokens"):
        m.prefill_varlen(ids, cu, cache, slots, flags, staged=good._replace(work=PrefillWork(work.table, bm + 1)))
    # the eager call takes no pad slots
    with pytest.raises(ValueError, match="`slots` must be distinct allocated slots, got \\[-1\\]"):
        m.prefill_varlen(ids, cu, cache, torch.tensor([-1], dtype=torch.int32))
    assert cache.length(s[0]) == 0  # nothing grew


@pytest.mark.gpu
def test_graphed_hybrid_prefill_equals_eager_on_gpu():
    """GraphedPrefill over a HybridCache: captured once per bucket, replayed for other batches of
    it (other lengths, a continued prompt); logits, states and K/V equal the eager calls'."""
    from fastmamba.generation.prefill_graphs import GraphedPrefill

    m = build_model().cuda()
    g = seeded(6)
    eager, graphed = (m.new_cache(8, max_seq_len=256, page_size=PAGE) for _ in range(2))
    for c in (eager, graphed):
        c.take(6)
    gp = GraphedPrefill(m, graphed, max_tokens=256, max_requests=4)
    calls = [([7, 30], [5, 0]), ([20, 16], [2, 3]), ([40], [0]), ([64], [4]), ([1, 2, 3], [1, 5, 3])]
    for lengths, slots in calls:  # slots 0 and 3 continue; the first two calls share the (48, 4) bucket
        prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
        want = m.prefill_varlen(torch.tensor([t for p in prompts for t in p], device="cuda"),
                                torch.tensor(cu_of(lengths), dtype=torch.int32, device="cuda"), eager,
                                torch.tensor(slots, dtype=torch.int32, device="cuda"))
        got = gp.prefill(prompts, slots, [eager.length(s) > n for s, n in zip(slots, lengths)])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert_same_caches(graphed, eager, list(range(6)), atol=1e-4, rtol=1e-4)
    assert sorted(gp.graphs) == [(16, 4, 0), (48, 2, 0), (48, 4, 0), (64, 1, 0)]  # (48, 4) replayed once
    assert gp.captured.count == 4
    graphed.kv.check()
    with pytest.raises(ValueError, match="has_initial_state is False for slots \\[0\\], which hold tokens"):
        gp.prefill([[1, 2]], [0], False)


@pytest.mark.gpu
def test_graphed_hybrid_prefill_with_snapshots_on_gpu():
    """Prefix-cache snapshots of a hybrid from a graph: the pools' rows equal the eager call's."""
    from fastmamba.cache.prefix_cache import SnapshotPlan
    from fastmamba.generation.prefill_graphs import GraphedPrefill

    m = build_model().cuda()
    Q = CFG.chunk_size
    g = seeded(7)
    eager, graphed = (m.new_cache(4, max_seq_len=256, page_size=PAGE) for _ in range(2))
    pool_e, pool_g = (m.new_cache(4, max_seq_len=16, page_size=PAGE).state for _ in range(2))
    for c in (eager, graphed):
        c.take(2)
    for pool in (*pool_e.conv, *pool_e.ssm, *pool_g.conv, *pool_g.ssm):
        pool.fill_(float("nan"))
    gp = GraphedPrefill(m, graphed, max_tokens=8 * Q, max_requests=3)
    lengths, slots = [3 * Q + 5, 2 * Q], [1, 0]
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    seq, ends, rows = (0, 0, 1), (Q, 3 * Q, 2 * Q), (0, 1, 2)
    want = m.prefill_varlen(torch.tensor([t for p in prompts for t in p], device="cuda"),
                            torch.tensor(cu_of(lengths), dtype=torch.int32, device="cuda"), eager,
                            torch.tensor(slots, dtype=torch.int32, device="cuda"),
                            snapshots=SnapshotPlan(seq, ends, rows, pool_e.conv, pool_e.ssm))
    assert gp.fits(lengths, 3)
    got = gp.prefill(prompts, slots, False, snapshots=SnapshotPlan(seq, ends, rows, pool_g.conv, pool_g.ssm))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for a, b in zip((*pool_g.conv, *pool_g.ssm), (*pool_e.conv, *pool_e.ssm)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, equal_nan=True)  # row 3 never written
    assert_same_caches(graphed, eager, slots, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_engine_hybrid_graphed_prefill_keeps_the_tokens_on_gpu():
    """The engine prefills a hybrid from graphs (chunked, with the prefix cache on) and gives the
    tokens of the engine without graphs."""
    from fastmamba.generation.sampling import SamplingParams
    from tests.generation.test_engine_hybrid import PROMPTS

    m = build_model().cuda()
    prm = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompts = PROMPTS + [PROMPTS[3] * 3 + PROMPTS[2]]
    eager = engine_of(m, max_batch=4, cuda_graphs=False, prefill_chunk=16, max_seq_len=128).generate(prompts, prm)
    eng = engine_of(m, max_batch=4, cuda_graphs=True, prefill_chunk=16, max_seq_len=128, prefix_cache_entries=8,
                    prefix_block=8)
    assert eng.prefiller is not None
    assert eng.generate(prompts, prm) == eager
    assert eng.prefiller.captured.count > 0
    assert eng.cache.kv_pages_in_use == 0
