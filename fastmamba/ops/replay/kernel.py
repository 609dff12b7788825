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
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fastmamba.ops._common.dispatch import inline_asm_ok, interpreter_enabled
from fastmamba.ops._common.jit_math import silu, silu_approx, softplus, stochastic_round
from fastmamba.ops._common.launch import lean
from fastmamba.ops._common.slot_errors import NO_BAD, record
from fastmamba.ops._common.host_math import cdiv, next_power_of_2


@triton.jit
def _slot_history(buf_idx_ptr, hist_ptr, accepted_ptr, slot, capacity):
    """A slot's history: its read buffer (int64, 0 or 1: any other value reads as 1, so a corrupt
    buf_idx never addresses outside the double buffers) and k = hist_len + prev_accepted, clamped
    to [0, capacity] (the tokens to replay)."""
    k = tl.load(hist_ptr + slot).to(tl.int32) + tl.load(accepted_ptr + slot).to(tl.int32)
    rbuf = tl.where(tl.load(buf_idx_ptr + slot) != 0, 1, 0).to(tl.int64)
    return rbuf, tl.minimum(tl.maximum(k, 0), capacity)


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
def _dot_split(a, b, acc, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + a @ b. SPLIT: ``a`` is fp32 and ``b`` holds exact bf16 values (bf16 activations); a
    is split into bf16 hi + lo parts and multiplied on bf16 tensor cores twice: ~16 mantissa bits
    of a (TF32 keeps 10), so the outputs round to the same bf16 values as an fp32 computation
    nearly always, and with half the operand registers of fp32/TF32 operands. Else one dot at
    DOT_PRECISION on fp32 operands."""
    if SPLIT:
        hi = a.to(tl.bfloat16)
        lo = (a - hi.to(tl.float32)).to(tl.bfloat16)
        bb = b.to(tl.bfloat16)
        acc = tl.dot(hi, bb, acc)
        acc = tl.dot(lo, bb, acc)
    else:
        acc = tl.dot(a, b.to(tl.float32), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _dot_split_rhs(a, b, acc, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + a @ b with the roles of ``_dot_split`` swapped: ``a`` exact bf16, ``b`` fp32 split."""
    if SPLIT:
        hi = b.to(tl.bfloat16)
        lo = (b - hi.to(tl.float32)).to(tl.bfloat16)
        aa = a.to(tl.bfloat16)
        acc = tl.dot(aa, hi, acc)
        acc = tl.dot(aa, lo, acc)
    else:
        acc = tl.dot(a.to(tl.float32), b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _history_weights(cum_row, dt_row, offs_c, mc, cum_last, stride_ocs_t, stride_odt_t):
    """The replay weights exp(cA_{k-1} - cA_c) dt'_c of history positions offs_c (0 where not mc)."""
    cum_old = tl.load(cum_row + offs_c * stride_ocs_t, mask=mc, other=0.0)
    dt_old = tl.load(dt_row + offs_c * stride_odt_t, mask=mc, other=0.0)
    return tl.where(mc, tl.exp(cum_last - cum_old) * dt_old, 0.0)


@triton.jit
def _replay_history(
    s, k, cum_last, cum_row, dt_row, x_row, B_hist, offs_p, mp, offs_n, mn,
    stride_ocs_t, stride_odt_t, stride_ox_t, stride_ox_p, stride_oB_t, stride_oB_n,
    BLOCK_H: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """s [BLOCK_P, BLOCK_N] (the stored state tile times exp(cA_{k-1})) plus the k history tokens,
    BLOCK_H per tl.dot:  s + (x_old * exp(cA_{k-1} - cA_c) dt'_c)^T @ B_old."""
    for c0 in range(0, k, BLOCK_H):
        offs_c = c0 + tl.arange(0, BLOCK_H)
        mc = offs_c < k
        w_old = _history_weights(cum_row, dt_row, offs_c, mc, cum_last, stride_ocs_t, stride_odt_t)
        x_old = tl.load(x_row + offs_p[:, None] * stride_ox_p + offs_c[None, :] * stride_ox_t,
                        mask=mp[:, None] & mc[None, :], other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_H]
        B_old = tl.load(B_hist + offs_c[:, None] * stride_oB_t + offs_n[None, :] * stride_oB_n,
                        mask=mc[:, None] & mn[None, :], other=0.0)  # [BLOCK_H, BLOCK_N]
        s = _dot_split(x_old * w_old[None, :], B_old, s, SPLIT, DOT_PRECISION)
    return s


@triton.jit
def _store_state(s, ptrs, mask, slot, h, nheads, offs_p, offs_n, seed_ptr,
                 P: tl.constexpr, N: tl.constexpr, STOCHASTIC_ROUND: tl.constexpr):
    """Store the fp32 tile s in the state's dtype: rounded to nearest, or stochastically with one
    random number per element, distinct across slots, heads and positions."""
    if STOCHASTIC_ROUND:
        elem = ((slot * nheads + h) * P + offs_p[:, None]) * N + offs_n[None, :]
        s_out = stochastic_round(s, tl.rand(tl.load(seed_ptr), elem.to(tl.int32)), ptrs.dtype.element_ty)
    else:
        s_out = s.to(ptrs.dtype.element_ty)
    tl.store(ptrs, s_out, mask=mask)


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


@triton.jit
def _causal_M(M_ptr, sc_row, b, g, T, capacity, offs_t, mt, live, stride_M_b, stride_M_h, stride_M_t, stride_M_s):
    """The split path's M^T [BLOCK_T (s), BLOCK_T (t)] of one (request, head): the group's cb
    (C_t . B_s, which the precompute kernel leaves in M [B, G, T, T]) times exp(cs_t - cs_s) dt'_s
    for s <= t < T, else 0, with the head's cs and dt' from its scale row -- the precompute
    kernel's M, term for term."""
    cb_T = tl.load(M_ptr + b * stride_M_b + g * stride_M_h + offs_t[:, None] * stride_M_s + offs_t[None, :] * stride_M_t,
                   mask=mt[:, None] & mt[None, :] & live, other=0.0)
    cs = tl.load(sc_row + T + 1 + capacity + offs_t, mask=mt & live, other=0.0)
    dt = tl.load(sc_row + 2 * T + 1 + capacity + offs_t, mask=mt & live, other=0.0)
    causal = (offs_t[:, None] <= offs_t[None, :]) & mt[:, None] & mt[None, :]
    decay = tl.exp(tl.where(causal, cs[None, :] - cs[:, None], float("-inf")))
    return cb_T * decay * dt[:, None]


@triton.jit
def _out_outputs(s, x_old, C_T, Q_T, M_T, x_T, zv, e_cs, e_last, u, mc, mt, d_h,
                 HAS_D: tl.constexpr, HAS_Z: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr, STATE_SPLIT: tl.constexpr,
                 STATE_PRECISION: tl.constexpr, FAST_MATH: tl.constexpr):
    """The split path's outputs of one tile, y^T [BLOCK_P, BLOCK_T] fp32 (see _replay_out_kernel):
    s [BLOCK_P, BLOCK_N] stored state; x_old [BLOCK_P, BLOCK_C]; C_T [BLOCK_N, BLOCK_T]; Q_T
    [BLOCK_C, BLOCK_T]; M_T [BLOCK_T, BLOCK_T]; x_T, zv [BLOCK_P, BLOCK_T]; e_cs [BLOCK_T], e_last
    (scalar), u [BLOCK_C] decay factors; mc / mt the live history tokens / tokens; d_h = D[h]."""
    if STATE_SPLIT:
        y = _dot_split(s, C_T, tl.zeros((BLOCK_P, BLOCK_T), dtype=tl.float32), SPLIT, DOT_PRECISION)
    elif STATE_PRECISION == "native":
        # a 16-bit state on 16-bit tensor cores, exact products: bf16 C as is, or (fp16 state) C
        # in fp16, exact for |C| in [2^-14, 65504] (below, a relative error of at most 2^-11 of
        # a subnormal; above, inf -- the outputs show it)
        y = tl.dot(s, C_T.to(s.dtype))
    else:  # a 16-bit state and 16-bit C are exact in TF32 (the interpreter), else as the main kernel
        y = tl.dot(s.to(tl.float32), C_T.to(tl.float32), input_precision=STATE_PRECISION)
    # rows c >= k of Q (garbage) and columns t >= T drop out
    W = tl.where(mc[:, None] & mt[None, :], Q_T, 0.0) * u[:, None]
    y = _dot_split_rhs(x_old, W, y * e_last, SPLIT, DOT_PRECISION)
    y = _dot_split_rhs(x_T, M_T, y * e_cs[None, :], SPLIT, DOT_PRECISION)
    if HAS_D:
        y += x_T.to(tl.float32) * d_h
    if HAS_Z:
        y *= silu_approx(zv.to(tl.float32), FAST_MATH)
    return y


@triton.jit
def _replay_out_kernel(
    state_ptr, old_x_ptr, buf_idx_ptr, accepted_ptr, hist_ptr, kinfo_ptr, scale_ptr,
    x_ptr, C_ptr, D_ptr, z_ptr, M_ptr, Q_ptr, out_ptr, idx_ptr,
    T, capacity, pad_slot_id, n_slots, heads_per_group,
    stride_state_s, stride_state_h, stride_state_p: tl.constexpr, stride_state_n,
    stride_ox_s, stride_ox_t: tl.constexpr, stride_ox_h, stride_ox_p,
    stride_sc_b, stride_sc_h,
    stride_x_b, stride_x_t: tl.constexpr, stride_x_h, stride_x_p,
    stride_C_b, stride_C_t: tl.constexpr, stride_C_g, stride_C_n,
    stride_D_h,
    stride_z_b, stride_z_t: tl.constexpr, stride_z_h, stride_z_p,
    stride_M_b, stride_M_h, stride_M_t: tl.constexpr, stride_M_s,
    stride_Q_b, stride_Q_g, stride_Q_t: tl.constexpr, stride_Q_c,
    stride_out_b, stride_out_t: tl.constexpr, stride_out_h, stride_out_p,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_IDX: tl.constexpr,
    P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr, STATE_SPLIT: tl.constexpr,
    STATE_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr, FAST_MATH: tl.constexpr,
):
    # The split path's output kernel, one program per (block of P, request, head): the T outputs
    # straight from the stored state, without replaying it,
    #   y^T = exp(cs) * (exp(cA_{k-1}) S @ C^T + (x_old * u)^T @ Q^T) + x^T @ M^T + D x^T,  gated,
    # (u_c = dt'_c exp(cA_{k-1} - cA_c), the history's weights; every factor <= 1, so nothing
    # overflows) with the factors, Q (C_t . B_c) and C . B^T per group from the precompute kernel
    # (M built here, _causal_M), then this step's x recorded at positions k.. of the history
    # (slots storing no state this step; the checkpoint kernel, launched after this one, replays
    # and stores the others'). No tl.dot chain through a replayed state: far fewer live registers
    # than the main kernel, and a 16-bit state enters a 16-bit tensor-core dot as it is. Every
    # load is issued before the first dot. The strides between rows of its tiles are compile-time
    # constants (fixed per model: one compile per shape), so the per-row addresses fold into the
    # load instructions' offsets.
    pid_p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    g = h // heads_per_group
    offs_t = tl.arange(0, BLOCK_T)
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_C)
    mt = offs_t < T
    mn = offs_n < N
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mp = offs_p < P
    mask_pt = mp[:, None] & mt[None, :]

    # what the previous steps left (the slot's stored state and history; under PDL read while
    # the precompute kernel still runs: it writes history positions >= k of buffer rbuf or the
    # other buffer, never these), then what this step's earlier kernels wrote
    if HAS_IDX:
        slot = tl.load(idx_ptr + b).to(tl.int64)
    else:
        slot = b
    # padding, or a slot outside [0, S): zero output, no state or cache traffic
    live = (slot != pad_slot_id) & (slot >= 0) & (slot < n_slots)
    if USE_PDL:  # the slot's history length as the precompute kernel reads it
        k = _slot_history(buf_idx_ptr, hist_ptr, accepted_ptr, tl.where(live, slot, 0), capacity)[1]
    else:  # ... as it recorded it (loaded in parallel with the slot index)
        k = tl.load(kinfo_ptr + b, mask=live, other=0)
    mc = (offs_c < k) & live
    s = tl.load(state_ptr + slot * stride_state_s + h * stride_state_h + offs_p[:, None] * stride_state_p
                + offs_n[None, :] * stride_state_n, mask=mp[:, None] & mn[None, :] & live, other=0.0)
    x_row = old_x_ptr + slot * stride_ox_s + h * stride_ox_h
    x_old = tl.load(x_row + offs_p[:, None] * stride_ox_p + offs_c[None, :] * stride_ox_t,
                    mask=mp[:, None] & mc[None, :], other=0.0)  # [BLOCK_P, BLOCK_C]
    if USE_PDL:
        gdc_wait()  # the factors, Q, M (precompute), x, C, z (earlier kernels) from here on
    if LAUNCH_DEPENDENTS:
        # the checkpoint kernel may start (it reads the precompute kernel's list, complete by now,
        # and waits for this kernel before it writes)
        gdc_launch_dependents()
    sc_row = scale_ptr + b * stride_sc_b + h * stride_sc_h
    e_cs = tl.load(sc_row + offs_t, mask=mt & live, other=0.0)  # exp(cs_t)
    e_last = tl.load(sc_row + T, mask=live, other=0.0)  # exp(cA_{k-1})
    u = tl.load(sc_row + T + 1 + offs_c, mask=mc, other=0.0)  # [BLOCK_C]
    C_T = tl.load(C_ptr + b * stride_C_b + g * stride_C_g + offs_n[:, None] * stride_C_n + offs_t[None, :] * stride_C_t,
                  mask=mn[:, None] & mt[None, :], other=0.0)  # [BLOCK_N, BLOCK_T]
    Q_T = tl.load(Q_ptr + b * stride_Q_b + g * stride_Q_g + offs_c[:, None] * stride_Q_c + offs_t[None, :] * stride_Q_t,
                  mask=(offs_c < capacity)[:, None] & mt[None, :] & live, other=0.0)  # [c, t]; rows c >= k: garbage, masked below
    M_T = _causal_M(M_ptr, sc_row, b, g, T, capacity, offs_t, mt, live,
                    stride_M_b, stride_M_h, stride_M_t, stride_M_s)  # [s, t]
    x_T = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + offs_p[:, None] * stride_x_p + offs_t[None, :] * stride_x_t,
                  mask=mask_pt, other=0.0)  # [BLOCK_P, BLOCK_T]
    if HAS_Z:
        zv = tl.load(z_ptr + b * stride_z_b + h * stride_z_h + offs_p[:, None] * stride_z_p + offs_t[None, :] * stride_z_t,
                     mask=mask_pt, other=0.0)

    d_h = tl.load(D_ptr + h * stride_D_h).to(tl.float32) if HAS_D else 0.0
    y = _out_outputs(s, x_old, C_T, Q_T, M_T, x_T, zv if HAS_Z else x_T, e_cs, e_last, u, mc, mt, d_h,
                     HAS_D, HAS_Z, BLOCK_P, BLOCK_T, DOT_PRECISION, SPLIT, STATE_SPLIT, STATE_PRECISION, FAST_MATH)
    y = tl.where(live, y, 0.0)
    tl.store(out_ptr + b * stride_out_b + h * stride_out_h + offs_p[:, None] * stride_out_p
             + offs_t[None, :] * stride_out_t, y.to(out_ptr.dtype.element_ty), mask=mask_pt)
    # record this step's x at positions k.. (the history above read positions < k only); at a
    # checkpoint (k + T > C_h) the checkpoint kernel records it, after replaying the history it
    # overwrites
    tl.store(x_row + offs_p[:, None] * stride_ox_p + (k + offs_t)[None, :] * stride_ox_t,
             x_T.to(old_x_ptr.dtype.element_ty), mask=mask_pt & live & (k + T <= capacity))


@triton.jit
def persistent_tile(tile, nheads, heads_per_group, P: tl.constexpr, BLOCK_P: tl.constexpr):
    """A persistent loop's tile index over (request, head, block of P) -> request b and head h
    (int64), group g, the block's first row p0 and its rows offs_p [BLOCK_P]."""
    p_blocks: tl.constexpr = P // BLOCK_P
    p0 = (tile % p_blocks) * BLOCK_P
    bh = tile // p_blocks
    b = (bh // nheads).to(tl.int64)
    h = (bh % nheads).to(tl.int64)
    return b, h, h // heads_per_group, p0, p0 + tl.arange(0, BLOCK_P)


@triton.jit
def _replay_out_tma_kernel(
    state_desc, old_x_desc, x_desc, z_desc, C_desc,
    old_x_ptr, kinfo_ptr, scale_ptr, D_ptr, M_ptr, Q_ptr, out_ptr, idx_ptr,
    T, capacity, pad_slot_id, n_slots, heads_per_group, nheads, n_tiles,
    stride_ox_s, stride_ox_t: tl.constexpr, stride_ox_h, stride_ox_p: tl.constexpr,
    stride_sc_b, stride_sc_h,
    stride_D_h,
    stride_M_b, stride_M_h, stride_M_t: tl.constexpr, stride_M_s,
    stride_Q_b, stride_Q_g, stride_Q_t: tl.constexpr, stride_Q_c,
    stride_out_b, stride_out_t: tl.constexpr, stride_out_h, stride_out_p: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_IDX: tl.constexpr,
    P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr, STATE_SPLIT: tl.constexpr,
    STATE_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr, FAST_MATH: tl.constexpr,
    STAGES: tl.constexpr,
):
    # The output kernel of _replay_out_kernel as a persistent loop over its (request, head, block
    # of P) tiles whose tiles arrive by TMA (tensor descriptors over 2-d views of contiguous
    # tensors: the state [S*H*P, N], the history x [S*C_h, H*P], x and z [B*T, H*P], C [B*T, G*N]),
    # so that Triton's pipeliner prefetches the next tile's state into shared memory while this
    # one computes, without a register per address. Rows past a tile's own (tokens t >= T of the
    # next request, history tokens c >= k) land only in output columns that are not stored or are
    # multiplied by zeros (W, M); a pad slot reads slot 0 and its outputs are zeroed. The history
    # length comes from the precompute kernel (kinfo): launched after it, or (USE_PDL) read after
    # the grid-dependency wait. TMA coordinates are int32: out_tma_usable checks the row counts.
    offs_t = tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, BLOCK_C)
    mt = offs_t < T
    if USE_PDL:
        gdc_wait()  # everything below comes from the precompute kernel or earlier ones
    if LAUNCH_DEPENDENTS:
        # now, not as the programs exit: the checkpoint kernel's programs then take each SM's place
        # as soon as its last output program leaves (it reads the precompute kernel's list and
        # waits for this kernel before it writes)
        gdc_launch_dependents()
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        b, h, g, p0, offs_p = persistent_tile(tile, nheads, heads_per_group, P, BLOCK_P)
        if HAS_IDX:
            slot = tl.load(idx_ptr + b).to(tl.int64)
        else:
            slot = b
        live = (slot != pad_slot_id) & (slot >= 0) & (slot < n_slots)  # outside [0, S): as the pad slot
        row = tl.where(live, slot, 0)
        k = tl.load(kinfo_ptr + b, mask=live, other=0)
        mc = (offs_c < k) & live
        s = state_desc.load([((row * nheads + h) * P + p0).to(tl.int32), 0])
        col = (h * P + p0).to(tl.int32)
        x_old = tl.trans(old_x_desc.load([(row * capacity).to(tl.int32), col]))
        x_T = tl.trans(x_desc.load([(b * T).to(tl.int32), col]))
        zv = x_T
        if HAS_Z:
            zv = tl.trans(z_desc.load([(b * T).to(tl.int32), col]))
        C_T = tl.trans(C_desc.load([(b * T).to(tl.int32), (g * N).to(tl.int32)]))
        sc_row = scale_ptr + b * stride_sc_b + h * stride_sc_h
        e_cs = tl.load(sc_row + offs_t, mask=mt & live, other=0.0)
        e_last = tl.load(sc_row + T, mask=live, other=0.0)
        u = tl.load(sc_row + T + 1 + offs_c, mask=mc, other=0.0)
        Q_T = tl.load(Q_ptr + b * stride_Q_b + g * stride_Q_g + offs_c[:, None] * stride_Q_c + offs_t[None, :] * stride_Q_t,
                      mask=(offs_c < capacity)[:, None] & mt[None, :] & live, other=0.0)
        M_T = tl.load(M_ptr + b * stride_M_b + h * stride_M_h + offs_t[:, None] * stride_M_s + offs_t[None, :] * stride_M_t,
                      mask=mt[:, None] & mt[None, :] & live, other=0.0)
        d_h = tl.load(D_ptr + h * stride_D_h).to(tl.float32) if HAS_D else 0.0
        y = _out_outputs(s, tl.where(mc[None, :], x_old, 0.0), C_T, Q_T, M_T, x_T, zv, e_cs, e_last, u, mc, mt,
                         d_h, HAS_D, HAS_Z, BLOCK_P, BLOCK_T, DOT_PRECISION, SPLIT, STATE_SPLIT, STATE_PRECISION,
                         FAST_MATH)
        y = tl.where(live, y, 0.0)
        mask_pt = (offs_p < P)[:, None] & mt[None, :]
        tl.store(out_ptr + b * stride_out_b + h * stride_out_h + offs_p[:, None] * stride_out_p
                 + offs_t[None, :] * stride_out_t, y.to(out_ptr.dtype.element_ty), mask=mask_pt)
        x_row = old_x_ptr + slot * stride_ox_s + h * stride_ox_h
        tl.store(x_row + offs_p[:, None] * stride_ox_p + (k + offs_t)[None, :] * stride_ox_t,
                 x_T.to(old_x_ptr.dtype.element_ty), mask=mask_pt & live & (k + T <= capacity))


@triton.jit
def _checkpoint_record(ckpt_list_ptr, tile, n_tiles, per_request, p_blocks: tl.constexpr):
    """Tile ``tile`` of the checkpoint kernel's list: (request, slot, k, rbuf, head, block of P);
    zeros past the list (``tile >= n_tiles``)."""
    live = tile < n_tiles
    rec = ckpt_list_ptr + 4 * (tile // per_request)
    b = tl.load(rec, mask=live, other=0).to(tl.int64)
    slot = tl.load(rec + 1, mask=live, other=0).to(tl.int64)
    k = tl.load(rec + 2, mask=live, other=0)
    rbuf = tl.load(rec + 3, mask=live, other=0).to(tl.int64)
    h = ((tile % per_request) // p_blocks).to(tl.int64)
    return b, slot, k, rbuf, h, tile % p_blocks


@triton.jit
def _replay_checkpoint_kernel(
    state_ptr, old_x_ptr, old_B_ptr, old_dt_ptr, old_cumA_ptr,
    x_ptr, seed_ptr, ckpt_count_ptr, ckpt_list_ptr,
    T, heads_per_group, nheads,
    stride_state_s, stride_state_h, stride_state_p, stride_state_n,
    stride_ox_s, stride_ox_t, stride_ox_h, stride_ox_p,
    stride_oB_r, stride_oB_s, stride_oB_t, stride_oB_g, stride_oB_n,
    stride_odt_r, stride_odt_s, stride_odt_t, stride_odt_h,
    stride_ocs_r, stride_ocs_s, stride_ocs_t, stride_ocs_h,
    stride_x_b, stride_x_t, stride_x_h, stride_x_p,
    STOCHASTIC_ROUND: tl.constexpr,
    P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr, USE_PDL: tl.constexpr,
):
    # The split path's checkpoint kernel, after the output kernel: a persistent grid walks the
    # (request, head, block of P) tiles of the requests that store their state this step, listed by
    # the precompute kernel (in any order, one record [request, slot, k, rbuf] each): replay the
    # history onto the stored state, store it, and record this step's x at positions 0.. of the
    # new history. Software-pipelined: each iteration issues the next tile's state load before it
    # replays its own.
    # Under PDL (launched as the output kernel's dependent) everything before the stores overlaps
    # the output kernel's last programs: it reads only what that kernel leaves alone (the stored
    # states, history positions < k of checkpointing slots, the precompute kernel's list).
    p_blocks: tl.constexpr = (P + BLOCK_P - 1) // BLOCK_P
    per_request = nheads * p_blocks
    n_tiles = tl.load(ckpt_count_ptr) * per_request
    offs_n = tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_T)
    mn = offs_n < N
    mt = offs_t < T
    nprog = tl.num_programs(0)
    b, slot, k, rbuf, h, pb = _checkpoint_record(ckpt_list_ptr, tl.program_id(0), n_tiles, per_request, p_blocks)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    s_next = tl.load(state_ptr + slot * stride_state_s + h * stride_state_h + offs_p[:, None] * stride_state_p
                     + offs_n[None, :] * stride_state_n,
                     mask=(offs_p[:, None] < P) & mn[None, :] & (tl.program_id(0) < n_tiles), other=0.0)
    for tile in range(tl.program_id(0), n_tiles, nprog):
        s_raw = s_next
        offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        mp = offs_p < P
        tile_mask = mp[:, None] & mn[None, :]
        # the next tile's record and state, in flight while this one replays
        nb, nslot, nk, nrbuf, nh, npb = _checkpoint_record(ckpt_list_ptr, tile + nprog, n_tiles, per_request, p_blocks)
        noffs_p = npb * BLOCK_P + tl.arange(0, BLOCK_P)
        s_next = tl.load(state_ptr + nslot * stride_state_s + nh * stride_state_h + noffs_p[:, None] * stride_state_p
                         + offs_n[None, :] * stride_state_n,
                         mask=(noffs_p[:, None] < P) & mn[None, :] & (tile + nprog < n_tiles), other=0.0)
        mask_pt = mp[:, None] & mt[None, :]
        x_T = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + offs_p[:, None] * stride_x_p + offs_t[None, :] * stride_x_t,
                      mask=mask_pt, other=0.0)

        cum_row = old_cumA_ptr + rbuf * stride_ocs_r + slot * stride_ocs_s + h * stride_ocs_h
        x_row = old_x_ptr + slot * stride_ox_s + h * stride_ox_h
        cum_last = tl.load(cum_row + (k - 1) * stride_ocs_t, mask=k > 0, other=0.0)
        s = s_raw.to(tl.float32) * tl.exp(cum_last)
        s = _replay_history(s, k, cum_last, cum_row,
                            old_dt_ptr + rbuf * stride_odt_r + slot * stride_odt_s + h * stride_odt_h, x_row,
                            old_B_ptr + rbuf * stride_oB_r + slot * stride_oB_s + (h // heads_per_group) * stride_oB_g,
                            offs_p, mp, offs_n, mn, stride_ocs_t, stride_odt_t, stride_ox_t, stride_ox_p,
                            stride_oB_t, stride_oB_n, BLOCK_H, SPLIT, DOT_PRECISION)
        if USE_PDL:
            gdc_wait()  # the output kernel has read every state and history it needs
        state_ptrs = (state_ptr + slot * stride_state_s + h * stride_state_h + offs_p[:, None] * stride_state_p
                      + offs_n[None, :] * stride_state_n)
        _store_state(s, state_ptrs, tile_mask, slot, h, nheads, offs_p, offs_n, seed_ptr, P, N, STOCHASTIC_ROUND)
        # every thread has read its old x (the replay, possibly in another thread layout) before
        # any thread overwrites positions 0..T-1
        tl.debug_barrier()
        tl.store(x_row + offs_p[:, None] * stride_ox_p + offs_t[None, :] * stride_ox_t,
                 x_T.to(old_x_ptr.dtype.element_ty), mask=mask_pt)
        b, slot, k, rbuf, h, pb = nb, nslot, nk, nrbuf, nh, npb


@triton.jit
def _replay_checkpoint_tma_kernel(
    state_desc, old_x_desc, old_B_desc, x_desc,
    state_ptr, old_x_ptr, old_dt_ptr, old_cumA_ptr, seed_ptr, ckpt_count_ptr, ckpt_list_ptr,
    T, heads_per_group, nheads, capacity, n_slots,
    stride_state_s, stride_state_h, stride_state_p: tl.constexpr, stride_state_n: tl.constexpr,
    stride_ox_s, stride_ox_t: tl.constexpr, stride_ox_h, stride_ox_p: tl.constexpr,
    stride_odt_r, stride_odt_s, stride_odt_t: tl.constexpr, stride_odt_h: tl.constexpr,
    stride_ocs_r, stride_ocs_s, stride_ocs_t: tl.constexpr, stride_ocs_h: tl.constexpr,
    STOCHASTIC_ROUND: tl.constexpr,
    P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr, USE_PDL: tl.constexpr, STAGES: tl.constexpr,
):
    # _replay_checkpoint_kernel as a persistent loop whose tiles arrive by TMA (tensor descriptors
    # over 2-d views of contiguous tensors: the state [S*H*P, N], the history x [S*C_h, H*P], the
    # history B [2*S*C_h, G*N], x [B*T, H*P]), so that the pipeliner prefetches the next tile's
    # state and whole history into shared memory while this one replays. The history is one
    # tl.dot over all C_h positions, rows c >= k zeroed on both operands (whatever they hold).
    p_blocks: tl.constexpr = P // BLOCK_P
    per_request = nheads * p_blocks
    n_tiles = tl.load(ckpt_count_ptr) * per_request
    offs_c = tl.arange(0, BLOCK_C)
    offs_n = tl.arange(0, N)
    offs_t = tl.arange(0, BLOCK_T)
    mt = offs_t < T
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        b, slot, k, rbuf, h, pb = _checkpoint_record(ckpt_list_ptr, tile, n_tiles, per_request, p_blocks)
        g = h // heads_per_group
        p0 = pb * BLOCK_P
        offs_p = p0 + tl.arange(0, BLOCK_P)
        col = (h * P + p0).to(tl.int32)
        s_raw = state_desc.load([((slot * nheads + h) * P + p0).to(tl.int32), 0])
        x_old = tl.trans(old_x_desc.load([(slot * capacity).to(tl.int32), col]))  # [BLOCK_P, BLOCK_C]
        B_old = old_B_desc.load([((rbuf * n_slots + slot) * capacity).to(tl.int32), (g * N).to(tl.int32)])
        x_T = tl.trans(x_desc.load([(b * T).to(tl.int32), col]))  # [BLOCK_P, BLOCK_T]
        mc = offs_c < k
        cum_row = old_cumA_ptr + rbuf * stride_ocs_r + slot * stride_ocs_s + h * stride_ocs_h
        cum_last = tl.load(cum_row + (k - 1) * stride_ocs_t, mask=k > 0, other=0.0)
        w = _history_weights(cum_row, old_dt_ptr + rbuf * stride_odt_r + slot * stride_odt_s + h * stride_odt_h,
                             offs_c, mc, cum_last, stride_ocs_t, stride_odt_t)
        a = tl.where(mc[None, :], x_old.to(tl.float32) * w[None, :], 0.0)
        s = s_raw.to(tl.float32) * tl.exp(cum_last)
        s = _dot_split(a, tl.where(mc[:, None], B_old, tl.zeros_like(B_old)), s, SPLIT, DOT_PRECISION)
        if USE_PDL:
            gdc_wait()  # the output kernel has read every state and history it needs
        state_ptrs = (state_ptr + slot * stride_state_s + h * stride_state_h + offs_p[:, None] * stride_state_p
                      + offs_n[None, :] * stride_state_n)
        _store_state(s, state_ptrs, (offs_p < P)[:, None] & (offs_n < N)[None, :], slot, h, nheads, offs_p, offs_n,
                     seed_ptr, P, N, STOCHASTIC_ROUND)
        # this tile's history arrived by TMA and was consumed above; positions 0..T-1 of it now
        # take this step's x (a new history)
        tl.store(old_x_ptr + slot * stride_ox_s + h * stride_ox_h + offs_p[:, None] * stride_ox_p
                 + offs_t[None, :] * stride_ox_t, x_T.to(old_x_ptr.dtype.element_ty),
                 mask=(offs_p < P)[:, None] & mt[None, :])


HISTORY_CHUNK = 16  # history tokens per replay tl.dot (its K dimension)
# On the GPU the output kernel takes a 16-bit state's C.S on 16-bit tensor cores, and the precompute
# kernel's C B^T and C B_hist^T are 16-bit dots on 16-bit operands (NATIVE16 there); the interpreter
# runs them as TF32 / fp32 dots. Measured against TF32 everywhere: docs/experiments.md (dev_replay_variants).


def dot_dim(n: int) -> int:
    """A block size for a dimension of n that tl.dot takes: a power of two, at least 16."""
    return max(16, next_power_of_2(n))


def _interpreting() -> bool:
    """The Triton CPU interpreter computes bf16 tl.dot wrongly (Triton 3.6): there the split bf16
    dots are replaced by the TF32 path on fp32 operands (the GPU tests cover the split)."""
    return interpreter_enabled()


def _dot_precision(dtype: torch.dtype, fp32: str) -> str:
    """16-bit activations: TF32 on fp32 operands (the 16-bit inputs are exact in TF32; the dt and
    decay weights keep 10 mantissa bits instead of 7). fp32 activations: ``fp32`` -- "ieee" where
    the FMA lowering is cheap (the precompute's small C B^T), "tf32x3" in the main kernel, whose
    "ieee" FMA dots spill at every tile size on sm_90 while tf32x3 is near-fp32 on tensor cores."""
    return fp32 if dtype == torch.float32 else "tf32"


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


def launch_replay_out(
    state, old_x, buf_idx, prev_accepted, hist_len, kinfo, scale, x, C, D, z, M, Q, out, idx, *,
    pad_slot_id: int, block_p: int, num_warps: int, maxnreg: int | None = None, use_pdl: bool = False,
    launch_dependents: bool = False,
):
    """The split path's output kernel: shapes as ``launch_replay_main``, except M (B,G,T,T); M, Q
    (B,G,T,C_h), scale (B,H,3T+1+C_h) and (unless ``use_pdl``) kinfo (B,) from the precompute
    kernel launched just before it (``use_pdl``: a programmatic dependent of it, which then must
    trigger its dependents)."""
    nreq, ntok, nheads, headdim = x.shape
    ngroups, dstate = C.shape[2], C.shape[3]
    grid = (cdiv(headdim, block_p), nreq, nheads)
    z_strides = tuple(z.stride()) if z is not None else (0, 0, 0, 0)
    split = x.dtype == torch.bfloat16 and not _interpreting()
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    sixteen_bit = state.dtype != torch.float32 and x.dtype != torch.float32
    lean(_replay_out_kernel)[grid](
        state, old_x, buf_idx, prev_accepted, hist_len, kinfo, scale, x, C, D, z, M, Q, out, idx,
        ntok, old_x.shape[1], pad_slot_id, state.shape[0], nheads // ngroups,
        *state.stride(), *old_x.stride(), *scale.stride()[:2], *x.stride(), *C.stride(),
        D.stride(0) if D is not None else 0, *z_strides, *M.stride(), *Q.stride(), *out.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_IDX=idx is not None,
        P=headdim, N=dstate, BLOCK_P=block_p, BLOCK_N=dot_dim(dstate),
        BLOCK_T=dot_dim(ntok), BLOCK_C=dot_dim(old_x.shape[1]),
        DOT_PRECISION=_dot_precision(x.dtype, "tf32x3"), SPLIT=split, STATE_SPLIT=split and state.dtype == torch.float32,
        STATE_PRECISION=(("tf32" if _interpreting() else "native") if sixteen_bit
                         else _dot_precision(x.dtype, "tf32x3")),
        USE_PDL=use_pdl, LAUNCH_DEPENDENTS=launch_dependents, FAST_MATH=inline_asm_ok(x),
        num_warps=num_warps, launch_pdl=use_pdl, **extra,
    )


def _tma_views_ok(tensors, x, N: int, block_p: int, rows: int) -> bool:
    """What both TMA kernels need: a CUDA device with TMA (sm_90+, not the interpreter), contiguous
    ``tensors`` at 16-byte-aligned addresses (their 2-d descriptor views), N a power of two, the head
    dim P of x a multiple of the P tile, and ``rows`` (the tallest view) within TMA's int32 coordinates."""
    if _interpreting() or not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors):
        return False
    return N == next_power_of_2(N) and x.shape[3] % block_p == 0 and rows < 2**31


def out_tma_usable(state, old_x, x, z, C, block_p: int) -> bool:
    """Whether ``launch_replay_out_tma`` can take this call: an fp32 state with bf16 activations
    (the split dots), a history of at most 256 positions, and ``_tma_views_ok``."""
    if state.dtype != torch.float32 or x.dtype != torch.bfloat16 or C.dtype != torch.bfloat16:
        return False
    if z is not None and z.dtype != x.dtype:
        return False
    N = C.shape[3]
    rows = max(state.numel() // N, old_x.shape[0] * old_x.shape[1], x.shape[0] * x.shape[1])
    tensors = [state, old_x, x, C] + ([z] if z is not None else [])
    return old_x.shape[1] <= 256 and _tma_views_ok(tensors, x, N, block_p, rows)


def _view_desc(t, cols: int, block: list[int]):
    """A TMA descriptor over the contiguous t seen as a 2-d [numel / cols, cols] tensor, in blocks
    of ``block`` [rows, columns]: the TMA kernels' view of every tiled operand."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t.view(-1, cols), block)


def launch_replay_out_tma(
    state, old_x, kinfo, scale, x, C, D, z, M, Q, out, idx, *,
    pad_slot_id: int, block_p: int, num_warps: int, programs: int, stages: int, maxnreg: int | None = None,
    use_pdl: bool = False, launch_dependents: bool = False,
):
    """The split path's output kernel as ``_replay_out_tma_kernel`` on ``programs`` programs
    (``out_tma_usable`` must hold); arguments as ``launch_replay_out``, except M per head
    (B,H,T,T) and scale (B,H,T+1+C_h), kinfo required."""
    nreq, ntok, nheads, headdim = x.shape
    ngroups, dstate = C.shape[2], C.shape[3]
    capacity = old_x.shape[1]
    block_t = dot_dim(ntok)
    block_c = dot_dim(capacity)
    n_tiles = headdim // block_p * nreq * nheads
    hp = nheads * headdim
    state_desc = _view_desc(state, dstate, [block_p, dstate])
    old_x_desc = _view_desc(old_x, hp, [block_c, block_p])
    x_desc = _view_desc(x, hp, [block_t, block_p])
    z_desc = _view_desc(z, hp, [block_t, block_p]) if z is not None else None
    C_desc = _view_desc(C, ngroups * dstate, [block_t, dstate])
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    lean(_replay_out_tma_kernel)[(max(1, min(programs, n_tiles)),)](
        state_desc, old_x_desc, x_desc, z_desc, C_desc,
        old_x, kinfo, scale, D, M, Q, out, idx,
        ntok, capacity, pad_slot_id, state.shape[0], nheads // ngroups, nheads, n_tiles,
        old_x.stride(0), old_x.stride(1), old_x.stride(2), old_x.stride(3), *scale.stride()[:2],
        D.stride(0) if D is not None else 0, *M.stride(), *Q.stride(), *out.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_IDX=idx is not None,
        P=headdim, N=dstate, BLOCK_P=block_p, BLOCK_N=dstate, BLOCK_T=block_t, BLOCK_C=block_c,
        DOT_PRECISION="tf32", SPLIT=True, STATE_SPLIT=True, STATE_PRECISION="tf32",
        USE_PDL=use_pdl, LAUNCH_DEPENDENTS=launch_dependents, FAST_MATH=inline_asm_ok(x), STAGES=stages,
        num_warps=num_warps, launch_pdl=use_pdl, **extra,
    )


def launch_replay_checkpoint(
    state, old_x, old_B, old_dt, old_cumA, x, seed, ckpt_count, ckpt_list, *, block_p: int, num_warps: int, programs: int,
    use_pdl: bool = False,
):
    """The split path's checkpoint kernel on a persistent grid of ``programs`` programs: the
    requests listed in ckpt_list[:ckpt_count] ((B, 4) int32 records [request, slot, k, rbuf], from
    the precompute kernel). Shapes as ``launch_replay_main``."""
    nreq, ntok, nheads, headdim = x.shape
    ngroups, dstate = old_B.shape[3], old_B.shape[4]
    lean(_replay_checkpoint_kernel)[(programs,)](
        state, old_x, old_B, old_dt, old_cumA, x, seed, ckpt_count, ckpt_list,
        ntok, nheads // ngroups, nheads,
        *state.stride(), *old_x.stride(), *old_B.stride(), *old_dt.stride(), *old_cumA.stride(), *x.stride(),
        STOCHASTIC_ROUND=seed is not None,
        P=headdim, N=dstate, BLOCK_P=block_p, BLOCK_N=dot_dim(dstate),
        BLOCK_T=dot_dim(ntok), BLOCK_H=HISTORY_CHUNK,
        DOT_PRECISION=_dot_precision(x.dtype, "tf32x3"), SPLIT=x.dtype == torch.bfloat16 and not _interpreting(),
        USE_PDL=use_pdl, num_warps=num_warps, launch_pdl=use_pdl,
    )


def checkpoint_tma_usable(state, old_x, old_B, x, block_p: int) -> bool:
    """Whether ``launch_replay_checkpoint_tma`` can take this call: bf16 activations, a history of
    at most 64 positions (the whole history is one tile in shared memory and registers; the default
    history is 64 at T=16), and ``_tma_views_ok``."""
    if x.dtype != torch.bfloat16 or old_x.dtype != x.dtype or old_B.dtype != x.dtype:
        return False
    N = old_B.shape[4]
    rows = max(state.numel() // N, old_x.shape[0] * old_x.shape[1], old_B.numel() // (old_B.shape[3] * N))
    return old_x.shape[1] <= 64 and _tma_views_ok((state, old_x, old_B, x), x, N, block_p, rows)


def launch_replay_checkpoint_tma(
    state, old_x, old_B, old_dt, old_cumA, x, seed, ckpt_count, ckpt_list, *, block_p: int, num_warps: int,
    programs: int, stages: int, maxnreg: int | None = None, use_pdl: bool = False,
):
    """``launch_replay_checkpoint`` as ``_replay_checkpoint_tma_kernel`` (``checkpoint_tma_usable``
    must hold): ``programs`` persistent programs, ``stages`` pipeline stages."""
    nreq, ntok, nheads, headdim = x.shape
    ngroups, dstate = old_B.shape[3], old_B.shape[4]
    capacity = old_x.shape[1]
    block_t = dot_dim(ntok)
    block_c = dot_dim(capacity)
    lean(_replay_checkpoint_tma_kernel)[(max(1, programs),)](
        _view_desc(state, dstate, [block_p, dstate]),
        _view_desc(old_x, nheads * headdim, [block_c, block_p]),
        _view_desc(old_B, ngroups * dstate, [block_c, dstate]),
        _view_desc(x, nheads * headdim, [block_t, block_p]),
        state, old_x, old_dt, old_cumA, seed, ckpt_count, ckpt_list,
        ntok, nheads // ngroups, nheads, capacity, old_x.shape[0],
        *state.stride(), *old_x.stride(), *old_dt.stride(), *old_cumA.stride(),
        STOCHASTIC_ROUND=seed is not None,
        P=headdim, N=dstate, BLOCK_P=block_p, BLOCK_T=block_t, BLOCK_C=block_c,
        DOT_PRECISION="tf32x3", SPLIT=True, USE_PDL=use_pdl, STAGES=stages,
        num_warps=num_warps, launch_pdl=use_pdl, **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )


@triton.jit
def _commit_kernel(
    buf_idx_ptr, accepted_ptr, hist_ptr, slots_ptr, new_ptr, err_ptr,
    nreq, T, capacity, pad_slot_id, n_slots,
    HAS_SLOTS: tl.constexpr, BLOCK: tl.constexpr, REPORT: tl.constexpr = False, CHECK_NEW: tl.constexpr = False,
):
    # the bookkeeping after a call (see ref.commit_accepted_ref); one element per request
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mb = b < nreq
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + b, mask=mb, other=pad_slot_id).to(tl.int64)
    else:
        slot = b.to(tl.int64)
    live = mb & (slot != pad_slot_id) & (slot >= 0) & (slot < n_slots)  # outside [0, S): as the pad slot
    if REPORT:  # eager calls (slot_errors.py): record the first bad slot / accepted count, skip its row
        bad_slot = mb & (slot != pad_slot_id) & ((slot < 0) | (slot >= n_slots))
        at = tl.min(tl.where(bad_slot, b.to(tl.int64), NO_BAD), 0)
        if at < NO_BAD:
            record(err_ptr, 1, tl.sum(tl.where(b == at, slot, 0), 0), n_slots, at)
        if CHECK_NEW:
            n = tl.load(new_ptr + b, mask=live, other=0).to(tl.int64)
            bad_new = live & ((n < 0) | (n > T))
            at = tl.min(tl.where(bad_new, b.to(tl.int64), NO_BAD), 0)
            if at < NO_BAD:
                record(err_ptr, 2, tl.sum(tl.where(b == at, n, 0), 0), T, at)
            live = live & (bad_new == 0)
    k = tl.load(hist_ptr + slot, mask=live, other=0) + tl.load(accepted_ptr + slot, mask=live, other=0)
    checkpoint = k + T > capacity
    r = tl.load(buf_idx_ptr + slot, mask=live, other=0)
    tl.store(buf_idx_ptr + slot, tl.where(checkpoint, 1 - r, r).to(buf_idx_ptr.dtype.element_ty), mask=live)
    tl.store(hist_ptr + slot, tl.where(checkpoint, 0, k).to(hist_ptr.dtype.element_ty), mask=live)
    tl.store(accepted_ptr + slot, tl.load(new_ptr + b, mask=live, other=0).to(accepted_ptr.dtype.element_ty), mask=live)


def launch_commit(buf_idx, prev_accepted, hist_len, slots, accepted, *, tokens: int, history: int, pad_slot_id: int,
                  err=None, check_accepted: bool = False):
    """buf_idx, prev_accepted, hist_len (S,) int32/int64 (one dtype); slots (B,) or None; accepted (B,).
    ``err``: the op's slot-error record (slot_errors.py): bad slots (and, with ``check_accepted``,
    accepted counts outside [0, T]) are recorded there and their rows skipped."""
    nreq = accepted.shape[0]
    block = 128
    lean(_commit_kernel)[(cdiv(nreq, block),)](
        buf_idx, prev_accepted, hist_len, slots, accepted, err, nreq, tokens, history, pad_slot_id, buf_idx.shape[0],
        HAS_SLOTS=slots is not None, BLOCK=block, REPORT=err is not None, CHECK_NEW=err is not None and check_accepted,
        num_warps=1,
    )


@triton.jit
def _flush_kernel(
    state_ptr, old_x_ptr, old_B_ptr, old_dt_ptr, old_cumA_ptr, buf_idx_ptr, accepted_ptr, hist_ptr, slots_ptr,
    n_slots, pad_slot_id, capacity, heads_per_group, P, N,
    stride_s_s, stride_s_h, stride_s_p, stride_s_n,
    stride_ox_s, stride_ox_t, stride_ox_h, stride_ox_p,
    stride_oB_r, stride_oB_s, stride_oB_t, stride_oB_g, stride_oB_n,
    stride_odt_r, stride_odt_s, stride_odt_t, stride_odt_h,
    stride_ocs_r, stride_ocs_s, stride_ocs_t, stride_ocs_h,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # one program per (listed slot, head, block of P): the stored state tile with the slot's k
    # history tokens replayed (see ref.flush_ref), written back in the state's dtype (rounded to nearest)
    b = tl.program_id(0)
    h = tl.program_id(1)
    pid_p = tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    if (slot != pad_slot_id) & (slot >= 0) & (slot < n_slots):  # outside [0, S): as the pad slot
        rbuf, k = _slot_history(buf_idx_ptr, hist_ptr, accepted_ptr, slot, capacity)
        g = h // heads_per_group
        offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        mp = offs_p < P
        mn = offs_n < N
        cum_row = old_cumA_ptr + rbuf * stride_ocs_r + slot * stride_ocs_s + h * stride_ocs_h
        dt_row = old_dt_ptr + rbuf * stride_odt_r + slot * stride_odt_s + h * stride_odt_h
        x_row = old_x_ptr + slot * stride_ox_s + h * stride_ox_h
        B_hist = old_B_ptr + rbuf * stride_oB_r + slot * stride_oB_s + g * stride_oB_g
        cum_last = tl.load(cum_row + tl.maximum(k - 1, 0) * stride_ocs_t, mask=k > 0, other=0.0)
        ptrs = state_ptr + slot * stride_s_s + h * stride_s_h + offs_p[:, None] * stride_s_p + offs_n[None, :] * stride_s_n
        mask = mp[:, None] & mn[None, :]
        s = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * tl.exp(cum_last)
        s = _replay_history(s, k, cum_last, cum_row, dt_row, x_row, B_hist, offs_p, mp, offs_n, mn,
                            stride_ocs_t, stride_odt_t, stride_ox_t, stride_ox_p, stride_oB_t, stride_oB_n,
                            BLOCK_H, SPLIT, DOT_PRECISION)
        tl.store(ptrs, s.to(state_ptr.dtype.element_ty), mask=mask)


def launch_flush(state, old_x, old_B, old_dt, old_cumA, buf_idx, prev_accepted, hist_len, slots, *,
                 pad_slot_id: int) -> None:
    """One launch for the listed slots of one layer's replay cache (checked by the caller): state
    [S, H, P, N], old_x [S, C_h, H, P], old_B [2, S, C_h, G, N], old_dt / old_cumA [2, S, C_h, H];
    slots [B]. The counters are read, not reset."""
    S, H, P, N = state.shape
    G = old_B.shape[3]
    block_p = min(dot_dim(P), 32)
    lean(_flush_kernel)[(slots.shape[0], H, cdiv(P, block_p))](
        state, old_x, old_B, old_dt, old_cumA, buf_idx, prev_accepted, hist_len, slots,
        S, pad_slot_id, old_x.shape[1], H // G, P, N,
        *state.stride(), *old_x.stride(), *old_B.stride(), *old_dt.stride(), *old_cumA.stride(),
        BLOCK_P=block_p, BLOCK_N=dot_dim(N), BLOCK_H=HISTORY_CHUNK,
        SPLIT=old_x.dtype == torch.bfloat16 and not _interpreting(), DOT_PRECISION=_dot_precision(old_x.dtype, "ieee"),
        num_warps=4,
    )


@triton.jit
def _reset_history_kernel(accepted_ptr, hist_ptr, slots_ptr, nreq, pad_slot_id, n_slots, BLOCK: tl.constexpr):
    # hist_len = prev_accepted = 0 at every live listed slot (see replay.api.reset_history)
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mb = b < nreq
    slot = tl.load(slots_ptr + b, mask=mb, other=pad_slot_id).to(tl.int64)
    live = mb & (slot != pad_slot_id) & (slot >= 0) & (slot < n_slots)  # outside [0, S): as the pad slot
    tl.store(hist_ptr + slot, tl.zeros([BLOCK], dtype=hist_ptr.dtype.element_ty), mask=live)
    tl.store(accepted_ptr + slot, tl.zeros([BLOCK], dtype=accepted_ptr.dtype.element_ty), mask=live)


def launch_reset_history(prev_accepted, hist_len, slots, *, pad_slot_id: int) -> None:
    """prev_accepted, hist_len (S,) integer; slots (B,) integer, on one device."""
    nreq, block = slots.shape[0], 128
    lean(_reset_history_kernel)[(cdiv(nreq, block),)](
        prev_accepted, hist_len, slots, nreq, pad_slot_id, hist_len.shape[0], BLOCK=block, num_warps=1,
    )
