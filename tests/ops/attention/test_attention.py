"""Attention ops over a paged KV cache against their plain-PyTorch references: the Triton decode
kernel (GQA, block table, per-request lengths, pad rows), the K/V page write and the varlen
prefill attention."""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops.attention import paged_decode_attention, paged_kv_write, varlen_prefill_attention
from fastmamba.ops.attention.ref import (
    paged_decode_attention_ref, paged_kv_write_ref, varlen_prefill_attention_ref,
)
from tests.helpers import nan_like, seeded, tol


def paged_pool(*, S, Np, PAGE, Hkv, Dh, lens, dtype=torch.float32, seed=0):
    """Random pools (every page, used or not, holds random values) and a block table that hands
    each request a shuffled set of pages; pages never handed out stay random."""
    g = seeded(seed)
    k = torch.randn(Np, PAGE, Hkv, Dh, generator=g).to(dtype)
    v = torch.randn(Np, PAGE, Hkv, Dh, generator=g).to(dtype)
    Pmax = max(1, max((n + PAGE - 1) // PAGE for n in lens))
    perm = torch.randperm(Np - 1, generator=g).tolist()  # the last page is the scratch page
    bt = torch.full((S, Pmax), -1, dtype=torch.int32)
    for s, n in enumerate(lens):
        for p in range((n + PAGE - 1) // PAGE):
            bt[s, p] = perm.pop()
    seq_lens = torch.tensor(list(lens) + [0] * (S - len(lens)), dtype=torch.int32)
    return k, v, bt, seq_lens


# base row, then rows that each change one thing
DECODE_ROWS = [
    pytest.param(dict(Hq=4, Hkv=2, Dh=16, PAGE=4), id="Hq4-Hkv2-D16-P4"),
    pytest.param(dict(Hq=6, Hkv=2, Dh=16, PAGE=4), id="G3"),
    pytest.param(dict(Hq=4, Hkv=4, Dh=16, PAGE=4), id="MHA"),
    pytest.param(dict(Hq=4, Hkv=1, Dh=24, PAGE=8), id="MQA-D24-P8"),
    pytest.param(dict(Hq=4, Hkv=2, Dh=16, PAGE=4, dtype=torch.float16), id="fp16"),
    pytest.param(dict(Hq=4, Hkv=2, Dh=16, PAGE=4, num_splits=2), id="split2"),
    pytest.param(dict(Hq=6, Hkv=2, Dh=24, PAGE=4, num_splits=4), id="G3-D24-split4"),  # splits with no pages
]


@pytest.mark.parametrize("shape", DECODE_ROWS)
def test_paged_decode_attention_matches_ref(shape, device):
    shape = dict(shape)
    dtype = shape.pop("dtype", torch.float32)
    num_splits = shape.pop("num_splits", 1)
    Hq, Hkv, Dh, PAGE = shape["Hq"], shape["Hkv"], shape["Dh"], shape["PAGE"]
    lens = (13, 1, 0, 7, 4)  # request 2 has nothing cached; 4 fills its page exactly
    k, v, bt, seq_lens = paged_pool(S=6, Np=16, PAGE=PAGE, Hkv=Hkv, Dh=Dh, lens=lens, dtype=dtype)
    slots = torch.tensor([3, 0, -1, 4, 1, 2], dtype=torch.int32)  # shuffled, a pad row, slot 5 unused
    q = torch.randn(6, Hq, Dh, generator=seeded(1)).to(dtype)
    k, v, bt, seq_lens, slots, q = (t.to(device) for t in (k, v, bt, seq_lens, slots, q))
    out = nan_like(q)
    got = paged_decode_attention(q, k, v, bt, seq_lens, slots, num_splits=num_splits, out=out)
    assert got is out
    want = paged_decode_attention_ref(q, k, v, bt, seq_lens, slots)
    torch.testing.assert_close(got.float(), want, **tol(dtype))
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # pad row
    assert torch.equal(got[5], torch.zeros_like(got[5]))  # nothing cached


def test_paged_decode_attention_is_independent_of_pages_and_batch(device):
    """Exact: the same request on other pages, in another slot, next to other requests."""
    Hq, Hkv, Dh, PAGE = 4, 2, 16, 4
    k, v, bt, seq_lens = paged_pool(S=3, Np=12, PAGE=PAGE, Hkv=Hkv, Dh=Dh, lens=(9, 5, 3))
    q = torch.randn(3, Hq, Dh, generator=seeded(2))
    alone_k, alone_v = torch.zeros_like(k), torch.zeros_like(v)
    pages = bt[0, :3].long()
    new_pages = torch.tensor([7, 2, 10])  # request 0 copied to other pages of a fresh pool, slot 1
    alone_k[new_pages], alone_v[new_pages] = k[pages], v[pages]
    bt2 = torch.full_like(bt, -1)
    bt2[1, :3] = new_pages.int()
    lens2 = torch.tensor([0, 9, 0], dtype=torch.int32)
    dev = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    batch = paged_decode_attention(*dev(q, k, v, bt, seq_lens, torch.tensor([0, 1, 2], dtype=torch.int32)))
    alone = paged_decode_attention(*dev(q[:1], alone_k, alone_v, bt2, lens2, torch.tensor([1], dtype=torch.int32)))
    assert torch.equal(batch[0], alone[0])


def test_paged_kv_write_matches_ref_and_pads_write_scratch_only(device):
    Hkv, Dh, PAGE = 2, 8, 4
    k_pool, v_pool, bt, _ = paged_pool(S=4, Np=10, PAGE=PAGE, Hkv=Hkv, Dh=Dh, lens=(6, 3, 0, 8))
    g = seeded(3)
    # tokens of requests in rows 0..2 (slots 3, -1, 0): positions 5..7 of slot 3, two pad tokens, 0..2 of slot 0
    slots = torch.tensor([3, -1, 0], dtype=torch.int32)
    token_rows = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2], dtype=torch.int32)
    positions = torch.tensor([5, 6, 7, 0, 1, 0, 1, 2], dtype=torch.int32)
    k = torch.randn(8, Hkv, Dh, generator=g)
    v = torch.randn(8, Hkv, Dh, generator=g)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    paged_kv_write_ref(k, v, want_k, want_v, bt, slots, positions, token_rows)
    got_k, got_v = k_pool.clone().to(device), v_pool.clone().to(device)
    paged_kv_write(*(t.to(device) for t in (k, v)), got_k, got_v, bt.to(device), slots.to(device),
                   positions.to(device), token_rows.to(device))
    assert torch.equal(got_k[:-1].cpu(), want_k[:-1]) and torch.equal(got_v[:-1].cpu(), want_v[:-1])
    assert not torch.equal(got_k[-1].cpu(), k_pool[-1])  # the pads landed on the scratch page


@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (3, 3)], ids=["GQA", "MHA"])
def test_varlen_prefill_attention_matches_ref(Hq, Hkv, device):
    Dh, PAGE = 16, 4
    ctx = [0, 5, 0]        # prompt 1 continues 5 cached tokens
    lens = [7, 3, 1]
    k_pool, v_pool, bt, _ = paged_pool(S=4, Np=12, PAGE=PAGE, Hkv=Hkv, Dh=Dh,
                                       lens=[c + n for c, n in zip(ctx, lens)] + [0])
    slots = torch.tensor([2, 0, 1], dtype=torch.int32)
    bt = bt[[2, 0, 1, 3]]  # prompt b uses block-table row slots[b]
    cu = torch.tensor([0, 7, 10, 11], dtype=torch.int32)
    T = 11
    g = seeded(4)
    q = torch.randn(T, Hq, Dh, generator=g)
    k_new, v_new = torch.randn(T, Hkv, Dh, generator=g), torch.randn(T, Hkv, Dh, generator=g)
    positions = torch.tensor([i + c for c, n in zip(ctx, lens) for i in range(n)], dtype=torch.int32)
    rows = torch.repeat_interleave(torch.arange(3), torch.tensor(lens)).int()
    paged_kv_write(k_new, v_new, k_pool, v_pool, bt, slots, positions, rows)
    want = varlen_prefill_attention_ref(q, k_pool, v_pool, bt, slots, cu, torch.tensor(ctx))
    d = lambda t: t.to(device)  # noqa: E731
    out = nan_like(q).to(device)
    got = varlen_prefill_attention(d(q), d(k_pool), d(v_pool), d(bt), d(slots), d(cu), ctx,
                                   k_new=d(k_new), v_new=d(v_new), out=out)
    torch.testing.assert_close(got.cpu(), want, **tol(torch.float32))
    got_pages = varlen_prefill_attention(d(q), d(k_pool), d(v_pool), d(bt), d(slots), d(cu), ctx)
    torch.testing.assert_close(got_pages.cpu(), want, **tol(torch.float32))


def test_attention_ops_reject_bad_input():
    k, v, bt, seq_lens = paged_pool(S=2, Np=4, PAGE=4, Hkv=2, Dh=8, lens=(3, 2))
    with pytest.raises(ValueError, match="paged_decode_attention: `q` expected shape"):
        paged_decode_attention(torch.randn(2, 3, 8), k, v, bt, seq_lens, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="paged_decode_attention: `slots` values must lie in"):
        paged_decode_attention(torch.randn(2, 4, 8), k, v, bt, seq_lens, torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="paged_decode_attention: `seq_lens` expected shape"):
        paged_decode_attention(torch.randn(2, 4, 8), k, v, bt, seq_lens[:1], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="paged_decode_attention: `num_splits` expected a power of two"):
        paged_decode_attention(torch.randn(2, 4, 8), k, v, bt, seq_lens, torch.tensor([0, 1]), num_splits=3)
    with pytest.raises(ValueError, match="varlen_prefill_attention: `ctx_lens` expected 1 values"):
        varlen_prefill_attention(torch.randn(3, 4, 8), k, v, bt, torch.tensor([0]), torch.tensor([0, 3]), [0, 0])
    with pytest.raises(ValueError, match="paged_kv_write: `k` expected shape"):
        paged_kv_write(torch.randn(2, 3, 8), torch.randn(2, 3, 8), k, v, bt, torch.tensor([0, 1]),
                       torch.tensor([0, 1]))


@pytest.mark.gpu
@pytest.mark.parametrize("B,ctx,dtype", [(1, 4096, torch.bfloat16), (32, 2000, torch.bfloat16),
                                         (7, 333, torch.float16)])
def test_paged_decode_attention_large_gpu(B, ctx, dtype):
    """Nemotron-H-8B's attention shape (32 query / 8 KV heads of 128), long contexts, 16-token pages."""
    Hq, Hkv, Dh, PAGE = 32, 8, 128, 16
    pages_per = -(-ctx // PAGE)
    k, v, bt, seq_lens = paged_pool(S=B + 1, Np=(B + 1) * pages_per + 1, PAGE=PAGE, Hkv=Hkv, Dh=Dh,
                                    lens=[ctx - b for b in range(B)], dtype=dtype)
    slots = torch.randperm(B, generator=seeded(5)).int()
    q = torch.randn(B, Hq, Dh, generator=seeded(6)).to(dtype)
    args = [t.cuda() for t in (q, k, v, bt, seq_lens, slots)]
    want = paged_decode_attention_ref(*args)
    for splits in (None, 1, 8):
        got = paged_decode_attention(*args, num_splits=splits)
        torch.testing.assert_close(got.float(), want, **tol(dtype))
