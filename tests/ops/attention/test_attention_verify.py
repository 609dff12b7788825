"""``paged_decode_attention`` in the speculative-verify configuration that ``NemotronHLM.verify``
builds: T query rows per request, row t of request b attending over the first ctx_b + t + 1 tokens
of the request's pages (its own length), the request's block-table row repeated per query row and a
``rows`` mapping (pad requests' rows -1). Every kernel path: one program per row, and split-K with
runs of pages that are empty for the short rows (forced here: the automatic choice is 1 on a CPU)."""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops.attention import paged_decode_attention, paged_kv_write
from fastmamba.ops.attention.ref import paged_decode_attention_ref, paged_kv_write_ref
from tests.helpers import nan_like, seeded, tol


def verify_rows(ctx, T, *, Np, PAGE, Hkv, Dh, Pmax, dtype, seed=0, slots=None):
    """Pools (random everywhere) whose requests hold ctx[b] + T tokens in shuffled pages; the
    verify step's read arguments as NemotronHLM.verify makes them: per-row table, lengths, rows."""
    g = seeded(seed)
    k = torch.randn(Np, PAGE, Hkv, Dh, generator=g).to(dtype)
    v = torch.randn(Np, PAGE, Hkv, Dh, generator=g).to(dtype)
    S = len(ctx) + 1
    bt = torch.full((S, Pmax), -1, dtype=torch.int32)
    perm = torch.randperm(Np - 1, generator=g).tolist()  # the last page: scratch
    slots = slots if slots is not None else list(range(len(ctx)))
    for s, c in zip(slots, ctx):
        if s >= 0:
            for p in range(-(-(c + T) // PAGE)):
                bt[s, p] = perm.pop()
    sl = torch.tensor(slots, dtype=torch.int32)
    base = torch.tensor(ctx, dtype=torch.int64)
    positions = (base[:, None] + torch.arange(T)).reshape(-1)
    live = (sl >= 0).repeat_interleave(T)
    rows = torch.where(live, torch.arange(len(ctx) * T), -1).to(torch.int32)
    table = bt[sl.long().clamp(min=0)].repeat_interleave(T, dim=0)
    return k, v, bt, sl, positions, table, (positions + 1).to(torch.int32), rows


CASES = [
    # (Hq, Hkv, Dh, PAGE, ctx per request, T, dtype)
    pytest.param(4, 2, 16, 4, (37, 22, 3), 4, torch.float32, id="GQA-odd-lens"),
    pytest.param(6, 2, 24, 4, (30, 9), 6, torch.float32, id="G3-D24-lens-cross-pages"),
    pytest.param(4, 1, 16, 8, (41, 0), 3, torch.bfloat16, id="MQA-bf16-P8-empty-ctx"),
]


@pytest.mark.parametrize("Hq,Hkv,Dh,PAGE,ctx,T,dtype", CASES)
@pytest.mark.parametrize("num_splits", [1, 2, 4, 8])
def test_verify_rows_match_ref(Hq, Hkv, Dh, PAGE, ctx, T, dtype, num_splits, device):
    """T rows per request, each with its own length (positions + 1, crossing page boundaries at odd
    offsets), against the reference; split-K with 8 runs leaves runs past the short rows' ends."""
    Pmax = -(-(max(ctx) + T) // PAGE) + 3  # wider than any request: trailing -1 entries
    k, v, bt, sl, positions, table, lens, rows = verify_rows(ctx, T, Np=40, PAGE=PAGE, Hkv=Hkv, Dh=Dh, Pmax=Pmax,
                                                             dtype=dtype)
    q = torch.randn(len(ctx) * T, Hq, Dh, generator=seeded(1)).to(dtype)
    k, v, table, lens, rows, q = (t.to(device) for t in (k, v, table, lens, rows, q))
    out = nan_like(q)
    got = paged_decode_attention(q, k, v, table, lens, rows, num_splits=num_splits, out=out)
    want = paged_decode_attention_ref(q, k, v, table, lens, rows)
    torch.testing.assert_close(got.float(), want, **tol(dtype))
    # the rows' lengths matter: row t of a request differs from row t+1 (one more key), and row 0
    # equals a plain decode of the same query over ctx + 1 tokens (one row, the request's table)
    for b, c in enumerate(ctx):
        one = paged_decode_attention(q[b * T:b * T + 1], k, v, table[b * T:b * T + 1], lens[b * T:b * T + 1],
                                     torch.zeros(1, dtype=torch.int32, device=device), num_splits=num_splits)
        torch.testing.assert_close(got[b * T], one[0], atol=0, rtol=0)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_verify_write_then_read_equals_causal_attention(num_splits, device):
    """The layer's whole verify: the T tokens' K/V written at positions ctx .. ctx+T-1 of each
    request (slots shuffled, a pad request), then read with per-row lengths, equals causal
    attention of the T queries over the request's cache plus the T new keys (computed densely)."""
    Hq, Hkv, Dh, PAGE, T = 4, 2, 16, 4, 4
    ctx = (29, 14, 6)
    slots = [2, -1, 0]
    Pmax = 12
    k, v, bt, sl, positions, table, lens, rows = verify_rows(ctx, T, Np=36, PAGE=PAGE, Hkv=Hkv, Dh=Dh, Pmax=Pmax,
                                                             dtype=torch.float32, slots=slots, seed=3)
    g = seeded(4)
    kn, vn = torch.randn(len(ctx) * T, Hkv, Dh, generator=g), torch.randn(len(ctx) * T, Hkv, Dh, generator=g)
    q = torch.randn(len(ctx) * T, Hq, Dh, generator=g)
    token_rows = torch.arange(len(ctx)).repeat_interleave(T)
    k2, v2 = k.clone(), v.clone()
    paged_kv_write_ref(kn, vn, k2, v2, bt, sl, positions, token_rows)
    k, v, bt, sl, positions, table, lens, rows, q, kn, vn, token_rows = (
        t.to(device) for t in (k, v, bt, sl, positions, table, lens, rows, q, kn, vn, token_rows))
    paged_kv_write(kn, vn, k, v, bt, sl, positions, token_rows)
    assert torch.equal(k[:-1].cpu(), k2[:-1]) and torch.equal(v[:-1].cpu(), v2[:-1])  # scratch page aside
    got = paged_decode_attention(q, k, v, table, lens, rows, num_splits=num_splits, out=nan_like(q))
    for b, (s, c) in enumerate(zip(slots, ctx)):
        r = slice(b * T, (b + 1) * T)
        if s < 0:
            assert torch.equal(got[r], torch.zeros_like(got[r]))
            continue
        ids = bt[s, : -(-(c + T) // PAGE)].long()
        keys = k[ids].reshape(-1, Hkv, Dh)[:c + T].float().repeat_interleave(Hq // Hkv, 1)
        vals = v[ids].reshape(-1, Hkv, Dh)[:c + T].float().repeat_interleave(Hq // Hkv, 1)
        sc = torch.einsum("thd,khd->htk", q[r].float(), keys) / Dh ** 0.5
        mask = torch.arange(c + T, device=device)[None, :] > (c + torch.arange(T, device=device))[:, None]
        want = torch.einsum("htk,khd->thd", sc.masked_fill(mask, float("-inf")).softmax(-1), vals)
        torch.testing.assert_close(got[r], want, **tol(torch.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("nreq,ctx,dtype", [(1, 2048, torch.bfloat16), (3, 1999, torch.bfloat16)])
def test_verify_rows_8b_shape_gpu(nreq, ctx, dtype):
    """Nemotron-H-8B's attention shape (32 query / 8 KV heads of 128, 16-token pages), K=5 (T=6)
    rows per request at a ~2k context: the automatic split-K choice (B*T x Hkv programs) and
    forced splits against the reference."""
    Hq, Hkv, Dh, PAGE, T = 32, 8, 128, 16, 6
    lens_ = [ctx - 17 * b for b in range(nreq)]
    Pmax = -(-(ctx + T + 8) // PAGE)
    k, v, bt, sl, positions, table, lens, rows = verify_rows(lens_, T, Np=nreq * Pmax + 1, PAGE=PAGE, Hkv=Hkv, Dh=Dh,
                                                             Pmax=Pmax, dtype=dtype)
    q = torch.randn(nreq * T, Hq, Dh, generator=seeded(6)).to(dtype)
    args = [t.cuda() for t in (q, k, v, table, lens, rows)]
    want = paged_decode_attention_ref(*args)
    for splits in (None, 1, 8, 16):
        got = paged_decode_attention(*args, num_splits=splits)
        torch.testing.assert_close(got.float(), want, **tol(dtype))
