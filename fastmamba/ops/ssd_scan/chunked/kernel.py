"""Triton kernels of the chunked SSD scan: chunk states, state passing, chunk outputs.

The tokens are cut into chunks of at most Q tokens that never cross a segment boundary (a
segment is one sequence: a varlen entry, a row of a dense batch, or a seq_idx run). With
a_t = dt'_t * A[h] and cs_t the cumulative sum of a over the chunk up to t (inclusive):

0. ``_chunk_prep_kernel``   (chunk, block of heads or C B^T tile): the chunk table, dt' and cs ->
                           scratch; in the same launch, C B^T (step 3).
1. ``_chunk_state_kernel``   (chunk, head, block of N): the chunk's own state
   contribution  S_loc = sum_s exp(cs_last - cs_s) dt'_s x_s B_s^T  (one tensor-core matmul).
2. ``_state_passing_kernel`` (segment, head, block of P*N): walks the segment's chunks in order,
   S_in(c) = state entering chunk c, S_in(c+1) = exp(cs_last(c)) S_in(c) + S_loc(c) in fp32;
   stores S_in(c) in the activation dtype (the chunk scan's matmul reads it in that dtype),
   reads the initial state and writes the final state (a cache slot).
3. ``_chunk_cb_tile``       (chunk, group, tile; in step 0's launch): C B^T once per group (heads of
                           a group share it); the tiles on the diagonal are zero above it, the
                           tiles above it are not written.
4. ``_chunk_scan_kernel``   (chunk, head, block of Q rows x block of P):
   y_t = exp(cs_t) C_t S_in^T + sum_{s<=t} (C_t . B_s) exp(cs_t - cs_s) dt'_s x_s, + D x, * silu(z).

Tokens live in a flat index space: flat token f sits at row f // row_len, position f % row_len

The @triton.jit pieces these kernels share with the fused and Hopper kernels (segment and chunk
location, the tensor-core product, the deferred norm, state rounding) are in ``kernel_common.py``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from fastmamba.ops._common.jit_math import exp_approx, silu_approx, softplus
from fastmamba.ops.ssd_scan.chunked.kernel_common import (
    _chunk_entry,
    _defer_norm,
    _local_state,
    _locate_chunk,
    _locate_segment,
    _mma,
    _to_state_dtype,
    _wait_for_kernel_before,
)


@triton.jit
def _chunk_cumsum_block(
    c, hblock, dt_ptr, dt_bias_ptr, A_ptr, cu_ptr, table_ptr, dt_out_ptr, cs_out_ptr,
    n_seg, row_len, H, n_chunk_slots, dt_min, dt_max,
    stride_dt_row, stride_dt_tok, stride_dt_h,
    Q: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SEG: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr, A_IS_LOG: tl.constexpr,
):
    """Chunk c, heads hblock * BLOCK_H ..: the chunk table entry (block 0), dt' and the cumulative
    log-decay cs -> scratch [H, n_chunk_slots, Q]."""
    seg, start, length, valid = _locate_chunk(cu_ptr, n_seg, c, Q, BLOCK_SEG)
    if hblock == 0:
        tl.store(table_ptr + c * 4, start)
        tl.store(table_ptr + c * 4 + 1, length)
        tl.store(table_ptr + c * 4 + 2, seg)
        tl.store(table_ptr + c * 4 + 3, 0)  # entry 3 of chunk 0: the non-finite-x flag (_chunk_state_kernel)
    if seg < n_seg:
        row = start // row_len
        l0 = start - row * row_len
        offs_h = hblock * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_q = tl.arange(0, BLOCK_Q)
        mh = offs_h < H
        mask = (offs_q < length)[:, None] & mh[None, :]
        d = tl.load(dt_ptr + row.to(tl.int64) * stride_dt_row + (l0 + offs_q).to(tl.int64)[:, None] * stride_dt_tok
                    + offs_h[None, :] * stride_dt_h, mask=mask, other=0.0).to(tl.float32)
        if HAS_DT_BIAS:
            d += tl.load(dt_bias_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)[None, :]
        if DT_SOFTPLUS:
            d = softplus(d)
        if HAS_DT_LIMIT:
            d = tl.minimum(tl.maximum(d, dt_min), dt_max)
        d = tl.where(mask, d, 0.0)
        A = tl.load(A_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)
        if A_IS_LOG:
            A = -tl.exp(A)  # A holds A_log
        cs = tl.cumsum(d * A[None, :], 0)
        dst = (offs_h[None, :] * n_chunk_slots + c) * Q + offs_q[:, None]
        tl.store(dt_out_ptr + dst, d, mask=mask)
        tl.store(cs_out_ptr + dst, cs, mask=mask)


@triton.heuristics({"HAS_SKIP": lambda a: a["skip_ptr"] is not None})
@triton.jit(do_not_specialize=["n_seg", "row_len"])
def _chunk_state_kernel(
    x_ptr, B_ptr, table_ptr, skip_ptr, states_ptr, dt_ptr, cs_ptr,
    n_seg, row_len, P, N, heads_per_group, n_chunk_slots,
    stride_x_row, stride_x_tok, stride_x_h, stride_x_p,
    stride_B_row, stride_B_tok, stride_B_g, stride_B_n,
    stride_st_c, stride_st_h, stride_st_p, stride_st_n,
    Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FAST_MATH: tl.constexpr, HAS_SKIP: tl.constexpr, DOT_UPCAST: tl.constexpr,
    FLAG_NONFINITE: tl.constexpr = False, USE_PDL: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = True,
):
    """One program per (chunk, head, block of N): S_loc = sum_s exp(cs_last - cs_s) dt'_s x_s B_s^T [P, N].
    FLAG_NONFINITE (the Hopper chunk-output kernel runs next): a program whose S_loc sums to a
    non-finite value sets entry 3 of the chunk table's row 0, so that the Triton chunk-output kernel
    redoes the stage. A non-finite x_s makes its row of S_loc NaN whatever its weight (0 * NaN = NaN
    on the tensor cores), and every x of a live chunk passes through here; a non-finite B or an
    overflow sets it too, which costs only the Triton kernel's time."""
    _wait_for_kernel_before(USE_PDL, PDL_TRIGGER)  # everything this kernel reads may come from it
    c = tl.program_id(0)
    h = tl.program_id(1)
    pid_n = tl.program_id(2)
    start, length, seg = _chunk_entry(table_ptr, c)
    if seg >= n_seg:
        return
    if HAS_SKIP:
        if tl.load(skip_ptr + seg) != 0:
            return
    row = start // row_len
    l0 = start - row * row_len
    g = h // heads_per_group
    scratch = (h * n_chunk_slots + c) * Q
    cs_last = tl.load(cs_ptr + scratch + length - 1)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mp = offs_p < P
    mn = offs_n < N
    x_chunk = x_ptr + row.to(tl.int64) * stride_x_row + l0.to(tl.int64) * stride_x_tok + h * stride_x_h
    B_chunk = B_ptr + row.to(tl.int64) * stride_B_row + l0.to(tl.int64) * stride_B_tok + g * stride_B_g
    acc = _local_state(x_chunk, B_chunk, cs_ptr + scratch, dt_ptr + scratch, length, cs_last, offs_p, offs_n,
                       mp, mn, stride_x_tok, stride_x_p, stride_B_tok, stride_B_n, BLOCK_K, BLOCK_P, BLOCK_N,
                       DOT_PRECISION, FAST_MATH, DOT_UPCAST)
    st = states_ptr + c.to(tl.int64) * stride_st_c + h * stride_st_h
    tl.store(st + offs_p[:, None] * stride_st_p + offs_n[None, :] * stride_st_n,
             acc.to(states_ptr.dtype.element_ty), mask=mp[:, None] & mn[None, :])
    if FLAG_NONFINITE:
        if (tl.abs(tl.sum(tl.sum(acc, 1), 0)) < float("inf")) == 0:  # NaN fails the test too
            tl.store(table_ptr + 3, 1)


@triton.heuristics({
    "HAS_INIT": lambda a: a["init_ptr"] is not None,
    "HAS_FINAL": lambda a: a["final_ptr"] is not None,
    "HAS_SEG_FINAL": lambda a: a["seg_final_ptr"] is not None,
    "HAS_CHUNK_OUT": lambda a: a["chunk_out_ptr"] is not None,
    "HAS_SKIP": lambda a: a["skip_ptr"] is not None,
    "STOCHASTIC_ROUND": lambda a: a["seed_ptr"] is not None,
})
@triton.jit(do_not_specialize=["n_seg"])
def _state_passing_kernel(
    states_ptr, states_in_ptr, cs_ptr, cu_ptr, skip_ptr,
    init_ptr, init_idx_ptr, final_ptr, final_idx_ptr, seg_final_ptr, chunk_out_ptr, seed_ptr,
    n_seg, P, N, n_chunk_slots,
    stride_st_c, stride_st_h, stride_st_p, stride_st_n,
    stride_si_c, stride_si_h, stride_si_p, stride_si_n,
    stride_init_s, stride_init_h, stride_init_p, stride_init_n,
    stride_final_s, stride_final_h, stride_final_p, stride_final_n,
    stride_sf_s, stride_sf_h, stride_sf_p, stride_sf_n,
    stride_co_c, stride_co_h, stride_co_p, stride_co_n,
    Q: tl.constexpr, BLOCK_PN: tl.constexpr, BLOCK_SEG: tl.constexpr,
    HAS_INIT: tl.constexpr, HAS_FINAL: tl.constexpr, HAS_SEG_FINAL: tl.constexpr,
    HAS_CHUNK_OUT: tl.constexpr, HAS_SKIP: tl.constexpr, STOCHASTIC_ROUND: tl.constexpr,
    USE_PDL: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = True,
):
    _wait_for_kernel_before(USE_PDL, PDL_TRIGGER)  # everything this kernel reads may come from it
    # one program per (segment, head, block of the flattened P*N state): its chunks in order, fp32
    seg = tl.program_id(0)
    h = tl.program_id(1)
    if HAS_SKIP:
        if tl.load(skip_ptr + seg) != 0:
            return
    first, count, seg_len = _locate_segment(cu_ptr, n_seg, seg, Q, BLOCK_SEG)
    offs = tl.program_id(2) * BLOCK_PN + tl.arange(0, BLOCK_PN)
    offs_p = offs // N
    offs_n = offs - offs_p * N
    mask = offs < P * N
    s = tl.zeros((BLOCK_PN,), dtype=tl.float32)
    if HAS_INIT:
        slot = tl.load(init_idx_ptr + seg)
        if slot >= 0:
            src = init_ptr + slot.to(tl.int64) * stride_init_s + h * stride_init_h
            s = tl.load(src + offs_p * stride_init_p + offs_n * stride_init_n, mask=mask, other=0.0).to(tl.float32)
    st_offs = offs_p * stride_st_p + offs_n * stride_st_n
    si_offs = offs_p * stride_si_p + offs_n * stride_si_n
    for k in range(0, count):
        cidx = first + k
        last = tl.minimum(seg_len - k * Q, Q) - 1
        decay = tl.exp(tl.load(cs_ptr + (h * n_chunk_slots + cidx) * Q + last))
        local = tl.load(states_ptr + cidx.to(tl.int64) * stride_st_c + h * stride_st_h + st_offs,
                        mask=mask, other=0.0).to(tl.float32)
        tl.store(states_in_ptr + cidx.to(tl.int64) * stride_si_c + h * stride_si_h + si_offs,
                 s.to(states_in_ptr.dtype.element_ty), mask=mask)
        s = s * decay + local
        if HAS_CHUNK_OUT:
            co = chunk_out_ptr + cidx.to(tl.int64) * stride_co_c + h * stride_co_h
            tl.store(co + offs_p * stride_co_p + offs_n * stride_co_n, s.to(chunk_out_ptr.dtype.element_ty), mask=mask)
    if HAS_FINAL:
        slot = tl.load(final_idx_ptr + seg)
        if (slot >= 0) & (count > 0):
            dst = final_ptr + slot.to(tl.int64) * stride_final_s + h * stride_final_h
            elem = (slot * tl.num_programs(1) + h) * (P * N) + offs  # offs = p * N + n
            tl.store(dst + offs_p * stride_final_p + offs_n * stride_final_n,
                     _to_state_dtype(s, seed_ptr, elem, final_ptr.dtype.element_ty, STOCHASTIC_ROUND), mask=mask)
    if HAS_SEG_FINAL:
        dst = seg_final_ptr + seg.to(tl.int64) * stride_sf_s + h * stride_sf_h
        tl.store(dst + offs_p * stride_sf_p + offs_n * stride_sf_n, s.to(seg_final_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_cb_tile(
    c, g, tile, B_ptr, C_ptr, cu_ptr, cb_ptr,
    n_seg, N,
    stride_B_row, stride_B_tok, stride_B_g, stride_B_n,
    stride_C_row, stride_C_tok, stride_C_g, stride_C_n,
    stride_cb_c, stride_cb_g, stride_cb_m, stride_cb_k,
    row_len, Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SEG: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """C B^T of chunk c, group g, BLOCK_M x BLOCK_M tile ``tile`` (row block, column block) when it is
    on or below the diagonal; the tiles on the diagonal are zero above it (the Hopper chunk-output
    kernel skips the causal mask on them), the tiles above it are not written."""
    n_tiles = tl.cdiv(Q, BLOCK_M)
    pid_m = tile // n_tiles
    pid_k = tile % n_tiles
    seg, start, length, valid = _locate_chunk(cu_ptr, n_seg, c, Q, BLOCK_SEG)
    if (pid_k <= pid_m) & valid & (pid_m * BLOCK_M < length):
        row = start // row_len
        l0 = start - row * row_len
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = pid_k * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        tok_m = (l0 + offs_m).to(tl.int64)
        tok_k = (l0 + offs_k).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            mn = (n0 + offs_n) < N
            Cm = tl.load(C_ptr + row.to(tl.int64) * stride_C_row + g * stride_C_g + tok_m[:, None] * stride_C_tok
                         + (n0 + offs_n)[None, :] * stride_C_n, mask=(offs_m < length)[:, None] & mn[None, :],
                         other=0.0)
            Bk = tl.load(B_ptr + row.to(tl.int64) * stride_B_row + g * stride_B_g + tok_k[None, :] * stride_B_tok
                         + (n0 + offs_n)[:, None] * stride_B_n, mask=(offs_k < length)[None, :] & mn[:, None],
                         other=0.0)
            acc = _mma(Cm, Bk, acc, DOT_PRECISION, DOT_UPCAST)
        if pid_k == pid_m:
            acc = tl.where(offs_m[:, None] >= offs_k[None, :], acc, 0.0)
        dst = cb_ptr + c.to(tl.int64) * stride_cb_c + g * stride_cb_g
        tl.store(dst + offs_m[:, None] * stride_cb_m + offs_k[None, :] * stride_cb_k, acc.to(cb_ptr.dtype.element_ty))


@triton.heuristics({"HAS_DT_BIAS": lambda a: a["dt_bias_ptr"] is not None})
@triton.jit(do_not_specialize=["n_seg", "row_len", "dt_min", "dt_max"])
def _chunk_prep_kernel(
    dt_ptr, dt_bias_ptr, A_ptr, cu_ptr, table_ptr, dt_out_ptr, cs_out_ptr, B_ptr, C_ptr, cb_ptr,
    n_seg, row_len, H, N, n_chunk_slots, n_hblocks, dt_min, dt_max,
    stride_dt_row, stride_dt_tok, stride_dt_h,
    stride_B_row, stride_B_tok, stride_B_g, stride_B_n,
    stride_C_row, stride_C_tok, stride_C_g, stride_C_n,
    stride_cb_c, stride_cb_g, stride_cb_m, stride_cb_k,
    Q: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SEG: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr, A_IS_LOG: tl.constexpr,
    CB_M: tl.constexpr, CB_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    USE_PDL: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = True,
):
    """Grid (chunks, n_hblocks + G * tiles^2): programs (c, y < n_hblocks) run ``_chunk_cumsum_block``
    (heads y * BLOCK_H ..), the others ``_chunk_cb_tile`` (group, CB_M x CB_M tile). Neither reads the
    other's output, so one launch holds both (2.7b shape, H200, L = 2048 / 8192: 4.7 / 11.5 us against
    4.0 + 2.9 / 6.4 + 7.2 us as two launches; 9.0 us at L = 8192 with one pipeline stage)."""
    _wait_for_kernel_before(USE_PDL, PDL_TRIGGER)  # everything this kernel reads may come from it
    c = tl.program_id(0)
    y = tl.program_id(1)
    if y < n_hblocks:
        _chunk_cumsum_block(c, y, dt_ptr, dt_bias_ptr, A_ptr, cu_ptr, table_ptr, dt_out_ptr, cs_out_ptr,
                            n_seg, row_len, H, n_chunk_slots, dt_min, dt_max, stride_dt_row, stride_dt_tok,
                            stride_dt_h, Q, BLOCK_Q, BLOCK_H, BLOCK_SEG, HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT,
                            A_IS_LOG)
    else:
        n_tiles = tl.cdiv(Q, CB_M)
        t = y - n_hblocks
        _chunk_cb_tile(c, t // (n_tiles * n_tiles), t % (n_tiles * n_tiles), B_ptr, C_ptr, cu_ptr, cb_ptr,
                       n_seg, N, stride_B_row, stride_B_tok, stride_B_g, stride_B_n,
                       stride_C_row, stride_C_tok, stride_C_g, stride_C_n,
                       stride_cb_c, stride_cb_g, stride_cb_m, stride_cb_k,
                       row_len, Q, CB_M, CB_N, BLOCK_SEG, DOT_PRECISION, DOT_UPCAST)


@triton.jit
def _chunk_scan_tile(
    c, hb, tile,
    x_ptr, z_ptr, out_ptr, cb_ptr, C_ptr, D_ptr, table_ptr, skip_ptr,
    states_ptr, dt_ptr, cs_ptr, nw_ptr, sq_ptr,
    n_seg, row_len, P, N, heads_per_group, n_chunk_slots, stride_sq_t,
    stride_x_row, stride_x_tok, stride_x_h, stride_x_p,
    stride_z_row, stride_z_tok, stride_z_h, stride_z_p,
    stride_o_row, stride_o_tok, stride_o_h, stride_o_p,
    stride_cb_c, stride_cb_g, stride_cb_m, stride_cb_k,
    stride_C_row, stride_C_tok, stride_C_g, stride_C_n,
    stride_D_h, stride_D_p,
    stride_st_c, stride_st_h, stride_st_p, stride_st_n,
    Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, HEADS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FAST_MATH: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_SKIP: tl.constexpr,
    DOT_UPCAST: tl.constexpr, HAS_NORM: tl.constexpr,
):
    """One tile of the chunk scan: chunk c, heads hb * HEADS .. hb * HEADS + HEADS - 1 (one after the
    other, so the group's C and C B^T tiles come from L1 after the first), ``tile`` = (block of
    BLOCK_M tokens, block of P): y for those tokens."""
    n_pblocks = tl.cdiv(P, BLOCK_P)
    pid_m = tile // n_pblocks
    pid_p = tile % n_pblocks
    start, length, seg = _chunk_entry(table_ptr, c)
    m0 = pid_m * BLOCK_M
    if (seg < n_seg) & (m0 < length):
        row = (start // row_len).to(tl.int64)
        l0 = (start - row * row_len).to(tl.int64)
        # tile offsets are int32 and relative to the chunk's first token; bases are 64-bit scalars
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        mm = offs_m < length
        mp = offs_p < P
        mn = offs_n < N
        mask_mp = mm[:, None] & mp[None, :]
        k_end = tl.minimum(m0 + BLOCK_M, length)
        skip = False
        if HAS_SKIP:
            skip = tl.load(skip_ptr + seg) != 0
        for hh in range(HEADS):
            h = hb * HEADS + hh
            g = h // heads_per_group
            out_ptrs = (out_ptr + row * stride_o_row + l0 * stride_o_tok + h * stride_o_h
                        + offs_m[:, None] * stride_o_tok + offs_p[None, :] * stride_o_p)
            if skip:
                tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_P), dtype=out_ptr.dtype.element_ty), mask=mask_mp)
                if HAS_NORM:  # the deferred norm's sums of token t sit in row start + t (flat index)
                    _defer_norm(tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32), nw_ptr,
                                sq_ptr + (start + offs_m).to(tl.int64) * stride_sq_t, h, pid_p * BLOCK_P, P, mm,
                                BLOCK_M, BLOCK_P)
            else:
                scratch = (h * n_chunk_slots + c) * Q
                cs_m = tl.load(cs_ptr + scratch + offs_m, mask=mm, other=0.0)
                C_m = tl.load(C_ptr + row * stride_C_row + l0 * stride_C_tok + g * stride_C_g
                              + offs_m[:, None] * stride_C_tok + offs_n[None, :] * stride_C_n,
                              mask=mm[:, None] & mn[None, :], other=0.0)
                # the state entering the chunk, seen by every token through exp(cs_t)
                st = states_ptr + c.to(tl.int64) * stride_st_c + h * stride_st_h
                s_T = tl.load(st + offs_n[:, None] * stride_st_n + offs_p[None, :] * stride_st_p,
                              mask=mn[:, None] & mp[None, :], other=0.0)
                # Everything before the block's first row m0 reaches row t through
                # exp(cs_t - cs_s) = exp(cs_t - r) * exp(r - cs_s) with r = cs[m0 - 1] (0 at m0 = 0): both
                # factors are <= 1 (cs falls along the chunk), so the decay is a rank-1 scaling and the
                # C B^T tiles go straight into the matmul; x rows carry exp(r - cs_s) dt_s, acc rows
                # get exp(cs_t - r) at the end. The entering state is the s = -1 term: exp(r) C_t S_in.
                r = 0.0
                if m0 > 0:
                    r = tl.load(cs_ptr + scratch + m0 - 1)
                acc = _mma(C_m, s_T.to(C_m.dtype), None, DOT_PRECISION, DOT_UPCAST) * tl.exp(r)
                x_chunk = x_ptr + row * stride_x_row + l0 * stride_x_tok + h * stride_x_h
                cb_rows = cb_ptr + c.to(tl.int64) * stride_cb_c + g * stride_cb_g + offs_m[:, None] * stride_cb_m
                for k0 in range(0, m0, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    cb = tl.load(cb_rows + offs_k[None, :] * stride_cb_k)
                    w = (exp_approx(r - tl.load(cs_ptr + scratch + offs_k), FAST_MATH)
                         * tl.load(dt_ptr + scratch + offs_k))
                    x_k = tl.load(x_chunk + offs_k[:, None] * stride_x_tok + offs_p[None, :] * stride_x_p,
                                  mask=mp[None, :], other=0.0)
                    acc = _mma(cb, (x_k.to(tl.float32) * w[:, None]).to(cb.dtype), acc, DOT_PRECISION, DOT_UPCAST)
                # rows past the chunk's end (cs_m = 0 there, r < 0) would overflow exp: they are not
                # stored, but keep them finite
                acc = acc * tl.exp(tl.where(mm, cs_m - r, 0.0))[:, None]
                # the block's own rows: exact causal decay per element (a rank-1 split could overflow here)
                for k0 in range(m0, k_end, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    mk = offs_k < k_end
                    # inside the padded CB buffer; tiles above the diagonal were never written, so
                    # they are selected away below, never multiplied
                    cb = tl.load(cb_rows + offs_k[None, :] * stride_cb_k).to(tl.float32)
                    cs_k = tl.load(cs_ptr + scratch + offs_k, mask=mk, other=0.0)
                    dt_k = tl.load(dt_ptr + scratch + offs_k, mask=mk, other=0.0)
                    # rows past the chunk's end are left out too: cs there is 0, and exp(0 - cs_k) overflows
                    causal = (offs_m[:, None] >= offs_k[None, :]) & mk[None, :] & mm[:, None]
                    decay = exp_approx(tl.where(causal, cs_m[:, None] - cs_k[None, :], float("-inf")), FAST_MATH)
                    cb = tl.where(causal, cb * decay * dt_k[None, :], 0.0)
                    x_k = tl.load(x_chunk + offs_k[:, None] * stride_x_tok + offs_p[None, :] * stride_x_p,
                                  mask=mk[:, None] & mp[None, :], other=0.0)
                    # a non-finite x_s must not reach rows t < s through a zero weight (0 * NaN = NaN in
                    # the matmul): it enters as 0 here (elementwise: the loop stays pipelined), and the
                    # rows t >= s are set to NaN below
                    x_k = tl.where(tl.abs(x_k.to(tl.float32)) < float("inf"), x_k, 0.0).to(x_k.dtype)
                    acc = _mma(cb.to(x_k.dtype), x_k, acc, DOT_PRECISION, DOT_UPCAST)
                # the block's rows are the diagonal's tokens: column p is NaN from its first non-finite
                # x_s on (one reduction per program, after the loop; a test and a second matmul in every
                # trip of the loop made the whole scan 1.85x slower on an H100)
                x_m = tl.load(x_chunk + offs_m[:, None] * stride_x_tok + offs_p[None, :] * stride_x_p,
                              mask=mask_mp, other=0.0).to(tl.float32)
                first_bad = tl.min(tl.where(tl.abs(x_m) < float("inf"), BLOCK_M + m0, offs_m[:, None]), axis=0)
                acc = tl.where(offs_m[:, None] >= first_bad[None, :], float("nan"), acc)
                if HAS_D:
                    d = tl.load(D_ptr + h * stride_D_h + offs_p * stride_D_p, mask=mp, other=0.0).to(tl.float32)
                    acc += x_m * d[None, :]
                if HAS_Z:
                    zv = tl.load(z_ptr + row * stride_z_row + l0 * stride_z_tok + h * stride_z_h
                                 + offs_m[:, None] * stride_z_tok + offs_p[None, :] * stride_z_p,
                                 mask=mask_mp, other=0.0).to(tl.float32)
                    acc = acc * silu_approx(zv, FAST_MATH)
                if HAS_NORM:
                    acc = _defer_norm(acc, nw_ptr, sq_ptr + (start + offs_m).to(tl.int64) * stride_sq_t, h,
                                      pid_p * BLOCK_P, P, mm, BLOCK_M, BLOCK_P)
                tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_mp)


@triton.heuristics({
    "HAS_D": lambda a: a["D_ptr"] is not None,
    "HAS_Z": lambda a: a["z_ptr"] is not None,
    "HAS_SKIP": lambda a: a["skip_ptr"] is not None,
    "HAS_NORM": lambda a: a["sq_ptr"] is not None,
})
@triton.jit(do_not_specialize=["n_seg", "row_len"])
def _chunk_scan_kernel(
    x_ptr, z_ptr, out_ptr, cb_ptr, C_ptr, D_ptr, table_ptr, skip_ptr,
    states_ptr, dt_ptr, cs_ptr, nw_ptr, sq_ptr,
    n_seg, row_len, P, N, heads_per_group, n_chunk_slots, stride_sq_t,
    stride_x_row, stride_x_tok, stride_x_h, stride_x_p,
    stride_z_row, stride_z_tok, stride_z_h, stride_z_p,
    stride_o_row, stride_o_tok, stride_o_h, stride_o_p,
    stride_cb_c, stride_cb_g, stride_cb_m, stride_cb_k,
    stride_C_row, stride_C_tok, stride_C_g, stride_C_n,
    stride_D_h, stride_D_p,
    stride_st_c, stride_st_h, stride_st_p, stride_st_n, n_head_blocks,
    Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, HEADS: tl.constexpr, DOT_PRECISION: tl.constexpr, HEAD_MAJOR: tl.constexpr,
    FAST_MATH: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_SKIP: tl.constexpr,
    DOT_UPCAST: tl.constexpr, HAS_NORM: tl.constexpr = False, ONLY_IF_FLAGGED: tl.constexpr = False,
    USE_PDL: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = True,
):
    """Grid (tiles, chunks, head blocks) under HEAD_MAJOR (the tiles of one (chunk, head) side by
    side), else (chunks, head blocks, tiles): one ``_chunk_scan_tile`` per program.
    ONLY_IF_FLAGGED (after the Hopper kernel): a 1-d grid of any size, whose programs exit at once
    unless the chunk-state kernel met a non-finite x (entry 3 of the chunk table's row 0); then they
    walk all n_chunk_slots x n_head_blocks x tiles tiles and redo the stage. (A full grid of programs
    that only exit cost 2.9 / 7.1 us at L = 2048 / 8192, 2.7b shape, H200.) The two modes call the tile
    body from two places: one loop for both (a one-trip loop and the tile decoded from a flat index
    in the plain mode) made the plain mode 4% slower (H200, L = 8192: 319 -> 333 us, whole scan)."""
    _wait_for_kernel_before(USE_PDL, PDL_TRIGGER)  # everything this kernel reads may come from it
    if ONLY_IF_FLAGGED:
        if tl.load(table_ptr + 3) != 0:
            n_tiles = tl.cdiv(Q, BLOCK_M) * tl.cdiv(P, BLOCK_P)
            for t in range(tl.program_id(0), n_tiles * n_chunk_slots * n_head_blocks, tl.num_programs(0)):
                _chunk_scan_tile(t // n_tiles % n_chunk_slots, t // (n_tiles * n_chunk_slots), t % n_tiles,
                                 x_ptr, z_ptr, out_ptr, cb_ptr, C_ptr, D_ptr, table_ptr, skip_ptr,
                                 states_ptr, dt_ptr, cs_ptr, nw_ptr, sq_ptr,
                                 n_seg, row_len, P, N, heads_per_group, n_chunk_slots, stride_sq_t,
                                 stride_x_row, stride_x_tok, stride_x_h, stride_x_p,
                                 stride_z_row, stride_z_tok, stride_z_h, stride_z_p,
                                 stride_o_row, stride_o_tok, stride_o_h, stride_o_p,
                                 stride_cb_c, stride_cb_g, stride_cb_m, stride_cb_k,
                                 stride_C_row, stride_C_tok, stride_C_g, stride_C_n,
                                 stride_D_h, stride_D_p,
                                 stride_st_c, stride_st_h, stride_st_p, stride_st_n,
                                 Q, BLOCK_M, BLOCK_K, BLOCK_P, BLOCK_N, HEADS, DOT_PRECISION,
                                 FAST_MATH, HAS_D, HAS_Z, HAS_SKIP, DOT_UPCAST, HAS_NORM)
    else:
        if HEAD_MAJOR:
            c = tl.program_id(1)
            hb = tl.program_id(2)
            tile = tl.program_id(0)
        else:
            c = tl.program_id(0)
            hb = tl.program_id(1)
            tile = tl.program_id(2)
        _chunk_scan_tile(c, hb, tile, x_ptr, z_ptr, out_ptr, cb_ptr, C_ptr, D_ptr, table_ptr, skip_ptr,
                         states_ptr, dt_ptr, cs_ptr, nw_ptr, sq_ptr,
                         n_seg, row_len, P, N, heads_per_group, n_chunk_slots, stride_sq_t,
                         stride_x_row, stride_x_tok, stride_x_h, stride_x_p,
                         stride_z_row, stride_z_tok, stride_z_h, stride_z_p,
                         stride_o_row, stride_o_tok, stride_o_h, stride_o_p,
                         stride_cb_c, stride_cb_g, stride_cb_m, stride_cb_k,
                         stride_C_row, stride_C_tok, stride_C_g, stride_C_n,
                         stride_D_h, stride_D_p,
                         stride_st_c, stride_st_h, stride_st_p, stride_st_n,
                         Q, BLOCK_M, BLOCK_K, BLOCK_P, BLOCK_N, HEADS, DOT_PRECISION,
                         FAST_MATH, HAS_D, HAS_Z, HAS_SKIP, DOT_UPCAST, HAS_NORM)


@triton.jit
def _segment_slots_kernel(slots_ptr, has_init_ptr, idx_ptr, skip_ptr, n_seg, pad_slot_id, S,
                          HAS_SLOTS: tl.constexpr, HAS_INIT: tl.constexpr, BLOCK: tl.constexpr):
    """Per-sequence state rows of ssd_scan_varlen in one launch (instead of a dozen small torch ops):
    a slot outside [0, S) or equal to pad_slot_id is padding (skip 1, no read, no write);
    idx[0] = the slot the final state goes to (-1: none), idx[1] = the slot the initial state comes
    from (-1: zeros; only with HAS_INIT). One program per BLOCK sequences."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_seg
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + offs, mask=m, other=0).to(tl.int32)
    else:
        slot = offs
    pad = (slot == pad_slot_id) | (slot < 0) | (slot >= S)
    tl.store(idx_ptr + offs, tl.where(pad, -1, slot), mask=m)
    if HAS_SLOTS:
        tl.store(skip_ptr + offs, pad.to(tl.int8), mask=m)
    if HAS_INIT:
        has = tl.load(has_init_ptr + offs, mask=m, other=0) != 0
        tl.store(idx_ptr + n_seg + offs, tl.where(has & (pad == 0), slot, -1), mask=m)
