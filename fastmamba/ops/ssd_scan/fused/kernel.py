"""One-launch SSD scan for short sequences: the five kernels of ``kernel.py`` in one program.

One program per (sequence, head, block of P) walks its sequence's tokens in order, BLOCK_T at a
time, with the state S [P, N] in fp32 registers. For a block of tokens t (dt' processed, a_t =
dt'_t A[h], cs_t = cumulative sum of a over the block up to t, inclusive):

    y_t  = exp(cs_t) C_t S^T  +  sum_{s <= t} (C_t . B_s) exp(cs_t - cs_s) dt'_s x_s  (+ D x, * silu(z))
    S   <- exp(cs_last) S  +  sum_s exp(cs_last - cs_s) dt'_s x_s B_s^T

which is the chunked algorithm with chunks of BLOCK_T tokens and the state passing done in place
(the result is the recurrence of ``ref.py``; BLOCK_T is a tiling choice). Blocks never cross a
``chunk_size`` boundary, so the state after every chunk is at hand for ``chunk_states_out``. The
blocks run as one flat loop whose every trip issues the next block's loads (dt, x, B, C, z) before
computing its own, so their latency hides behind the block before (the loop is a chain through the
state: Triton's own pipelining did not hide it; H200, one 2.7b layer: 1 x 128 20.9 -> 15.9 us).
The first block reads the slot's state (has_initial_state), the last stores the final state into the
slot (16-bit pools: round to nearest, or stochastically with the state update's random stream).
Everything the five-kernel path does with small torch ops first (slot / pad / flag resolution) is
done here, per program, from the raw index tensors: a call is one launch.

Under programmatic dependent launch (``fastmamba.ops._common.pdl``: the runtime's prefill graphs) a
program reads what the kernel before it never writes (cu_seqlens, the slot and flag, its slot's
state, A, D, dt_bias) before the grid-dependency wait, and writes nothing before it: the state's
load latency hides behind the end of the conv kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastmamba.ops._common.dispatch import inline_asm_ok, interpreter_enabled
from fastmamba.ops._common.jit_math import exp_approx, silu_approx, softplus
from fastmamba.ops._common.pdl import TRIGGER_EARLY, pdl_active
from fastmamba.ops.ssd_scan.fused.configs import pick_fused_config
from fastmamba.ops.ssd_scan.chunked.kernel_common import (
    _defer_norm,
    _locate_segment,
    _mma,
    _to_state_dtype,
    _wait_for_kernel_before,
    d_strides,
)
from fastmamba.ops._common.launch import lean
from fastmamba.ops._common.host_math import cdiv, next_power_of_2


@triton.jit
def _block_at(i, seq_len, Q: tl.constexpr, BLOCK_T: tl.constexpr, BPC: tl.constexpr):
    """Block i of a sequence of seq_len tokens cut into chunks of Q and blocks of BLOCK_T that never
    cross a chunk (BPC = cdiv(Q, BLOCK_T) blocks per chunk): (its first token t0, the tokens left in
    its chunk from t0)."""
    c0 = (i // BPC) * Q
    t0 = c0 + (i % BPC) * BLOCK_T
    return t0, tl.minimum(c0 + Q, seq_len) - t0


@triton.jit
def _load_block(dt_ptr, x_h, B_g, C_g, z_ptr, first, n, h, offs_t, offs_p, offs_n, mp, mn, stride_dt_t, stride_dt_h,
                stride_x_t, stride_x_p, stride_B_t, stride_B_n, stride_C_t, stride_C_n, stride_z_h, stride_z_t,
                stride_z_p, HAS_Z: tl.constexpr):
    """The raw tiles of one block (tokens first .. first + min(n, BLOCK_T) - 1; nothing for n <= 0):
    dt [BLOCK_T], x [BLOCK_T, BLOCK_P], B and C [BLOCK_T, BLOCK_N], z [BLOCK_T, BLOCK_P] (0.0 without z)."""
    mt = offs_t < n
    tok = first + offs_t
    d = tl.load(dt_ptr + tok * stride_dt_t + h * stride_dt_h, mask=mt, other=0.0)
    x = tl.load(x_h + tok[:, None] * stride_x_t + offs_p[None, :] * stride_x_p, mask=mt[:, None] & mp[None, :],
                other=0.0)
    Bm = tl.load(B_g + tok[:, None] * stride_B_t + offs_n[None, :] * stride_B_n, mask=mt[:, None] & mn[None, :],
                 other=0.0)
    Cm = tl.load(C_g + tok[:, None] * stride_C_t + offs_n[None, :] * stride_C_n, mask=mt[:, None] & mn[None, :],
                 other=0.0)
    z = 0.0
    if HAS_Z:
        z = tl.load(z_ptr + h * stride_z_h + tok[:, None] * stride_z_t + offs_p[None, :] * stride_z_p,
                    mask=mt[:, None] & mp[None, :], other=0.0)
    return d, x, Bm, Cm, z


@triton.heuristics({
    "HAS_IDX": lambda a: a["idx_ptr"] is not None,
    "HAS_INIT": lambda a: a["init_flag_ptr"] is not None,
    "HAS_D": lambda a: a["D_ptr"] is not None,
    "HAS_Z": lambda a: a["z_ptr"] is not None,
    "HAS_DT_BIAS": lambda a: a["dt_bias_ptr"] is not None,
    "HAS_CHUNK_OUT": lambda a: a["chunk_out_ptr"] is not None,
    "STOCHASTIC_ROUND": lambda a: a["seed_ptr"] is not None,
    "HAS_NORM": lambda a: a["sq_ptr"] is not None,
})
@triton.jit(do_not_specialize=["nseq", "S", "pad_slot_id", "dt_min", "dt_max"])
def _ssd_scan_fused_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, out_ptr,
    states_ptr, cu_ptr, idx_ptr, init_flag_ptr, chunk_out_ptr, seed_ptr, nw_ptr, sq_ptr,
    nseq, S, H, P, N, heads_per_group, pad_slot_id, dt_min, dt_max, stride_sq_t,
    stride_x_t, stride_x_h, stride_x_p,
    stride_dt_t, stride_dt_h,
    stride_B_t, stride_B_g, stride_B_n,
    stride_C_t, stride_C_g, stride_C_n,
    stride_D_h, stride_D_p,
    stride_z_t, stride_z_h, stride_z_p,
    stride_o_t, stride_o_h, stride_o_p,
    stride_s_s, stride_s_h, stride_s_p, stride_s_n,
    stride_co_c, stride_co_h, stride_co_p, stride_co_n,
    Q: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SEG: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr, A_IS_LOG: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FAST_MATH: tl.constexpr, DOT_UPCAST: tl.constexpr,
    HAS_IDX: tl.constexpr, HAS_INIT: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, HAS_CHUNK_OUT: tl.constexpr, STOCHASTIC_ROUND: tl.constexpr,
    HAS_NORM: tl.constexpr = False,
    USE_PDL: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = True,
):
    # one program per (sequence, head, block of P): the sequence's tokens in order, the state in fp32 registers
    b = tl.program_id(0)
    h = tl.program_id(1)
    pid_p = tl.program_id(2)
    lo = tl.load(cu_ptr + b).to(tl.int64)
    seq_len = (tl.load(cu_ptr + b + 1).to(tl.int64) - lo).to(tl.int32)
    if HAS_IDX:
        slot = tl.load(idx_ptr + b).to(tl.int64)
    else:
        slot = b.to(tl.int64)
    # a slot outside [0, S) acts as the pad slot: zero output, no state read or written
    pad = (slot == pad_slot_id) | (slot < 0) | (slot >= S)
    g = h // heads_per_group
    offs_t = tl.arange(0, BLOCK_T)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mp = offs_p < P
    mn = offs_n < N
    mask_pn = mp[:, None] & mn[None, :]
    out_h = out_ptr + h * stride_o_h
    # before the grid-dependency wait: only what the kernel before never writes (indices, the
    # slot's state, the per-head parameters); nothing is stored
    s = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    st_h = states_ptr + slot * stride_s_s + h * stride_s_h
    st_offs = offs_p[:, None] * stride_s_p + offs_n[None, :] * stride_s_n
    if HAS_INIT:
        if not pad:
            if tl.load(init_flag_ptr + b) != 0:
                s = tl.load(st_h + st_offs, mask=mask_pn, other=0.0).to(tl.float32)
    A = tl.load(A_ptr + h).to(tl.float32)
    if A_IS_LOG:
        A = -tl.exp(A)  # A holds A_log
    if HAS_DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + h * stride_D_h + offs_p * stride_D_p, mask=mp, other=0.0).to(tl.float32)
    _wait_for_kernel_before(USE_PDL, PDL_TRIGGER)  # x, dt, B, C, z come from the kernels before
    if pad:
        for t0 in range(0, seq_len, BLOCK_T):
            tok = lo + t0 + offs_t
            tl.store(out_h + tok[:, None] * stride_o_t + offs_p[None, :] * stride_o_p,
                     tl.zeros((BLOCK_T, BLOCK_P), dtype=out_ptr.dtype.element_ty),
                     mask=((t0 + offs_t) < seq_len)[:, None] & mp[None, :])
            if HAS_NORM:
                _defer_norm(tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32), nw_ptr, sq_ptr + tok * stride_sq_t, h,
                            pid_p * BLOCK_P, P, (t0 + offs_t) < seq_len, BLOCK_T, BLOCK_P)
    else:
        if HAS_CHUNK_OUT:
            first_chunk, _, _ = _locate_segment(cu_ptr, nseq, b, Q, BLOCK_SEG)
        x_h = x_ptr + h * stride_x_h
        B_g = B_ptr + g * stride_B_g
        C_g = C_ptr + g * stride_C_g
        causal = offs_t[:, None] >= offs_t[None, :]
        # the blocks of the sequence in order (a chunk's last block may be short), each one's loads
        # issued an iteration ahead: they fly while the block before computes
        BPC: tl.constexpr = (Q + BLOCK_T - 1) // BLOCK_T  # blocks per chunk
        n_blocks = (seq_len // Q) * BPC + tl.cdiv(seq_len % Q, BLOCK_T)
        t0, n = _block_at(0, seq_len, Q, BLOCK_T, BPC)  # n: tokens left in the chunk (the block takes <= BLOCK_T)
        d_raw, x, Bm, Cm, z_raw = _load_block(dt_ptr, x_h, B_g, C_g, z_ptr, lo + t0, n, h, offs_t, offs_p, offs_n,
                                              mp, mn, stride_dt_t, stride_dt_h, stride_x_t, stride_x_p, stride_B_t,
                                              stride_B_n, stride_C_t, stride_C_n, stride_z_h, stride_z_t, stride_z_p,
                                              HAS_Z)
        for i in range(0, n_blocks):
            t0, n = _block_at(i, seq_len, Q, BLOCK_T, BPC)
            t0_next, n_next = _block_at(i + 1, seq_len, Q, BLOCK_T, BPC)
            n_next = tl.where(i + 1 < n_blocks, n_next, 0)
            d_next, x_next, B_next, C_next, z_next = _load_block(
                dt_ptr, x_h, B_g, C_g, z_ptr, lo + t0_next, n_next, h, offs_t, offs_p, offs_n, mp, mn, stride_dt_t,
                stride_dt_h, stride_x_t, stride_x_p, stride_B_t, stride_B_n, stride_C_t, stride_C_n, stride_z_h,
                stride_z_t, stride_z_p, HAS_Z)
            mt = offs_t < n
            tok = lo + t0 + offs_t
            d = d_raw.to(tl.float32)
            if HAS_DT_BIAS:
                d += dt_bias
            if DT_SOFTPLUS:
                d = softplus(d)
            if HAS_DT_LIMIT:
                d = tl.minimum(tl.maximum(d, dt_min), dt_max)
            d = tl.where(mt, d, 0.0)
            cs = tl.cumsum(d * A, 0)  # rows past the block's end repeat the last value
            cs_last = tl.sum(tl.where(offs_t == tl.minimum(n, BLOCK_T) - 1, cs, 0.0), 0)
            # the state entering the block, seen by token t through exp(cs_t) (cs_t <= 0 for A < 0)
            y = _mma(Cm, tl.trans(s).to(Cm.dtype), None, DOT_PRECISION, DOT_UPCAST)
            y = y * exp_approx(cs, FAST_MATH)[:, None]
            # the block's own tokens: C B^T with the causal decay and dt' on the columns
            cb = _mma(Cm, tl.trans(Bm), None, DOT_PRECISION, DOT_UPCAST)
            live = causal & mt[None, :]
            decay = exp_approx(tl.where(live, cs[:, None] - cs[None, :], float("-inf")), FAST_MATH)
            m = tl.where(live, cb * decay * d[None, :], 0.0)
            # a non-finite x_s must not reach rows t < s through a zero weight (0 * NaN = NaN in the
            # matmul): it enters as 0, and the rows t >= s that it reaches become NaN
            finite = tl.abs(x.to(tl.float32)) < float("inf")
            x_fin = tl.where(finite, x, 0.0).to(x.dtype)
            y = _mma(m.to(x.dtype), x_fin, y, DOT_PRECISION, DOT_UPCAST)
            if tl.min(finite.to(tl.int32)) == 0:
                hit = tl.dot(live.to(tl.float32), (~finite).to(tl.float32), input_precision="ieee")
                y = tl.where(hit > 0, float("nan"), y)
            if HAS_D:
                y += x.to(tl.float32) * Dv[None, :]
            mask_tp = mt[:, None] & mp[None, :]
            if HAS_Z:
                y = y * silu_approx(z_raw.to(tl.float32), FAST_MATH)
            if HAS_NORM:
                y = _defer_norm(y, nw_ptr, sq_ptr + tok * stride_sq_t, h, pid_p * BLOCK_P, P, mt, BLOCK_T, BLOCK_P)
            tl.store(out_h + tok[:, None] * stride_o_t + offs_p[None, :] * stride_o_p,
                     y.to(out_ptr.dtype.element_ty), mask=mask_tp)
            # the state at the block's end: decay weights on the [T, P] x tile, B as loaded
            w = tl.where(mt, exp_approx(cs_last - cs, FAST_MATH) * d, 0.0)
            xw = (x.to(tl.float32) * w[:, None]).to(x.dtype)
            s = _mma(tl.trans(xw), Bm, s * tl.exp(cs_last), DOT_PRECISION, DOT_UPCAST)
            if HAS_CHUNK_OUT:
                if n <= BLOCK_T:  # the chunk's last block: its state after the chunk
                    co = chunk_out_ptr + (first_chunk + i // BPC).to(tl.int64) * stride_co_c + h * stride_co_h
                    tl.store(co + offs_p[:, None] * stride_co_p + offs_n[None, :] * stride_co_n,
                             s.to(chunk_out_ptr.dtype.element_ty), mask=mask_pn)
            d_raw, x, Bm, Cm, z_raw = d_next, x_next, B_next, C_next, z_next
        if seq_len > 0:  # an empty sequence leaves its slot untouched
            elem = ((slot * H + h) * P + offs_p[:, None]) * N + offs_n[None, :]
            tl.store(st_h + st_offs, _to_state_dtype(s, seed_ptr, elem, states_ptr.dtype.element_ty,
                                                     STOCHASTIC_ROUND), mask=mask_pn)


def _strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
    return tuple(t.stride()) if t is not None else (0,) * n


def ssd_scan_fused_launch(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    ssm_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    out: torch.Tensor,
    *,
    max_len: int,
    live_seqs: int | None = None,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    pad_slot_id: int = -1,
    chunk_states_out: torch.Tensor | None = None,
    A_is_log: bool = False,
    rand_seed: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_sumsq: torch.Tensor | None = None,
) -> None:
    """Checked varlen inputs (ssd_scan_varlen's shapes: x, z, out [T, H, P], dt [T, H], B, C [T, G, N],
    ssm_states [S, H, P, N], norm_weight [H * P], norm_sumsq [T, H * P / 16]) -> one launch.
    ``max_len``: a host bound on the longest sequence (tiles
    only: any value gives the same result); ``live_seqs``: how many sequences are not padding, when
    the caller knows (tiles only: padding programs just write zeros, so the tiles are sized for the
    live ones)."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    nseq = cu_seqlens.shape[0] - 1
    interpreter = interpreter_enabled()
    cfg = pick_fused_config(max_len, live_seqs or nseq, H, P, interpreter=interpreter)
    lo, hi = dt_limit
    if has_initial_state is not None and has_initial_state.dtype == torch.bool:
        has_initial_state = has_initial_state.view(torch.uint8)  # a view: no kernel
    if rand_seed is not None and ssm_states.dtype == torch.float32:
        rand_seed = None
    grid = (nseq, H, cdiv(P, cfg.block_p))
    use_pdl = pdl_active(x, nseq * H * grid[2], cfg.num_warps)
    lean(_ssd_scan_fused_kernel)[grid](
        x, dt, A, B, C, D, z, dt_bias, out,
        ssm_states, cu_seqlens, cache_indices, has_initial_state, chunk_states_out, rand_seed, norm_weight, norm_sumsq,
        nseq, ssm_states.shape[0], H, P, N, H // G, pad_slot_id, float(lo), float(hi),
        norm_sumsq.stride(0) if norm_sumsq is not None else 0,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *d_strides(D), *_strides(z, 3), *out.stride(),
        *ssm_states.stride(), *_strides(chunk_states_out, 4),
        Q=chunk_size, BLOCK_T=cfg.block_t, BLOCK_P=cfg.block_p, BLOCK_N=max(16, next_power_of_2(N)),
        BLOCK_SEG=max(16, next_power_of_2(nseq + 1)) if chunk_states_out is not None else 16,
        DT_SOFTPLUS=bool(dt_softplus), HAS_DT_LIMIT=lo > 0.0 or hi != float("inf"), A_IS_LOG=bool(A_is_log),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", FAST_MATH=inline_asm_ok(x),
        # Triton 3.6's interpreter multiplies bf16 tl.dot operands as raw bits (docs/interpreter_bf16.md)
        DOT_UPCAST=interpreter and x.dtype == torch.bfloat16,
        USE_PDL=use_pdl, PDL_TRIGGER=TRIGGER_EARLY,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=use_pdl,
    )
