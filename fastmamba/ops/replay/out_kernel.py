"""The split path's output kernels (see ``kernel.py``'s docstring, 2a): every request's T outputs
straight from the stored state, one program per (block of P, request, head) or, for an fp32 state
with bf16 activations on sm_90+, a persistent loop fed by TMA; their launchers and the TMA rule.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fastmamba.ops._common.dispatch import inline_asm_ok
from fastmamba.ops._common.jit_math import silu_approx
from fastmamba.ops._common.launch import lean
from fastmamba.ops._common.host_math import cdiv
from fastmamba.ops.replay.kernel_common import (
    _dot_precision,
    _dot_split,
    _dot_split_rhs,
    _interpreting,
    _slot_history,
    _tma_views_ok,
    _view_desc,
    dot_dim,
)


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
