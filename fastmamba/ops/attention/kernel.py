"""Triton kernels: decode attention over a paged KV cache (one query token per request, GQA), with
an optional split of each request's context (split-K), and the kernel that merges the splits; and
the K/V page write (one program per token, at the end of this file).

Each loop trip of the attention kernel takes a tile of BLOCK_N tokens, which spans BLOCK_N / PAGE
pages (or part of one page when PAGE > BLOCK_N): the tile's page ids are BLOCK_N / PAGE scalar
loads, spread over the tile's rows, and every token row gets its own address, so one trip is a
[BLOCK_N, Dh] K tile and a V tile whatever the page size. The G query heads of a KV head are padded
to BLOCK_G >= 16 rows so that q K^T and p V run on tensor cores (tl.dot). The loads of a trip do
not depend on the previous trip's softmax, so Triton's pipeliner issues them num_stages - 1 trips
ahead (cp.async into shared memory). The page ids are scalar loads on purpose: as a vector load
they became a pipelined level of their own, which left K and V one buffer and a wait for every
load at the top of each trip (sm_90 TTGIR, Triton 3.6).
"""
from __future__ import annotations

import triton
import triton.language as tl

from fastmamba.ops.attention.configs import DecodeConfig
from fastmamba.ops._common.launch import lean
from fastmamba.ops._common.host_math import next_power_of_2
from fastmamba.ops.fp8.kernel import _round_e4m3
from fastmamba.ops.fp8.ref import FP8_MAX

LOG2E = 1.4426950408889634


@triton.jit
def load_kv_tile(start, offs_n, hi, bt_row, k_head, v_head, num_pages, stride_bt_p, stride_k_p, stride_k_t, stride_v_p,
                 stride_v_t, dmask, D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                 BLOCK_N: tl.constexpr, PAGES_PER_TILE: tl.constexpr):
    """The K and V tiles [BLOCK_N, BLOCK_D] of a request's positions start + offs_n (offs_n =
    tl.arange(0, BLOCK_N), made once outside the caller's loop). bt_row: its block-table row;
    k_head / v_head: the KV head's base pointers with the head-dim offsets. Returns (k, v,
    positions, valid): a position is valid below ``hi`` on a page of the pool (the others read as
    zeros, never dereferenced). The page ids are BLOCK_N / PAGE scalar loads (start is a multiple
    of the page or of the tile, whichever is smaller), spread over the tile's rows. The tiles come
    in the pools' dtype (the caller converts them: ``kv_in``)."""
    pos = start + offs_n
    first = start // PAGE
    page = tl.full([BLOCK_N], -1, tl.int64)
    for j in tl.static_range(PAGES_PER_TILE):
        pid = tl.load(bt_row + (first + j) * stride_bt_p, mask=start + j * PAGE < hi, other=-1).to(tl.int64)
        page = tl.where(offs_n // PAGE == j, pid, page)
    tok_ok = (pos < hi) & (page >= 0) & (page < num_pages)  # a page outside the pool is never read
    page = tl.where(tok_ok, page, 0)
    row = pos % PAGE
    if D == BLOCK_D:
        kv_mask = tok_ok[:, None]  # constant along the head dim: 16-byte vector loads
    else:
        kv_mask = tok_ok[:, None] & dmask[None, :]
    k = tl.load(k_head + page[:, None] * stride_k_p + row[:, None] * stride_k_t, mask=kv_mask, other=0.0)
    v = tl.load(v_head + page[:, None] * stride_v_p + row[:, None] * stride_v_t, mask=kv_mask, other=0.0)
    return k, v, pos, tok_ok


@triton.jit
def kv_in(k, v, q):
    """The K and V tiles in the queries' dtype for the two products: fp32 when the caller upcast q,
    q's 16-bit dtype for float8_e4m3fn pages (exact: every e4m3 value is a bf16 / fp16 value; the
    scales are applied outside the products), unchanged when the dtypes already agree."""
    return k.to(q.dtype), v.to(q.dtype)


@triton.jit
def kv_scales(qk_scale, ks_ptr, vs_ptr, KV_FP8: tl.constexpr):
    """(the score multiplier, the output multiplier): with float8 pages the stored values are K /
    k_scale and V / v_scale, so the scores take k_scale and the output (linear in V) v_scale."""
    s_mul = qk_scale
    o_mul = 1.0
    if KV_FP8:
        s_mul = qk_scale * tl.load(ks_ptr).to(tl.float32)
        o_mul = tl.load(vs_ptr).to(tl.float32)
    return s_mul, o_mul


@triton.jit
def online_softmax_step(q, k, v, keep, m, l, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """One tile into the online softmax (fp32, base 2) of queries q [R, BLOCK_D]: scores q k^T
    scaled by ``qk_scale`` (log2 units), keys where ``keep`` ([R or 1, BLOCK_N]) is False masked;
    returns the new (max, sum, unnormalised output). m starts finite (-1e30), so a fully masked
    tile leaves alpha = 1 and p = 0."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l, acc


@triton.jit(do_not_specialize=["S", "num_pages", "max_pages", "qk_scale"])
def _paged_decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, slots_ptr, out_ptr, part_ml_ptr, part_o_ptr, ks_ptr, vs_ptr,
    S, num_pages, max_pages, qk_scale,
    stride_q_b, stride_q_h, stride_q_d,
    stride_k_p, stride_k_t, stride_k_h, stride_k_d,
    stride_v_p, stride_v_t, stride_v_h, stride_v_d,
    stride_bt_s, stride_bt_p,
    stride_o_b, stride_o_h, stride_o_d,
    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGES_PER_TILE: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # one program per (KV head, request, split of the request's context); the KV head varies
    # fastest in launch order, so the Hkv programs reading the same pages (a page holds every
    # head's rows) run side by side. The request's L tokens are cut into num_programs(2) runs of
    # ceil(L / splits) tokens rounded up to whole tiles (from L itself, read on the device: the
    # runs are as even as the tiles allow whatever the block table's width). Its G query heads
    # attend over the run with an online softmax (fp32, base 2): without SPLIT it writes the
    # output; with SPLIT its (max, sum) and unnormalised output, merged by
    # _paged_decode_combine_kernel. float8 pages (KV_FP8): each tile is converted to q's dtype,
    # k_scale folds into the score scale and v_scale into the output.
    kh = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    nsplit = tl.num_programs(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    valid = (slot >= 0) & (slot < S)  # outside the pool = a pad row: nothing read, zero output
    slot = tl.where(valid, slot, 0)
    L = tl.load(lens_ptr + slot)
    L = tl.where(valid, L, 0)
    L = tl.maximum(tl.minimum(L, max_pages * PAGE), 0)  # never past the block table's row
    per = tl.cdiv(tl.cdiv(L, nsplit), BLOCK_N) * BLOCK_N
    lo = split * per
    hi = tl.minimum(lo + per, L)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    gmask = offs_g < G
    dmask = offs_d < D
    qh = kh * G + offs_g
    q = tl.load(q_ptr + b * stride_q_b + qh[:, None] * stride_q_h + offs_d[None, :] * stride_q_d,
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    bt_row = bt_ptr + slot * stride_bt_s
    k_head = k_ptr + kh * stride_k_h + offs_d[None, :] * stride_k_d
    v_head = v_ptr + kh * stride_v_h + offs_d[None, :] * stride_v_d

    s_scale, o_scale = kv_scales(qk_scale, ks_ptr, vs_ptr, KV_FP8)

    m = tl.full([BLOCK_G], -1e30, tl.float32)  # finite: a fully masked tile leaves alpha = 1, p = 0
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        k, v, pos, tok_ok = load_kv_tile(start, offs_n, hi, bt_row, k_head, v_head, num_pages, stride_bt_p, stride_k_p,
                                         stride_k_t, stride_v_p, stride_v_t, dmask, D, BLOCK_D, PAGE, BLOCK_N,
                                         PAGES_PER_TILE)
        k, v = kv_in(k, v, q)
        m, l, acc = online_softmax_step(q, k, v, tok_ok[None, :], m, l, acc, s_scale, DOT_PRECISION)
    if KV_FP8:
        acc = acc * o_scale  # linear in V: the split partials merge the same
    if SPLIT:
        # partials: (m, l) [B, Hq, splits, 2] and acc [B, Hq, splits, BLOCK_D], contiguous fp32
        prow = (b * (G * tl.num_programs(0)) + qh) * nsplit + split
        tl.store(part_ml_ptr + prow * 2, m, mask=gmask)
        tl.store(part_ml_ptr + prow * 2 + 1, l, mask=gmask)
        tl.store(part_o_ptr + prow[:, None] * BLOCK_D + offs_d[None, :], acc, mask=gmask[:, None])
    else:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + b * stride_o_b + qh[:, None] * stride_o_h + offs_d[None, :] * stride_o_d,
                 out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _paged_decode_combine_kernel(
    part_ml_ptr, part_o_ptr, out_ptr,
    stride_o_b, stride_o_h, stride_o_d,
    D: tl.constexpr, BLOCK_D: tl.constexpr, NSPLIT: tl.constexpr,
):
    # one program per (request, query head): merges its NSPLIT partial softmaxes, all loaded at
    # once (a run with no tokens has m = -1e30, l = 0: weight 0 next to any run that has one)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    H = tl.num_programs(1)
    offs_s = tl.arange(0, NSPLIT)
    offs_d = tl.arange(0, BLOCK_D)
    rows = (b * H + h) * NSPLIT + offs_s
    m = tl.load(part_ml_ptr + rows * 2)
    l = tl.load(part_ml_ptr + rows * 2 + 1)
    acc = tl.load(part_o_ptr + rows[:, None] * BLOCK_D + offs_d[None, :])
    w = tl.exp2(m - tl.max(m, axis=0))
    l_all = tl.sum(l * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(l_all > 0, l_all, 1.0)
    tl.store(out_ptr + b * stride_o_b + h * stride_o_h + offs_d * stride_o_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < D)


def upcast_and_precision(q, k_pages, v_pages) -> tuple[bool, str]:
    """(UPCAST, DOT_PRECISION) of both attention kernels. Mixed dtypes: every operand in fp32; so
    for bf16 in the interpreter, whose bf16 tl.dot returns garbage (Triton 3.6: a 16x16 product off
    by 1e10). float8 pages count as q's dtype (their tiles are converted to it, exactly)."""
    import torch

    fp8 = torch.float8_e4m3fn
    kd = q.dtype if k_pages.dtype == fp8 else k_pages.dtype
    vd = q.dtype if v_pages.dtype == fp8 else v_pages.dtype
    upcast = not q.dtype == kd == vd or (q.dtype == torch.bfloat16 and not q.is_cuda)
    return upcast, "ieee" if (upcast or q.dtype == torch.float32) else "tf32"  # tf32: unused by 16-bit dots


def launch_paged_decode_attention(q, k_pages, v_pages, block_table, seq_lens, slots, out, scale: float,
                                  config: DecodeConfig, k_scale=None, v_scale=None) -> None:
    """q, out [B, Hq, Dh]; k_pages, v_pages [Np, PAGE, Hkv, Dh]; block_table [S, Pmax]; seq_lens [S];
    slots [B]; k_scale, v_scale: one-element device tensors with float8 pages (else None);
    ``config`` the tile (block_n tokens per loop trip), num_warps, num_stages and
    num_splits: each request's context is cut into that many runs (split-K), merged by a second
    kernel. Allocates the splits' fp32 partials (no host read: graph safe)."""
    import torch

    B, Hq, D = q.shape
    Np, PAGE, Hkv, _ = k_pages.shape
    G = Hq // Hkv
    block_d = max(16, next_power_of_2(D))
    splits = config.num_splits
    block_n = min(config.block_n, max(16, 8 * PAGE))  # at most 8 page-id loads per trip
    if splits > 1:
        part_ml = torch.empty(B, Hq, splits, 2, device=q.device, dtype=torch.float32)
        part_o = torch.empty(B, Hq, splits, block_d, device=q.device, dtype=torch.float32)
    else:
        part_ml = part_o = out  # not touched
    upcast, precision = upcast_and_precision(q, k_pages, v_pages)
    fp8 = k_scale is not None
    lean(_paged_decode_attention_kernel)[(Hkv, B, splits)](
        q, k_pages, v_pages, block_table, seq_lens, slots, out, part_ml, part_o,
        k_scale if fp8 else out, v_scale if fp8 else out,
        block_table.shape[0], Np, block_table.shape[1], scale * LOG2E,
        *q.stride(), *k_pages.stride(), *v_pages.stride(), *block_table.stride(), *out.stride(),
        G=G, D=D, PAGE=PAGE, BLOCK_G=max(16, next_power_of_2(G)), BLOCK_D=block_d,
        BLOCK_N=block_n, PAGES_PER_TILE=max(1, block_n // PAGE), SPLIT=splits > 1, UPCAST=upcast,
        KV_FP8=fp8, DOT_PRECISION=precision,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits > 1:
        lean(_paged_decode_combine_kernel)[(B, Hq)](
            part_ml, part_o, out, *out.stride(), D=D, BLOCK_D=block_d, NSPLIT=splits,
            num_warps=4 if splits * block_d >= 2048 else 1,
        )


# --- the K/V write ---------------------------------------------------------------------------
# T new tokens' K and V into their requests' pages, in one launch.
#
# One program per token t: its request ``slots[token_rows[t]]`` (or ``slots[t]``), the page
# ``block_table[request, pos // PAGE]`` and the row ``pos % PAGE``; a pad request (slot outside
# [0, S)), a position outside the block table or a page id outside [0, Np - 1) sends the token to the
# scratch page ``Np - 1`` (what ``fastmamba.cache.kv_pages.KVPages`` never hands out), so nothing
# lands outside the pools and no host read is needed (graph safe). The token's [Hkv, Dh] K and V
# tiles are cast to the pools' dtype; float8 pools store K / k_scale and V / v_scale (IEEE division)
# saturated at +-448 and rounded to the e4m3 grid in fp32 first (ops/fp8's ``_round_e4m3``), so the
# bytes equal ``ref.quantize_kv_ref``'s on the GPU and in the interpreter alike.
#
# This replaces a PyTorch index_put path of about twenty small kernels per attention layer (index
# arithmetic, clamps, the gather of page ids, two index_puts); at decode sizes each was a launch of
# its own inside the graphed step.


@triton.jit
def _store_tile(x_ptr, stride_x_h, stride_x_d, out_ptr, stride_o_h, stride_o_d, scale_ptr, offs_h, offs_d, mask,
                FP8: tl.constexpr, QMAX: tl.constexpr):
    x = tl.load(x_ptr + offs_h[:, None] * stride_x_h + offs_d[None, :] * stride_x_d, mask=mask, other=0.0)
    dst = out_ptr + offs_h[:, None] * stride_o_h + offs_d[None, :] * stride_o_d
    if FP8:
        xf = x.to(tl.float32)
        y = tl.div_rn(xf, tl.load(scale_ptr).to(tl.float32) + tl.zeros_like(xf))
        y = tl.clamp(y, -QMAX, QMAX, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN, as torch's clamp
        tl.store(dst, _round_e4m3(y).to(tl.float8e4nv), mask=mask)
    else:
        tl.store(dst, x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T", "B"])
def _paged_kv_write_kernel(k_ptr, v_ptr, kp_ptr, vp_ptr, bt_ptr, slots_ptr, pos_ptr, rows_ptr, ks_ptr, vs_ptr,
                           T, B, S, Pmax, Np, Hkv, D,
                           stride_k_t, stride_k_h, stride_k_d, stride_v_t, stride_v_h, stride_v_d,
                           stride_kp_p, stride_kp_r, stride_kp_h, stride_kp_d,
                           stride_vp_p, stride_vp_r, stride_vp_h, stride_vp_d,
                           stride_bt_s, stride_bt_p,
                           PAGE: tl.constexpr, HAS_ROWS: tl.constexpr, FP8: tl.constexpr, QMAX: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    if HAS_ROWS:
        r = tl.load(rows_ptr + t).to(tl.int64)
    else:
        r = t
    r_ok = (r >= 0) & (r < B)
    s = tl.load(slots_ptr + tl.minimum(tl.maximum(r, 0), B - 1)).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    col = tl.maximum(pos, 0) // PAGE
    ok = r_ok & (s >= 0) & (s < S) & (pos >= 0) & (col < Pmax)
    s_c = tl.minimum(tl.maximum(s, 0), S - 1)
    page = tl.load(bt_ptr + s_c * stride_bt_s + tl.minimum(col, Pmax - 1) * stride_bt_p).to(tl.int64)
    page = tl.where(ok & (page >= 0) & (page < Np - 1), page, Np - 1)
    row = tl.maximum(pos, 0) % PAGE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < Hkv) & (offs_d[None, :] < D)
    _store_tile(k_ptr + t * stride_k_t, stride_k_h, stride_k_d,
                kp_ptr + page * stride_kp_p + row * stride_kp_r, stride_kp_h, stride_kp_d,
                ks_ptr, offs_h, offs_d, mask, FP8, QMAX)
    _store_tile(v_ptr + t * stride_v_t, stride_v_h, stride_v_d,
                vp_ptr + page * stride_vp_p + row * stride_vp_r, stride_vp_h, stride_vp_d,
                vs_ptr, offs_h, offs_d, mask, FP8, QMAX)


def launch_paged_kv_write(k, v, k_pages, v_pages, block_table, slots, positions, token_rows, scales) -> None:
    """k, v [T, Hkv, Dh] (any strides); k_pages, v_pages [Np, PAGE, Hkv, Dh] (mutated); block_table
    [S, Pmax]; slots [B]; positions [T]; token_rows [T] or None (T == B); scales: (k_scale, v_scale)
    one-element device tensors for float8 pools, else None. The caller has checked shapes, dtypes and
    devices; no value is read on the host."""
    T, Hkv, D = k.shape
    if T == 0:
        return
    Np, PAGE = k_pages.shape[0], k_pages.shape[1]
    fp8 = scales is not None
    ks, vs = scales if fp8 else (k, v)  # (unused pointers without float8)
    block_d = next_power_of_2(D)
    lean(_paged_kv_write_kernel)[(T,)](
        k, v, k_pages, v_pages, block_table, slots, positions, token_rows if token_rows is not None else positions,
        ks, vs,
        T, slots.shape[0], block_table.shape[0], block_table.shape[1], Np, Hkv, D,
        *k.stride(), *v.stride(), *k_pages.stride(), *v_pages.stride(), *block_table.stride(),
        PAGE=PAGE, HAS_ROWS=token_rows is not None, FP8=fp8, QMAX=FP8_MAX,
        BLOCK_H=next_power_of_2(Hkv), BLOCK_D=block_d,
        num_warps=1 if Hkv * block_d <= 512 else 4,
    )
