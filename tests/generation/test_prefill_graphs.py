"""Graphed prefill: bucket choice, the padded layout, and that the padded call it captures gives the
real requests exactly what the unpadded call gives them (CPU, eager: the padding scheme itself);
the capture and replay run on a GPU."""
from __future__ import annotations

import pytest
import torch

import fastmamba
from fastmamba.generation.prefill_graphs import GraphedPrefill, padded_layout, powers_of_two_up_to, token_buckets_up_to
from tests.helpers import seeded, tol


def test_buckets_and_layout():
    assert powers_of_two_up_to(16, 100) == [16, 32, 64, 100]
    assert powers_of_two_up_to(2, 2) == [2]
    assert padded_layout([5, 3], 16, 4) == [5, 3, 1, 7]  # two padding requests: 1 token, then the rest
    assert padded_layout([16], 32, 2) == [16, 16]
    assert padded_layout([16], 16, 1) == [16]  # an exact fit: no padding request
    assert padded_layout([10, 6], 16, 2) == [10, 6]
    with pytest.raises(ValueError, match="do not fit"):
        padded_layout([16], 16, 2)  # the padding request needs a token
    with pytest.raises(ValueError, match="do not fit"):
        padded_layout([15], 16, 1)  # not exact, and no padding request
    with pytest.raises(ValueError, match="do not fit"):
        padded_layout([1, 1], 16, 2)  # no room for a padding request


def test_bucket_choice_leaves_room_for_padding():
    gp = object.__new__(GraphedPrefill)  # bucket arithmetic only: no device needed
    gp.token_buckets = powers_of_two_up_to(16, 2048)
    gp.request_buckets = powers_of_two_up_to(2, 9)
    assert gp.buckets([17]) == (32, 2)  # 17 tokens + one padding token
    assert gp.buckets([16]) == (16, 1)  # an exact fit: no padding request
    assert gp.buckets([15]) == (16, 2)
    assert gp.buckets([8, 8]) == (16, 2)  # exact, and 2 is a request bucket
    assert gp.buckets([8, 4, 4]) == (32, 4)  # exact in tokens, but 3 requests: padded to 4
    assert gp.buckets([5, 5, 5]) == (16, 4)
    assert gp.buckets([5, 5, 6]) == (32, 4)
    assert gp.buckets([100] * 8) == (1024, 9)
    assert gp.buckets([1] * 9) is None  # more requests than the largest bucket holds
    assert gp.buckets([2048]) == (2048, 1)  # the largest bucket, exactly
    assert gp.buckets([2047, 1]) == (2048, 2)
    assert gp.buckets([2049]) is None
    assert gp.buckets([2046, 1]) is None  # no room for the padding token


def test_token_buckets_pad_by_less_than_half():
    assert token_buckets_up_to(16, 200) == [16, 24, 32, 48, 64, 96, 128, 192, 200]
    assert token_buckets_up_to(16, 20) == [16, 20]
    gp = object.__new__(GraphedPrefill)
    gp.token_buckets = token_buckets_up_to(16, 2113)
    gp.request_buckets = powers_of_two_up_to(2, 65)
    assert gp.buckets([512]) == (512, 1)  # exact
    assert gp.buckets([511]) == (512, 2)
    assert gp.buckets([513]) == (768, 2)  # 514 tokens with the padding request
    assert gp.buckets([512, 512]) == (1024, 2)  # exact
    assert gp.buckets([512, 513]) == (1536, 4)
    assert gp.buckets([64]) == (64, 1)  # a prefix-cache hit's 64 new tokens: no padding (was 96 with it)
    assert gp.buckets([65]) == (96, 2)
    for n in range(1, 2050, 37):  # every fit wastes less than half of its bucket
        tb, rb = gp.buckets([n])
        assert (tb, rb) == (n, 1) if n in gp.token_buckets else n + 1 <= tb and (tb <= 16 or tb < 1.5 * (n + 1) + 1)


@pytest.fixture(scope="module")
def model():
    return fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cpu")


def test_padded_call_equals_unpadded(model):
    """What a graph replays: the real requests, then padding requests on slot -1. Real logits and
    slots equal the unpadded call; the padding touches no slot."""
    g = seeded(0)
    lengths = [5, 19, 1]
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in lengths]
    slots = [3, 0, 4]

    def fresh_cache():
        cache = model.new_cache(6)
        gen = seeded(1)
        for pool in (*cache.conv, *cache.ssm):
            pool.copy_(torch.randn(pool.shape, generator=gen))
        return cache

    want_cache = fresh_cache()
    cu = torch.tensor([0, 5, 24, 25], dtype=torch.int32)
    flags = torch.tensor([True, False, True])
    want = model.prefill_varlen(torch.cat(prompts), cu, want_cache, torch.tensor(slots, dtype=torch.int32), flags)

    layout = padded_layout(lengths, 32, 4)  # 25 real tokens, padding requests of 1 and 6 tokens
    got_cache = fresh_cache()
    ids = torch.cat([*prompts, torch.zeros(32 - 25, dtype=torch.int64)])
    cu_pad = torch.tensor([0, *torch.tensor(layout).cumsum(0).tolist()], dtype=torch.int32)
    slots_pad = torch.tensor(slots + [-1], dtype=torch.int32)
    flags_pad = torch.tensor([True, False, True, False])
    got = model.prefill_varlen(ids, cu_pad, got_cache, slots_pad, flags_pad)
    torch.testing.assert_close(got[:3], want, **tol(torch.float32))
    for a, b in zip((*got_cache.conv, *got_cache.ssm), (*want_cache.conv, *want_cache.ssm)):
        torch.testing.assert_close(a, b, **tol(torch.float32))  # padding wrote no slot (1, 2 and 5 untouched)


@pytest.mark.gpu
def test_graphed_prefill_equals_eager():
    m = fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cuda")
    g = seeded(2)
    cases = [[7], [16], [32, 32], [512], [3, 40, 1], [100, 100, 100, 5]]  # [16], [32, 32], [512]: exact fits
    for lengths in cases:
        prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
        eager_cache, graph_cache = m.new_cache(8), m.new_cache(8)
        slots = list(range(len(lengths)))[::-1]
        want = m.prefill_varlen(torch.tensor([t for p in prompts for t in p], device="cuda"),
                                torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                                             device="cuda"),
                                eager_cache, torch.tensor(slots, dtype=torch.int32, device="cuda"), False)
        gp = GraphedPrefill(m, graph_cache, max_tokens=512, max_requests=7)
        if sum(lengths) in gp.token_buckets and len(lengths) in (1, 2):
            assert gp.buckets(lengths) == (sum(lengths), len(lengths))  # no padding request
        for i in range(2):  # first call captures, second replays
            got = gp.prefill(prompts, slots, False)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert gp.captured.count == 1 and gp.captured.seconds > 0, i  # counted once, at the first call
        for a, b in zip((*graph_cache.conv, *graph_cache.ssm), (*eager_cache.conv, *eager_cache.ssm)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_snapshot_count_decides_the_fit():
    gp = object.__new__(GraphedPrefill)
    gp.token_buckets = token_buckets_up_to(16, 512)
    gp.request_buckets = powers_of_two_up_to(2, 9)
    gp.chunk = 64
    assert gp.fits([256]) and gp.fits([256], 4)  # the 256-token bucket holds 4 chunk ends
    assert not gp.fits([256], 5)
    assert gp.fits([100], 2) and not gp.fits([100], 3)  # 101 tokens with the padding request: the 128 bucket
    assert not gp.fits([600], 0)  # no bucket at all


@pytest.mark.gpu
def test_graphed_prefill_with_snapshots_equals_eager():
    """Prefix-cache snapshots from a graph: the same pool rows, logits and slot states as the eager
    call with the same plan. Three snapshots take the bucket's graph for four (one repeated), a
    second call in the bucket with one snapshot the graph for one; only the plans' rows are written."""
    from fastmamba.cache.prefix_cache import SnapshotPlan

    m = fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cuda")
    Q = m.cfg.chunk_size
    g = seeded(3)
    pool_e, pool_g = m.new_cache(6), m.new_cache(6)  # rows that receive the snapshots
    eager_cache, graph_cache = m.new_cache(8), m.new_cache(8)
    for pool in (*pool_e.conv, *pool_e.ssm, *pool_g.conv, *pool_g.ssm):
        pool.fill_(float("nan"))
    gp = GraphedPrefill(m, graph_cache, max_tokens=8 * Q, max_requests=3)
    calls = [  # (lengths, snapshot (sequence, end, row) triples)
        ([3 * Q + 5, 2 * Q], [(0, Q, 0), (0, 3 * Q, 1), (1, 2 * Q, 2)]),
        ([2 * Q + 1, 3 * Q - 2], [(1, 2 * Q, 3)]),  # the same (8 Q, 4) bucket, one snapshot
    ]
    for lengths, snaps in calls:
        prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
        slots = [5, 2]
        seq, ends, rows = (tuple(v) for v in zip(*snaps))
        want = m.prefill_varlen(torch.tensor([t for p in prompts for t in p], device="cuda"),
                                torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                                             device="cuda"),
                                eager_cache, torch.tensor(slots, dtype=torch.int32, device="cuda"), False,
                                snapshots=SnapshotPlan(seq, ends, rows, pool_e.conv, pool_e.ssm))
        assert gp.fits(lengths, len(snaps))
        got = gp.prefill(prompts, slots, False, snapshots=SnapshotPlan(seq, ends, rows, pool_g.conv, pool_g.ssm))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for a, b in zip((*graph_cache.conv, *graph_cache.ssm), (*eager_cache.conv, *eager_cache.ssm)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        for a, b in zip((*pool_g.conv, *pool_g.ssm), (*pool_e.conv, *pool_e.ssm)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, equal_nan=True)  # rows 4, 5: never written
    assert sorted(k[2] for k in gp.graphs) == [1, 4]  # one bucket; 3 snapshots padded to 4, then 1
    assert all(torch.isnan(p[4:]).all() for p in (*pool_g.conv, *pool_g.ssm))
    other = m.new_cache(6)
    with pytest.raises(ValueError, match="same pools"):
        gp.prefill([[1] * Q], [0], False, snapshots=SnapshotPlan((0,), (Q,), (0,), other.conv, other.ssm))
    with pytest.raises(TypeError, match="expected a SnapshotPlan"):
        gp.prefill([[1] * Q], [0], False, snapshots=[(0, Q, 0)])
    with pytest.raises(ValueError, match="names sequences"):
        gp.prefill([[1] * Q], [0], False, snapshots=SnapshotPlan((1,), (Q,), (0,), pool_g.conv, pool_g.ssm))
