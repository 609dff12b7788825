"""Triton kernels of the replay state update (speculative verification, T tokens per request).

A slot holds a stored state and the inputs of the k = hist_len + prev_accepted accepted tokens
consumed since it was stored (its history, up to C_h tokens, in buffer r = buf_idx[slot]). With
a_t = A[h] dt'_t and cs_t = a_0 + ... + a_t over this step's T tokens, two kernels run:

1. ``_replay_precompute_kernel`` (request, group, block of the group's heads): dt' and cs for the
   new tokens, the group's C B^T (one tensor-core matmul), and per head the causal matrix
       M[t, s] = (C_t . B_s) exp(cs_t - cs_s) dt'_s   (s <= t, else 0)   -> fp32 scratch [B, H, T, T];
   then records this step's B, dt' and the cumulative decay in the history: appended at position
   k of buffer r, or -- when k + T > C_h, the step at which the main kernel stores the state --
   at position 0 of buffer 1 - r (a new history).
2. ``_replay_main_kernel`` (block of P, request, head): loads the stored state tile once,
   replays the k history tokens in chunks of 16 (one tl.dot each)
       S <- exp(cA_{k-1}) S + (x_old * exp(cA_{k-1} - cA_s) dt_old_s)^T @ B_old
   stores it only when the history would overflow (the checkpoint: usually one step in several,
   so the state is read every step but written rarely), then produces all T outputs
       y = exp(cs) * (C @ S^T) + M @ x + D x,   y *= silu(z)                       (two tl.dot)
   (computed transposed, [P, T], so that the P rows are every dot's M dimension), and records
   this step's x at the same history position as the precompute kernel.

The split path (large grids, ReplayConfig.split) replaces 2. by two kernels, because the main
kernel's dot chain holds 200-220 registers per thread and leaves it latency-bound at 8 warps per SM:
2a. ``_replay_out_kernel`` (block of P, request, head): every request's T outputs straight from the
   stored state, without replaying it: with Q[t, c] = C_t . B_c for the history tokens (per group)
   and the decay factors exp(cs_t), exp(cA_{k-1}) and u_c = dt'_c exp(cA_{k-1} - cA_c) (per head),
   all from the precompute kernel,
       y = exp(cs) * (exp(cA_{k-1}) C @ S_stored^T + Q @ (u x_old)) + M @ x + D x,
   and records x where no state is stored this step. For an fp32 state with bf16 activations on sm_90+ (contiguous tensors, ``out_tma_usable``),
   ``_replay_out_tma_kernel`` does the same as a persistent loop over the tiles, fed by TMA, so
   that the next tile's state streams into shared memory while this one computes (configs.OUT_TMA);
2b. ``_replay_checkpoint_kernel`` (persistent): only the requests that store their state this
   step (about one in eight at the default history; listed by the precompute kernel, one
   [request, slot, k, rbuf] record each) replay, store it and record x.
On sm_90 the three split-path kernels run as a chain of programmatic dependent launches
(configs.CHAIN_PDL): each reads what the kernel before it does not write, then waits.

The token axis is padded to BLOCK_T >= 16 (tl.dot's smallest size) and masked. No per-token state
is ever materialised: the state moves through HBM once in, and out only at a checkpoint.

This module holds kernels 1. and 2. and their launchers; ``out_kernel.py`` holds 2a,
``checkpoint_kernel.py`` 2b, ``commit_kernel.py`` the commit / flush / reset bookkeeping, and
``kernel_common.py`` the @triton.jit pieces they share.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fastmamba.ops._common.jit_math import silu, softplus
from fastmamba.ops._common.launch import lean
from fastmamba.ops._common.host_math import cdiv
from fastmamba.ops.replay.kernel_common import (
    HISTORY_CHUNK,
    _dot_precision,
    _dot_split,
    _dot_split_rhs,
    _interpreting,
    _replay_history,
    _slot_history,
    _store_state,
    dot_dim,
)


@triton.jit
def _replay_precompute_kernel(
    dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, idx_ptr, buf_idx_ptr, accepted_ptr, hist_ptr,
    M_ptr, Q_ptr, scale_ptr, kinfo_ptr, C16_ptr, old_B_ptr, old_dt_ptr, old_cumA_ptr, ckpt_count_ptr, ckpt_list_ptr,
    T, capacity, heads_per_group, pad_slot_id, n_slots,
    stride_dt_b, stride_dt_t, stride_dt_h,
    stride_dt_bias_h, stride_A_h,
    stride_B_b, stride_B_t, stride_B_g, stride_B_n,
    stride_C_b, stride_C_t, stride_C_g, stride_C_n,
    stride_M_b, stride_M_h, stride_M_t, stride_M_s,
    stride_Q_b, stride_Q_g, stride_Q_t, stride_Q_c,
    stride_sc_b, stride_sc_h,
    stride_oB_r, stride_oB_s, stride_oB_t, stride_oB_g, stride_oB_n,
    stride_odt_r, stride_odt_s, stride_odt_t, stride_odt_h,
    stride_ocs_r, stride_ocs_s, stride_ocs_t, stride_ocs_h,
    HAS_DT_BIAS: tl.constexpr, HAS_IDX: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, HEADS: tl.constexpr,
    HIST: tl.constexpr, BLOCK_C: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr, HAS_KINFO: tl.constexpr,
    HAS_C16: tl.constexpr, NATIVE16: tl.constexpr, GROUP_CB: tl.constexpr = False, A_IS_LOG: tl.constexpr = False,
):
    # one program per (request, group, block of HEADS heads of that group): C B^T is computed once
    # and shared by the block's heads, which differ only in their decay and dt'
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    hb = tl.program_id(2)
    if HAS_IDX:
        slot = tl.load(idx_ptr + b).to(tl.int64)
    else:
        slot = b
    if (slot == pad_slot_id) | (slot < 0) | (slot >= n_slots):  # outside [0, S): as the pad slot
        return  # padding: the main kernel zeroes its output, nothing is recorded
    rbuf, k = _slot_history(buf_idx_ptr, hist_ptr, accepted_ptr, slot, capacity)
    checkpoint = k + T > capacity  # the main kernel stores the state; a new history starts
    wbuf = tl.where(checkpoint, 1 - rbuf, rbuf)
    base = tl.where(checkpoint, 0, k).to(tl.int64)

    offs_t = tl.arange(0, BLOCK_T)
    offs_n = tl.arange(0, BLOCK_N)
    offs_j = hb * HEADS + tl.arange(0, HEADS)
    mt = offs_t < T
    mn = offs_n < N
    mj = offs_j < heads_per_group
    h = g * heads_per_group + offs_j  # [HEADS]
    mask_ht = mj[:, None] & mt[None, :]

    # what the previous step left (read before the grid-dependency wait under PDL: the kernel
    # launched just before this one, the conv update, writes none of it)
    cum_last = tl.load(old_cumA_ptr + rbuf * stride_ocs_r + slot * stride_ocs_s + (k - 1) * stride_ocs_t
                       + h * stride_ocs_h, mask=mj & (k > 0), other=0.0)  # cA_{k-1}, or 0
    offset = tl.where(checkpoint, 0.0, cum_last)  # where this step's cumulative decay is recorded from
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias_ptr + h * stride_dt_bias_h, mask=mj, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([HEADS], dtype=tl.float32)
    A = tl.load(A_ptr + h * stride_A_h, mask=mj, other=0.0).to(tl.float32)
    if A_IS_LOG:  # A holds A_log: the decay rate is computed here, so no cached -exp(A_log) goes stale
        A = -tl.exp(A)
    if USE_PDL:
        gdc_wait()  # dt, B and C come from the kernels before
    if USE_PDL or LAUNCH_DEPENDENTS:
        gdc_launch_dependents()

    # dt' and the cumulative log-decay cs, [HEADS, BLOCK_T] (zero past T, so cs stays flat there)
    d = tl.load(dt_ptr + b * stride_dt_b + offs_t[None, :] * stride_dt_t + h[:, None] * stride_dt_h,
                mask=mask_ht, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        d += bias[:, None]
    if DT_SOFTPLUS:
        d = softplus(d)
    d = tl.where(mask_ht, d, 0.0)
    cs = tl.cumsum(d * A[:, None], axis=1)

    # C B^T of the group, [BLOCK_T (t), BLOCK_T (s)]
    tile_tn = mt[:, None] & mn[None, :]
    Cm = tl.load(C_ptr + b * stride_C_b + g * stride_C_g + offs_t[:, None] * stride_C_t + offs_n[None, :] * stride_C_n,
                 mask=tile_tn, other=0.0)
    Bm = tl.load(B_ptr + b * stride_B_b + g * stride_B_g + offs_t[:, None] * stride_B_t + offs_n[None, :] * stride_B_n,
                 mask=tile_tn, other=0.0)
    # 16-bit B and C: a 16-bit tensor-core dot (exact products, fp32 sums), on the GPU with the
    # operands as they are (NATIVE16: half the operand registers), else on fp32 operands in TF32,
    # where 16-bit values are exact (the CPU interpreter's 16-bit tl.dot is wrong in Triton 3.6)
    if NATIVE16:
        cb = tl.dot(Cm, tl.trans(Bm))
    else:
        cb = tl.dot(Cm.to(tl.float32), tl.trans(Bm.to(tl.float32)), input_precision=DOT_PRECISION)

    if GROUP_CB:
        # the split path's one-tile output kernel: the group's cb itself in M ([B, G, T, T]), and
        # per head cs and dt' in the scale row (below); that kernel builds its head's M from them
        # (_causal_M): a [T, T] tile per group written and read, not one per head
        if hb == 0:
            tl.store(M_ptr + b * stride_M_b + g * stride_M_h + offs_t[:, None] * stride_M_t
                     + offs_t[None, :] * stride_M_s, cb, mask=mt[:, None] & mt[None, :])
    else:
        # M[h, t, s] = cb[t, s] exp(cs[h, t] - cs[h, s]) dt'[h, s] for s <= t; the exponent is <= 0
        # there (A < 0), and the masked upper triangle gets exp(-inf) = 0 rather than a huge number
        causal = (offs_t[:, None] >= offs_t[None, :])[None, :, :]
        decay = tl.exp(tl.where(causal, cs[:, :, None] - cs[:, None, :], float("-inf")))
        M = cb[None, :, :] * decay * d[:, None, :]
        M_ptrs = (M_ptr + b * stride_M_b + h[:, None, None] * stride_M_h
                  + offs_t[None, :, None] * stride_M_t + offs_t[None, None, :] * stride_M_s)
        tl.store(M_ptrs, M, mask=mj[:, None, None] & mt[None, :, None] & mt[None, None, :])

    # HIST (the split path, see _replay_out_kernel): the group's products of this step's C with
    # the history's B,
    #   Q[t, c] = C_t . B_c   (c < k, buffer rbuf),
    # and per head the decay factors the output kernel scales them and the state's share with,
    #   scale = [exp(cs_0) .. exp(cs_{T-1}), exp(cA_{k-1}), u_0 .. u_{C_h - 1}],  and (GROUP_CB)
    #           [.., cs_0 .. cs_{T-1}, dt'_0 .. dt'_{T-1}],
    #   u_c = dt'_c exp(cA_{k-1} - cA_c) for c < k, else 0     (every exponent <= 0),
    # from the history positions < k of buffer rbuf (nothing below writes there); and the list of
    # the requests that store their state this step (the checkpoint kernel's work)
    if HIST:
        if (g == 0) & (hb == 0):
            if HAS_KINFO:  # the request's k, for an output kernel launched without PDL
                tl.store(kinfo_ptr + b, k)
            if checkpoint:  # one record [request, slot, k, rbuf] in the list
                rec = ckpt_list_ptr + 4 * tl.atomic_add(ckpt_count_ptr, 1)
                tl.store(rec, b.to(tl.int32))
                tl.store(rec + 1, slot.to(tl.int32))
                tl.store(rec + 2, k)
                tl.store(rec + 3, rbuf.to(tl.int32))
        sc_row = scale_ptr + b * stride_sc_b + h * stride_sc_h  # [HEADS]
        tl.store(sc_row[:, None] + offs_t[None, :], tl.exp(cs), mask=mask_ht)
        tl.store(sc_row + T, tl.exp(cum_last), mask=mj)
        offs_u = tl.arange(0, BLOCK_C)
        mu = mj[:, None] & (offs_u < k)[None, :]
        hist_h = rbuf * stride_ocs_r + slot * stride_ocs_s + h[:, None] * stride_ocs_h + offs_u[None, :] * stride_ocs_t
        cA_h = tl.load(old_cumA_ptr + hist_h, mask=mu, other=0.0)
        dt_h = tl.load(old_dt_ptr + rbuf * stride_odt_r + slot * stride_odt_s + h[:, None] * stride_odt_h
                       + offs_u[None, :] * stride_odt_t, mask=mu, other=0.0)
        u = tl.where(mu, dt_h * tl.exp(cum_last[:, None] - cA_h), 0.0)
        tl.store(sc_row[:, None] + T + 1 + offs_u[None, :], u, mask=mj[:, None] & (offs_u < capacity)[None, :])
        if GROUP_CB:
            tl.store(sc_row[:, None] + T + 1 + capacity + offs_t[None, :], cs, mask=mask_ht)
            tl.store(sc_row[:, None] + 2 * T + 1 + capacity + offs_t[None, :], d, mask=mask_ht)
        if hb == 0:
            if HAS_C16:  # C in fp16 for an fp16 state's 16-bit output dot: once per group, not per head
                tl.store(C16_ptr + ((b * tl.num_programs(1) + g) * BLOCK_T + offs_t[:, None]) * BLOCK_N + offs_n[None, :],
                         Cm.to(tl.float16), mask=tile_tn)
            offs_c = tl.arange(0, BLOCK_C)
            mc = offs_c < k
            B_h = tl.load(old_B_ptr + rbuf * stride_oB_r + slot * stride_oB_s + g * stride_oB_g
                          + offs_c[:, None] * stride_oB_t + offs_n[None, :] * stride_oB_n,
                          mask=mc[:, None] & mn[None, :], other=0.0)  # [BLOCK_C, BLOCK_N]
            if NATIVE16:
                q = tl.dot(Cm, tl.trans(B_h))
            else:
                q = tl.dot(Cm.to(tl.float32), tl.trans(B_h.to(tl.float32)), input_precision=DOT_PRECISION)
            tl.store(Q_ptr + b * stride_Q_b + g * stride_Q_g + offs_t[:, None] * stride_Q_t + offs_c[None, :] * stride_Q_c,
                     q, mask=mt[:, None] & mc[None, :])

    # record this step's dt', cumulative decay (from the stored state) and B in the history, at
    # position base of buffer wbuf; the main kernel reads only positions < k of buffer rbuf
    pos = base + offs_t
    dt_rec = old_dt_ptr + wbuf * stride_odt_r + slot * stride_odt_s
    tl.store(dt_rec + pos[None, :] * stride_odt_t + h[:, None] * stride_odt_h, d, mask=mask_ht)
    cs_rec = old_cumA_ptr + wbuf * stride_ocs_r + slot * stride_ocs_s
    tl.store(cs_rec + pos[None, :] * stride_ocs_t + h[:, None] * stride_ocs_h, cs + offset[:, None], mask=mask_ht)
    if hb == 0:
        B_rec = old_B_ptr + wbuf * stride_oB_r + slot * stride_oB_s + g * stride_oB_g
        tl.store(B_rec + pos[:, None] * stride_oB_t + offs_n[None, :] * stride_oB_n,
                 Bm.to(old_B_ptr.dtype.element_ty), mask=tile_tn)


@triton.jit
def _replay_main_kernel(
    state_ptr, old_x_ptr, old_B_ptr, old_dt_ptr, old_cumA_ptr, buf_idx_ptr, accepted_ptr, hist_ptr,
    x_ptr, C_ptr, D_ptr, z_ptr, M_ptr, out_ptr, idx_ptr, seed_ptr,
    T, capacity, heads_per_group, pad_slot_id, n_slots,
    stride_state_s, stride_state_h, stride_state_p, stride_state_n,
    stride_ox_s, stride_ox_t, stride_ox_h, stride_ox_p,
    stride_oB_r, stride_oB_s, stride_oB_t, stride_oB_g, stride_oB_n,
    stride_odt_r, stride_odt_s, stride_odt_t, stride_odt_h,
    stride_ocs_r, stride_ocs_s, stride_ocs_t, stride_ocs_h,
    stride_x_b, stride_x_t, stride_x_h, stride_x_p,
    stride_C_b, stride_C_t, stride_C_g, stride_C_n,
    stride_D_h,
    stride_z_b, stride_z_t, stride_z_h, stride_z_p,
    stride_M_b, stride_M_h, stride_M_t, stride_M_s,
    stride_out_b, stride_out_t, stride_out_h, stride_out_p,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_IDX: tl.constexpr, STOCHASTIC_ROUND: tl.constexpr,
    P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # one program per (block of P, request, head): replay, checkpoint, T outputs, record x
    pid_p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    g = h // heads_per_group

    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_t = tl.arange(0, BLOCK_T)
    mp = offs_p < P
    mt = offs_t < T

    if HAS_IDX:
        slot = tl.load(idx_ptr + b).to(tl.int64)
    else:
        slot = b
    # padding, or a slot outside [0, S): zero output, no state or cache traffic
    if (slot == pad_slot_id) | (slot < 0) | (slot >= n_slots):
        tl.store(out_ptr + b * stride_out_b + h * stride_out_h + offs_p[:, None] * stride_out_p
                 + offs_t[None, :] * stride_out_t, tl.zeros((BLOCK_P, BLOCK_T), dtype=out_ptr.dtype.element_ty),
                 mask=mp[:, None] & mt[None, :])
        return
    rbuf, k = _slot_history(buf_idx_ptr, hist_ptr, accepted_ptr, slot, capacity)
    checkpoint = k + T > capacity

    cum_row = old_cumA_ptr + rbuf * stride_ocs_r + slot * stride_ocs_s + h * stride_ocs_h
    dt_row = old_dt_ptr + rbuf * stride_odt_r + slot * stride_odt_s + h * stride_odt_h
    B_hist = old_B_ptr + rbuf * stride_oB_r + slot * stride_oB_s + g * stride_oB_g
    x_row = old_x_ptr + slot * stride_ox_s + h * stride_ox_h
    state_row = state_ptr + slot * stride_state_s + h * stride_state_h
    cum_last = tl.load(cum_row + (k - 1) * stride_ocs_t, mask=k > 0, other=0.0)  # cA_{k-1}; 0 when k = 0
    wbuf = tl.where(checkpoint, 1 - rbuf, rbuf)
    base = tl.where(checkpoint, 0, k).to(tl.int64)
    offset = tl.where(checkpoint, 0.0, cum_last)  # the precompute kernel stored offset + cs

    # 1. replay the k history tokens onto the stored state, 16 per tl.dot; store it at a
    # checkpoint; 2. C.S for the T outputs (transposed, [P, T], so that every tl.dot has the P rows
    # as M). Under PDL the replay, before the grid-dependency wait, overlaps the precompute kernel
    # launched just before: nothing it reads is written there (the precompute kernel records at
    # positions >= k of buffer rbuf, or in the other buffer).
    offs_n = tl.arange(0, BLOCK_N)
    mn = offs_n < N
    tile_mask = mp[:, None] & mn[None, :]
    s_off = offs_p[:, None] * stride_state_p + offs_n[None, :] * stride_state_n
    s = tl.load(state_row + s_off, mask=tile_mask, other=0.0).to(tl.float32) * tl.exp(cum_last)
    s = _replay_history(s, k, cum_last, cum_row, dt_row, x_row, B_hist, offs_p, mp, offs_n, mn,
                        stride_ocs_t, stride_odt_t, stride_ox_t, stride_ox_p, stride_oB_t, stride_oB_n,
                        BLOCK_H, SPLIT, DOT_PRECISION)

    if checkpoint:  # the history would overflow: store the state, this step starts a new history
        _store_state(s, state_row + s_off, tile_mask, slot, h, tl.num_programs(2), offs_p, offs_n, seed_ptr,
                     P, N, STOCHASTIC_ROUND)
    if USE_PDL:
        gdc_wait()  # M and this step's cs (precompute), x, C, z (earlier kernels) from here on
        gdc_launch_dependents()
    C_T = tl.load(C_ptr + b * stride_C_b + g * stride_C_g + offs_n[:, None] * stride_C_n
                  + offs_t[None, :] * stride_C_t, mask=mn[:, None] & mt[None, :], other=0.0)
    y = _dot_split(s, C_T, tl.zeros((BLOCK_P, BLOCK_T), dtype=tl.float32), SPLIT, DOT_PRECISION)  # [BLOCK_P, BLOCK_T]

    # ---- the T outputs: y^T = (S @ C^T) * exp(cs) + x^T @ M^T + D x^T, gated ----------------------
    cs = tl.load(old_cumA_ptr + wbuf * stride_ocs_r + slot * stride_ocs_s + h * stride_ocs_h
                 + (base + offs_t) * stride_ocs_t, mask=mt, other=0.0) - offset
    M_T = tl.load(M_ptr + b * stride_M_b + h * stride_M_h + offs_t[:, None] * stride_M_s + offs_t[None, :] * stride_M_t,
                  mask=mt[:, None] & mt[None, :], other=0.0)  # [s, t]
    mask_pt = mp[:, None] & mt[None, :]
    x_T = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + offs_p[:, None] * stride_x_p + offs_t[None, :] * stride_x_t,
                  mask=mask_pt, other=0.0)  # [BLOCK_P, BLOCK_T]
    xf = x_T.to(tl.float32)
    y = y * tl.exp(cs)[None, :]
    y = _dot_split_rhs(x_T, M_T, y, SPLIT, DOT_PRECISION)
    if HAS_D:
        y += xf * tl.load(D_ptr + h * stride_D_h).to(tl.float32)
    if HAS_Z:
        zv = tl.load(z_ptr + b * stride_z_b + h * stride_z_h + offs_p[:, None] * stride_z_p + offs_t[None, :] * stride_z_t,
                     mask=mask_pt, other=0.0).to(tl.float32)
        y *= silu(zv)
    tl.store(out_ptr + b * stride_out_b + h * stride_out_h + offs_p[:, None] * stride_out_p
             + offs_t[None, :] * stride_out_t, y.to(out_ptr.dtype.element_ty), mask=mask_pt)

    # ---- 3. record this step's x in the history (position base, as the precompute kernel) ---------
    # At a checkpoint the replay above read these rows, possibly in another thread layout: wait
    # until every thread of the program has its old x before any thread overwrites them.
    tl.debug_barrier()
    tl.store(x_row + offs_p[:, None] * stride_ox_p + (base + offs_t)[None, :] * stride_ox_t,
             x_T.to(old_x_ptr.dtype.element_ty), mask=mask_pt)


def launch_replay_precompute(
    dt, dt_bias, A, B, C, idx, buf_idx, prev_accepted, hist_len, M, old_B, old_dt, old_cumA,
    Q=None, scale=None, kinfo=None, C16=None, ckpt_count=None, ckpt_list=None,
    *, dt_softplus: bool, pad_slot_id: int, heads: int, num_warps: int, use_pdl: bool = False,
    launch_dependents: bool = False, group_cb: bool = False, A_is_log: bool = False,
):
    """dt (B,T,H) raw; dt_bias, A (H,) or None (A holds A_log when ``A_is_log``); B, C (B,T,G,N); idx (B,) or None; buf_idx,
    prev_accepted, hist_len (S,); M (B,H,T,T) fp32 scratch, or with ``group_cb`` (the split path's
    one-tile output kernel) (B,G,T,T): C . B^T per group; old_B (2,S,C_h,G,N); old_dt, old_cumA
    (2,S,C_h,H). The split path's scratch (else None): Q (B,G,T,C_h) fp32; ckpt_count (1,) int32,
    zeroed; ckpt_list (B, 4) int32; scale (B, H, T + 1 + C_h), with ``group_cb`` (B, H, 3T + 1 +
    C_h), fp32 (contiguous last dim); kinfo (B,) int32 or None; C16 (B, G, BLOCK_T, BLOCK_N) fp16 or
    None (contiguous)."""
    nreq, ntok, nheads = dt.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    hpg = nheads // ngroups
    grid = (nreq, ngroups, cdiv(hpg, heads))
    capacity = old_dt.shape[2]
    lean(_replay_precompute_kernel)[grid](
        dt, dt_bias, A, B, C, idx, buf_idx, prev_accepted, hist_len, M, Q, scale, kinfo, C16, old_B, old_dt, old_cumA,
        ckpt_count, ckpt_list, ntok, capacity, hpg, pad_slot_id, old_dt.shape[1],
        *dt.stride(), dt_bias.stride(0) if dt_bias is not None else 0, A.stride(0),
        *B.stride(), *C.stride(), *M.stride(), *(Q.stride() if Q is not None else (0, 0, 0, 0)),
        *(scale.stride()[:2] if scale is not None else (0, 0)),
        *old_B.stride(), *old_dt.stride(), *old_cumA.stride(),
        HAS_DT_BIAS=dt_bias is not None, HAS_IDX=idx is not None, DT_SOFTPLUS=dt_softplus,
        N=dstate, BLOCK_N=dot_dim(dstate), BLOCK_T=dot_dim(ntok),
        HEADS=heads, HIST=Q is not None, BLOCK_C=dot_dim(capacity),
        DOT_PRECISION=_dot_precision(B.dtype, "ieee"), USE_PDL=use_pdl, LAUNCH_DEPENDENTS=launch_dependents,
        HAS_KINFO=kinfo is not None, HAS_C16=C16 is not None, GROUP_CB=group_cb, A_IS_LOG=A_is_log,
        NATIVE16=not _interpreting() and B.dtype in (torch.bfloat16, torch.float16)
        and C.dtype == B.dtype and old_B.dtype == B.dtype,
        num_warps=num_warps, launch_pdl=use_pdl,
    )


def launch_replay_main(
    state, old_x, old_B, old_dt, old_cumA, buf_idx, prev_accepted, hist_len, x, C, D, z, M, out, idx, seed,
    *, pad_slot_id: int, block_p: int, num_warps: int, use_pdl: bool = False,
):
    """state (S,H,P,N); old_x (S,C_h,H,P); x, z, out (B,T,H,P); C (B,T,G,N); D (H,) or None;
    M from the precompute kernel; idx (B,) or None; seed one-element int64 or None."""
    nreq, ntok, nheads, headdim = x.shape
    ngroups, dstate = C.shape[2], C.shape[3]
    grid = (cdiv(headdim, block_p), nreq, nheads)
    z_strides = tuple(z.stride()) if z is not None else (0, 0, 0, 0)
    lean(_replay_main_kernel)[grid](
        state, old_x, old_B, old_dt, old_cumA, buf_idx, prev_accepted, hist_len,
        x, C, D, z, M, out, idx, seed,
        ntok, old_x.shape[1], nheads // ngroups, pad_slot_id, state.shape[0],
        *state.stride(), *old_x.stride(), *old_B.stride(), *old_dt.stride(), *old_cumA.stride(),
        *x.stride(), *C.stride(), D.stride(0) if D is not None else 0, *z_strides, *M.stride(), *out.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_IDX=idx is not None, STOCHASTIC_ROUND=seed is not None,
        P=headdim, N=dstate, BLOCK_P=block_p, BLOCK_N=dot_dim(dstate),
        BLOCK_T=dot_dim(ntok), BLOCK_H=HISTORY_CHUNK,
        DOT_PRECISION=_dot_precision(x.dtype, "tf32x3"), SPLIT=x.dtype == torch.bfloat16 and not _interpreting(),
        USE_PDL=use_pdl,
        num_warps=num_warps, launch_pdl=use_pdl,
    )
