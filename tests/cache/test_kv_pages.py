"""Paged KV bookkeeping: pages follow requests' lengths, none leaks or is shared under churn, and
HybridCache hands out Mamba slots and KV rows together (one alloc / free per request)."""
from __future__ import annotations

import random

import pytest
import torch

from fastmamba.cache.hybrid_cache import HybridCache
from fastmamba.cache.kv_pages import KVPages
from fastmamba.models.nemotron_h import PRESETS
from fastmamba.ops.attention import paged_kv_write


def tiny_pages(**kw):
    args = dict(num_layers=1, num_pages=10, num_rows=3, max_pages_per_row=4, page_size=4, n_kv_heads=1,
                 head_dim=2, device="cpu", dtype=torch.float32)
    args.update(kw)
    return KVPages(**args)


def test_grow_allocates_pages_as_rows_grow_and_release_returns_them():
    kv = tiny_pages()
    assert kv.grow([1, 0], [5, 4]) == [0, 0]
    assert [len(kv.pages_of(r)) for r in range(3)] == [1, 2, 0]
    assert kv.grow([1], [3]) == [5]          # 8 tokens: still two pages
    assert len(kv.pages_of(1)) == 2 and kv.free_pages == 7
    assert kv.grow([0], [1]) == [4]          # the 5th token opens a page
    assert len(kv.pages_of(0)) == 2
    assert kv.block_table[0, :2].tolist() == kv.pages_of(0) and kv.seq_lens.tolist() == [5, 8, 0]
    kv.check()
    kv.truncate(1, 3)
    assert len(kv.pages_of(1)) == 1 and kv.seq_lens[1] == 3
    kv.release([0, 1])
    kv.check()
    assert kv.free_pages == 10 and kv.seq_lens.tolist() == [0, 0, 0]


def test_grow_refuses_without_changing_anything():
    kv = tiny_pages(num_pages=3)
    kv.grow([0], [8])
    with pytest.raises(RuntimeError, match="2 pages needed, 1 of 3 free"):
        kv.grow([1, 2], [4, 4])
    with pytest.raises(ValueError, match="max_len=16"):
        kv.grow([0], [9])
    with pytest.raises(ValueError, match="listed twice"):
        kv.grow([1, 1], [1, 1])
    kv.check()
    assert kv.free_pages == 1 and kv.length(1) == 0 and kv.length(0) == 8
    with pytest.raises(ValueError, match="`page_size` expected a power of two"):
        tiny_pages(page_size=6)


def test_churn_no_page_leaked_or_shared(monkeypatch):
    """Hundreds of random joins, growth steps, rollbacks and leaves; after each one the books
    balance, and every live request reads back exactly the tokens it wrote (a shared page would
    overwrite another request's values). The books are under test, not the write kernel
    (tests/ops/attention compares it with its reference): the ~500 writes take paged_kv_write's
    PyTorch path, which indexes the same block table (the interpreter spent ~15 s on them)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rng = random.Random(0)
    S, PAGE = 6, 4
    cache = HybridCache(S, mamba_cfg=None, n_attn_layers=1, n_kv_heads=1, head_dim=1, max_seq_len=40,
                        page_size=PAGE, num_pages=30, device="cpu", dtype=torch.float32)
    kv = cache.kv
    live: dict[int, list[float]] = {}  # slot -> the values its tokens hold, by position
    stamp = 0.0
    joins = leaves = 0
    for _ in range(1200):
        op = rng.random()
        if op < 0.3 and cache.free_slots:
            n = rng.randint(1, 12)
            if kv.free_pages < -(-n // PAGE):
                continue
            joins += 1
            slot = int(cache.alloc(1)[0])
            live[slot] = []
            toks = [n]
        elif op < 0.65 and live:
            slot = rng.choice(list(live))
            toks = [rng.randint(1, 3)]
        elif op < 0.75 and live:
            slot = rng.choice(list(live))
            new_len = rng.randint(0, len(live[slot]))
            cache.truncate(slot, new_len)
            del live[slot][new_len:]
            kv.check()
            continue
        elif live:
            slot = rng.choice(list(live))
            cache.free([slot])
            del live[slot]
            leaves += 1
            kv.check()
            continue
        else:
            continue
        if len(live[slot]) + toks[0] > kv.max_len or not cache.can_grow([slot], toks):
            continue
        start = cache.grow([slot], toks)[0]
        vals = [stamp + i for i in range(toks[0])]
        stamp += toks[0]
        t = torch.tensor(vals).view(-1, 1, 1)
        paged_kv_write(t, -t, kv.k[0], kv.v[0], kv.block_table, torch.tensor([slot]),
                       torch.arange(start, start + toks[0]), torch.zeros(toks[0], dtype=torch.int32))
        live[slot] += vals
        kv.check()
        for s, want in live.items():
            pages = kv.pages_of(s)
            got = kv.k[0][pages].reshape(-1)[: len(want)].tolist() if pages else []
            assert got == want, f"slot {s} lost its tokens"
    assert joins >= 100 and leaves >= 100, (joins, leaves)
    cache.free(list(live))
    kv.check()
    assert kv.free_pages == kv.num_pages and cache.free_slots == S


def test_hybrid_cache_one_alloc_one_free_for_both_kinds():
    cfg = PRESETS["nemotron-h-tiny"]
    cache = HybridCache(3, mamba_cfg=cfg.mamba, n_attn_layers=len(cfg.layers_of("*")), n_kv_heads=cfg.n_kv_heads,
                        head_dim=cfg.head_dim, max_seq_len=32, page_size=8, device="cpu", dtype=torch.float32)
    assert len(cache.conv) == len(cache.ssm) == cfg.pattern.count("M") and len(cache.kv.k) == cfg.pattern.count("*")
    slots = cache.alloc(2)
    assert slots.tolist() == [0, 1] and cache.state.free_slots == cache.free_slots == 1
    cache.ssm[0][1] = 1.0
    cache.grow(slots.tolist(), [9, 3])
    assert cache.kv.free_pages == cache.kv.num_pages - 3 and cache.length(0) == 9
    cache.free([1])
    assert cache.state.free_slots == cache.free_slots == 2 and cache.kv.free_pages == cache.kv.num_pages - 2
    again = cache.alloc(1)
    assert again.tolist() == [1] and torch.count_nonzero(cache.ssm[0][1]) == 0 and cache.length(1) == 0
    with pytest.raises(ValueError, match="slot 2 is not allocated"):
        cache.free([0, 2])
    assert cache.free_slots == 1  # nothing was freed by the refused call
    with pytest.raises(ValueError, match="HybridCache.grow: slot 2 is not allocated"):
        cache.grow([2], [1])
    budget = HybridCache(2, mamba_cfg=None, n_attn_layers=2, n_kv_heads=2, head_dim=4, page_size=4,
                         kv_budget_bytes=10 * KVPages.page_bytes(2, 4, 2, 4, torch.float32) + 5,
                         device="cpu", dtype=torch.float32)
    assert budget.kv.num_pages == 10


def test_fp8_pages_half_the_bytes_and_prefix_snapshots_copy_their_bytes():
    """float8_e4m3fn K/V pools (``HybridCache(kv_dtype=)``): half the bytes of bf16 per page (a
    budget holds twice the pages); a prefix-cache snapshot's pages go out and come back bit for bit
    (copied as bytes: index_copy_ has no float8 kernel on the CPU). Other dtypes are refused."""
    from fastmamba.cache.prefix_cache import PrefixCache

    fp8 = torch.float8_e4m3fn
    assert KVPages.page_bytes(2, 16, 8, 128, fp8) * 2 == KVPages.page_bytes(2, 16, 8, 128, torch.bfloat16)
    cfg = PRESETS["nemotron-h-tiny"]
    n_attn = len(cfg.layers_of("*"))
    kw = dict(mamba_cfg=cfg.mamba, n_attn_layers=n_attn, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
              page_size=4, device="cpu", dtype=torch.float32)
    budget = 12 * KVPages.page_bytes(n_attn, 4, cfg.n_kv_heads, cfg.head_dim, torch.bfloat16)
    cache = HybridCache(2, kv_budget_bytes=budget, kv_dtype=fp8, **kw)
    assert cache.kv.num_pages == 24 and all(t.dtype == fp8 for t in cache.kv.k + cache.kv.v)
    assert cache.conv[0].dtype == torch.float32  # the Mamba states keep theirs
    slot = cache.take(1)[0]
    cache.grow([slot], [10])
    g = torch.Generator().manual_seed(0)
    for t in cache.kv.k + cache.kv.v:  # random bytes on every page (NaN codes too: copies are bytes)
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
    pages = cache.kv.pages_of(slot)
    held = [t[pages].view(torch.uint8).clone() for t in cache.kv.k + cache.kv.v]
    prefix = PrefixCache(cache, max_entries=2)
    assert all(t.dtype == fp8 for t in prefix.kv_k + prefix.kv_v)
    entry = prefix.save(list(range(10)), cache, slot)
    other = cache.take(1)[0]
    prefix.restore(prefix.match(list(range(12))), cache, other)
    back = cache.kv.pages_of(other)
    assert entry is not None and back != pages[:len(back)]
    assert len(back) == len(pages) == 3
    for want, t in zip(held, cache.kv.k + cache.kv.v):  # whole pages copied out and back
        assert torch.equal(t[back].view(torch.uint8), want)
    with pytest.raises(ValueError, match="`dtype` expected one of"):
        KVPages(1, 2, 1, 1, n_kv_heads=1, head_dim=4, device="cpu", dtype=torch.float8_e5m2)
