"""Triton kernel for the SSM state update (one or several tokens per request).

One program per (block of P, request, head). The program loads its [BLOCK_P, N] state tile once,
keeps it in fp32 registers across the T tokens, and stores it once (plus, optionally, once per
token into ``intermediate_states``). The silu(z) gate, D skip and dt bias/softplus are applied in
registers before the single store of y, so nothing makes an extra trip through HBM.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fastmamba.ops._common.jit_math import silu, softplus, stochastic_round
from fastmamba.ops._common.pdl import TRIGGER_EARLY
from fastmamba.ops.state_update.configs import store_state_early
from fastmamba.ops._common.launch import lean
from fastmamba.ops._common.host_math import cdiv, next_power_of_2


@triton.jit
def _store_state(s, state_ptr, row_off, slot, h, nheads, s_tile_off, mask, seed_ptr, offs_p, offs_n,
                 P: tl.constexpr, N: tl.constexpr, STOCHASTIC_ROUND: tl.constexpr):
    """Store the fp32 tile ``s`` at ``state_ptr + row_off + s_tile_off`` in the state's dtype:
    rounded to nearest, or stochastically with one random number per element, distinct across
    slots, heads and positions."""
    if STOCHASTIC_ROUND:
        seed = tl.load(seed_ptr)
        elem = ((slot * nheads + h) * P + offs_p[:, None]) * N + offs_n[None, :]
        s_out = stochastic_round(s, tl.rand(seed, elem.to(tl.int32)), state_ptr.dtype.element_ty)
    else:
        s_out = s.to(state_ptr.dtype.element_ty)
    tl.store(state_ptr + row_off + s_tile_off, s_out, mask=mask)


@triton.jit
def _selective_state_update_kernel(
    state_ptr, x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, out_ptr,
    src_idx_ptr, dst_idx_ptr, inter_ptr, seed_ptr, err_ptr,
    T, heads_per_group, pad_slot_id, n_slots,
    stride_state_s, stride_state_h, stride_state_p: tl.constexpr, stride_state_n,
    stride_x_b, stride_x_t, stride_x_h, stride_x_p,
    stride_dt_b, stride_dt_t, stride_dt_h, stride_dt_p,
    stride_dt_bias_h, stride_dt_bias_p,
    stride_A_h, stride_A_p, stride_A_n,
    stride_B_b, stride_B_t, stride_B_g, stride_B_n,
    stride_C_b, stride_C_t, stride_C_g, stride_C_n,
    stride_D_h, stride_D_p,
    stride_z_b, stride_z_t, stride_z_h, stride_z_p,
    stride_out_b, stride_out_t, stride_out_h, stride_out_p,
    stride_inter_b, stride_inter_t, stride_inter_h, stride_inter_p, stride_inter_n,
    HAS_DT_BIAS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_SRC_IDX: tl.constexpr, HAS_DST_IDX: tl.constexpr, HAS_INTER: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, TIE_HDIM: tl.constexpr, STOCHASTIC_ROUND: tl.constexpr, USE_PDL: tl.constexpr,
    PDL_TRIGGER: tl.constexpr, STORE_EARLY: tl.constexpr, A_IS_LOG: tl.constexpr,
    P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    REPORT_SLOTS: tl.constexpr = False,
):
    # one program per (block of P, request, head); P and N are constexpr so that full tiles
    # carry no mask along N and the state moves in 16-byte vectors
    pid_p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    g = h // heads_per_group

    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N

    if HAS_SRC_IDX:
        src = tl.load(src_idx_ptr + b).to(tl.int64)
    else:
        src = b
    if HAS_DST_IDX:
        dst = tl.load(dst_idx_ptr + b).to(tl.int64)
    else:
        dst = src
    # a slot outside [0, S) acts as the pad slot (indices not range-checked on the host: CUDA-graph
    # capture, torch.compile, trusted_inputs()): nothing is ever read or written outside the pool
    valid = (src != pad_slot_id) & (src >= 0) & (src < n_slots)
    write_state = valid & (dst != pad_slot_id) & (dst >= 0) & (dst < n_slots)
    if REPORT_SLOTS:  # unchecked indices of a plain call: record a bad one (slot_errors.py), once per request
        if (pid_p == 0) & (h == 0):
            bad_src = (src != pad_slot_id) & ((src < 0) | (src >= n_slots))
            bad_dst = (dst != pad_slot_id) & ((dst < 0) | (dst >= n_slots))
            if bad_src | bad_dst:
                tl.store(err_ptr + 1, tl.where(bad_src, 1, 2).to(tl.int64))
                tl.store(err_ptr + 2, tl.where(bad_src, src, dst).to(tl.int64))
                tl.store(err_ptr + 3, n_slots)
                tl.store(err_ptr, 1)

    # per-head parameters (scalars when tied over P and N, as Mamba-2 calls it)
    if TIE_HDIM:
        A = tl.load(A_ptr + h * stride_A_h).to(tl.float32)
        if HAS_DT_BIAS:
            dt_bias = tl.load(dt_bias_ptr + h * stride_dt_bias_h).to(tl.float32)
        if HAS_D:
            Dv = tl.load(D_ptr + h * stride_D_h).to(tl.float32)
    else:
        A = tl.load(A_ptr + h * stride_A_h + offs_p[:, None] * stride_A_p + offs_n[None, :] * stride_A_n,
                    mask=mask_p[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        if HAS_DT_BIAS:
            dt_bias = tl.load(dt_bias_ptr + h * stride_dt_bias_h + offs_p * stride_dt_bias_p,
                              mask=mask_p, other=0.0).to(tl.float32)
        if HAS_D:
            Dv = tl.load(D_ptr + h * stride_D_h + offs_p * stride_D_p, mask=mask_p, other=0.0).to(tl.float32)
    if A_IS_LOG:  # A holds A_log: the decay rate is -exp(A_log), computed here so no cache can go stale
        A = -tl.exp(A)

    # the state tile: the big load, issued before the small per-token ones
    tile_mask = mask_p[:, None] & mask_n[None, :] & valid
    s_tile_off = offs_p[:, None] * stride_state_p + offs_n[None, :] * stride_state_n
    s = tl.load(state_ptr + src * stride_state_s + h * stride_state_h + s_tile_off,
                mask=tile_mask, other=0.0).to(tl.float32)

    if USE_PDL:
        # everything above reads weights, slot indices and this request's cache row; what follows
        # (x, dt, B, C, z) may be the output of the kernel launched just before this one
        gdc_wait()
        if PDL_TRIGGER:
            gdc_launch_dependents()

    x_base = x_ptr + b * stride_x_b + h * stride_x_h + offs_p * stride_x_p
    dt_base = dt_ptr + b * stride_dt_b + h * stride_dt_h
    B_base = B_ptr + b * stride_B_b + g * stride_B_g + offs_n * stride_B_n
    C_base = C_ptr + b * stride_C_b + g * stride_C_g + offs_n * stride_C_n
    out_base = out_ptr + b * stride_out_b + h * stride_out_h + offs_p * stride_out_p

    for t in range(T):
        x = tl.load(x_base + t * stride_x_t, mask=mask_p, other=0.0).to(tl.float32)
        if TIE_HDIM:
            dt = tl.load(dt_base + t * stride_dt_t).to(tl.float32)
        else:
            dt = tl.load(dt_base + t * stride_dt_t + offs_p * stride_dt_p, mask=mask_p, other=0.0).to(tl.float32)
        if HAS_DT_BIAS:
            dt = dt + dt_bias
        if DT_SOFTPLUS:
            dt = softplus(dt)
        Bv = tl.load(B_base + t * stride_B_t, mask=mask_n, other=0.0).to(tl.float32)
        Cv = tl.load(C_base + t * stride_C_t, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_Z:
            z = tl.load(z_ptr + b * stride_z_b + t * stride_z_t + h * stride_z_h + offs_p * stride_z_p,
                        mask=mask_p, other=0.0).to(tl.float32)

        if TIE_HDIM:
            dA = tl.exp(A * dt)  # one exp per program, not per element
            s = s * dA + (x * dt)[:, None] * Bv[None, :]
        else:
            dA = tl.exp(A * dt[:, None])
            s = s * dA + (x * dt)[:, None] * Bv[None, :]

        if STORE_EARLY:
            if t == T - 1:  # the final state, stored before the output's reduction: fewer live registers
                _store_state(s, state_ptr, dst * stride_state_s + h * stride_state_h, dst, h, tl.num_programs(2),
                             s_tile_off, tile_mask & write_state, seed_ptr, offs_p, offs_n, P, N, STOCHASTIC_ROUND)
        y = tl.sum(s * Cv[None, :], axis=1)
        if HAS_D:
            y += x * Dv
        if HAS_Z:
            y *= silu(z)
        y = tl.where(valid, y, 0.0)  # padded rows: zero output, no state traffic
        tl.store(out_base + t * stride_out_t, y.to(out_ptr.dtype.element_ty), mask=mask_p)
        if HAS_INTER:
            inter_off = b * stride_inter_b + t * stride_inter_t + h * stride_inter_h + (
                offs_p[:, None] * stride_inter_p + offs_n[None, :] * stride_inter_n)
            if STOCHASTIC_ROUND and inter_ptr.dtype.element_ty != tl.float32:
                # a 16-bit per-position state (speculative legacy path) rounds like the stored state,
                # with its own random numbers per (request, position, head, p, n)
                seed = tl.load(seed_ptr)
                inter_elem = (((b * T + t) * tl.num_programs(2) + h) * P + offs_p[:, None]) * N + offs_n[None, :]
                s_inter = stochastic_round(s, tl.rand(seed + 1, inter_elem.to(tl.int32)), inter_ptr.dtype.element_ty)
            else:
                s_inter = s.to(inter_ptr.dtype.element_ty)
            tl.store(inter_ptr + inter_off, s_inter, mask=tile_mask)

    if not STORE_EARLY:
        _store_state(s, state_ptr, dst * stride_state_s + h * stride_state_h, dst, h, tl.num_programs(2),
                     s_tile_off, tile_mask & write_state, seed_ptr, offs_p, offs_n, P, N, STOCHASTIC_ROUND)


def plan_selective_state_update(
    state, x, dt, dt_bias, A, B, C, D, z, out, src_idx, dst_idx, inter, seed,
    *, dt_softplus: bool, tie_hdim: bool, pad_slot_id: int, block_p: int, num_warps: int, use_pdl: bool = False,
    A_is_log: bool = False, report_slots: bool = False,
) -> tuple[tuple, tuple, dict]:
    """(grid, scalar arguments, keyword arguments) of the launch on 4-D views: state (S,H,P,N),
    x/dt/z/out (B,T,H,P), B/C (B,T,G,N), A (H,P,N) (A_log when ``A_is_log``), D/dt_bias (H,P),
    inter (B,T,H,P,N); optional tensors may be None. Everything but the tensors' addresses: a plan
    serves every later call whose tensors have the same shapes, strides and dtypes (the public
    op caches it per call signature), with the tensors passed as they come (views share them)."""
    nreq, ntok, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    block_n = next_power_of_2(dstate)
    grid = (cdiv(headdim, block_p), nreq, nheads)

    def strides(t, n):
        return tuple(t.stride()) if t is not None else (0,) * n

    scalars = (
        ntok, nheads // ngroups, pad_slot_id, state.shape[0],
        *state.stride(), *x.stride(), *dt.stride(), *strides(dt_bias, 2), *A.stride(),
        *B.stride(), *C.stride(), *strides(D, 2), *strides(z, 4), *out.stride(), *strides(inter, 5),
    )
    consts = dict(
        HAS_DT_BIAS=dt_bias is not None, HAS_D=D is not None, HAS_Z=z is not None,
        HAS_SRC_IDX=src_idx is not None, HAS_DST_IDX=dst_idx is not None, HAS_INTER=inter is not None,
        DT_SOFTPLUS=dt_softplus, TIE_HDIM=tie_hdim, STOCHASTIC_ROUND=seed is not None, USE_PDL=use_pdl,
        PDL_TRIGGER=TRIGGER_EARLY, STORE_EARLY=ntok > 0 and store_state_early(nreq * nheads), A_IS_LOG=A_is_log,
        P=headdim, N=dstate, BLOCK_P=block_p, BLOCK_N=block_n, num_warps=num_warps, launch_pdl=use_pdl,
        REPORT_SLOTS=report_slots,
    )
    return grid, scalars, consts


def launch_planned(plan, state, x, dt, dt_bias, A, B, C, D, z, out, src_idx, dst_idx, inter, seed, err=None) -> None:
    """Launch a ``plan_selective_state_update`` plan on these tensors (``err``: the slot-error
    record, for a plan made with report_slots)."""
    grid, scalars, consts = plan
    lean(_selective_state_update_kernel)[grid](
        state, x, dt, dt_bias, A, B, C, D, z, out, src_idx, dst_idx, inter, seed, err, *scalars, **consts)


def launch_selective_state_update(
    state, x, dt, dt_bias, A, B, C, D, z, out, src_idx, dst_idx, inter, seed,
    *, dt_softplus: bool, tie_hdim: bool, pad_slot_id: int, block_p: int, num_warps: int, use_pdl: bool = False,
    A_is_log: bool = False,
):
    """Launch the kernel on 4-D views (see plan_selective_state_update)."""
    plan = plan_selective_state_update(
        state, x, dt, dt_bias, A, B, C, D, z, out, src_idx, dst_idx, inter, seed, dt_softplus=dt_softplus,
        tie_hdim=tie_hdim, pad_slot_id=pad_slot_id, block_p=block_p, num_warps=num_warps, use_pdl=use_pdl,
        A_is_log=A_is_log)
    launch_planned(plan, state, x, dt, dt_bias, A, B, C, D, z, out, src_idx, dst_idx, inter, seed)
