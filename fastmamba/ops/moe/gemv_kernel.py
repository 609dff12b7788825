"""The GEMV path of a few tokens (see ``kernel.py``'s docstring): ``_up_gemv_kernel`` and
``_down_gemv_kernel``, one program per (pair, block of features), a shared expert's slices read in
place, the k-sum in the down kernel's last arrivals (or ``launch_sum``).

Two ways to multiply a weight tile w [BLOCK_N, BLOCK_K] by the pair's row v [BLOCK_K] (``USE_DOT``):
fp32 FMAs into [BLOCK_N, BLOCK_K] partial sums, reduced once at the end; or a tensor-core dot of v
as row 0 of a [16, BLOCK_K] tile of zeros with w^T (the bf16 ``gemv``'s way: only then does Triton
stream the weight tiles through its cp.async pipeline, ``num_stages`` deep, so that one program
keeps several tiles in flight instead of waiting for each; the zero rows add exact zeros, and row 0
is the result)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fastmamba.ops._common.host_math import cdiv, next_power_of_2
from fastmamba.ops._common.launch import lean
from fastmamba.ops._common.pdl import pdl_active
from fastmamba.ops.moe.kernel import launch_sum
from fastmamba.ops.moe.kernel_common import _sum_pairs


@triton.jit
def _gemv_pair(ids_ptr, w_ptr, sw_ptr, p, E, Fdim, stride_it, stride_ik, stride_we, stride_wr, stride_sr, stride_sc,
               K: tl.constexpr, N_SHARED: tl.constexpr, SHARED_ALONG_ROWS: tl.constexpr):
    """Pair p = t*(K+N_SHARED) + j: its token t, the routed column jr = min(j, K-1), whether it is
    routed (j < K), whether its expert is real (a routed id in [0, E), or a shared slice), the base
    of its weight matrix and that matrix's row stride. Routed: w + e*stride_we, rows stride_wr apart. Shared slice
    s = j - K: F rows of the shared up_proj [Fs, M] (SHARED_ALONG_ROWS: base s*F*stride_sr) or F
    columns of the shared down_proj [M, Fs] (base s*F*stride_sc), rows stride_sr apart."""
    t = p // (K + N_SHARED)
    j = p % (K + N_SHARED)
    routed = j < K
    jr = tl.minimum(j, K - 1)
    e = tl.load(ids_ptr + t * stride_it + jr * stride_ik).to(tl.int64)
    ok = (e >= 0) & (e < E)
    base = w_ptr + tl.where(ok, e, 0) * stride_we
    row_stride = stride_wr
    if N_SHARED > 0:
        s = (j - K).to(tl.int64)
        if SHARED_ALONG_ROWS:
            sbase = sw_ptr + s * Fdim * stride_sr
        else:
            sbase = sw_ptr + s * Fdim * stride_sc
        base = tl.where(routed, base, sbase)
        row_stride = tl.where(routed, stride_wr, stride_sr)
        ok = ok | (j >= K)
    return t, jr, routed, ok, base, row_stride


@triton.jit
def _row_times_tile(acc, v, w, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + w @ v: v [BLOCK_K] (the pair's row), w [BLOCK_N, BLOCK_K]. USE_DOT: acc [16, BLOCK_N] fp32
    (row 0 holds the sums: v is row 0 of a 16-row tile of zeros); else acc [BLOCK_N, BLOCK_K] fp32
    partial sums (``_row_sums`` reduces either to [BLOCK_N])."""
    if USE_DOT:
        rows = tl.arange(0, 16)[:, None]
        v16 = tl.where(rows == 0, v[None, :], tl.zeros_like(v)[None, :])  # [16, BLOCK_K]
        if DOT_FP32:  # fp32 weights (full-precision products, not tf32), or the CPU interpreter (its 16-bit dot is wrong)
            acc = tl.dot(v16.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(v16.to(w.dtype), tl.trans(w), acc)
    else:
        acc = acc + w.to(tl.float32) * v.to(tl.float32)[None, :]
    return acc


@triton.jit
def _row_sums(acc, USE_DOT: tl.constexpr):
    """[BLOCK_N] fp32: the sums ``_row_times_tile`` gathered (the dot's rows 1-15 are exact zeros)."""
    if USE_DOT:
        out = tl.sum(acc, axis=0)
    else:
        out = tl.sum(acc, axis=1)
    return out


@triton.jit
def _up_gemv_kernel(
    x_ptr, w_ptr, sw_ptr, h_ptr, ids_ptr,
    E, Fdim, Mdim,
    stride_xt, stride_xm, stride_we, stride_wf, stride_wm, stride_sf, stride_hp, stride_it, stride_ik,
    K: tl.constexpr, N_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr, USE_DOT: tl.constexpr = False, DOT_FP32: tl.constexpr = False,
):
    # one program per (pair p = t*(K+N_SHARED) + j, block of BLOCK_N of F):
    # h[p, n] = relu(w[n, :] @ x[t])², w = w_up[ids[t, j]] or slice j-K of the shared up_proj
    # (both have stride_wm along M)
    p = tl.program_id(0)
    if USE_PDL:
        # the ids come from the router, the kernel just before; x from the kernel before that, so it is
        # visible once this grid runs (the router triggers its dependents after its own wait). A
        # shared slice's program reads no ids: it streams its weights while the router still runs
        if N_SHARED > 0:
            if p % (K + N_SHARED) < K:
                gdc_wait()
        else:
            gdc_wait()
        gdc_launch_dependents()
    t, _, _, ok, base, row_stride = _gemv_pair(ids_ptr, w_ptr, sw_ptr, p, E, Fdim, stride_it, stride_ik, stride_we,
                                               stride_wf, stride_sf, stride_wm, K, N_SHARED, True)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mn = (offs_n < Fdim) & ok
    x_ptrs = x_ptr + t.to(tl.int64) * stride_xt + offs_k * stride_xm
    w_ptrs = base + offs_n[:, None] * row_stride + offs_k[None, :] * stride_wm
    if USE_DOT:
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, Mdim, BLOCK_K):
        if EVEN_K:
            xv = tl.load(x_ptrs)
            w = tl.load(w_ptrs, mask=mn[:, None], other=0.0)
        else:
            mk = (k0 + offs_k) < Mdim
            xv = tl.load(x_ptrs, mask=mk, other=0.0)
            w = tl.load(w_ptrs, mask=mn[:, None] & mk[None, :], other=0.0)
        acc = _row_times_tile(acc, xv, w, USE_DOT, DOT_FP32)
        x_ptrs += BLOCK_K * stride_xm
        w_ptrs += BLOCK_K * stride_wm
    hv = tl.maximum(_row_sums(acc, USE_DOT), 0.0)
    tl.store(h_ptr + p.to(tl.int64) * stride_hp + offs_n, (hv * hv).to(h_ptr.dtype.element_ty), mask=offs_n < Fdim)


@triton.jit
def _down_gemv_kernel(
    h_ptr, w_ptr, sw_ptr, y_ptr, ids_ptr, tw_ptr, out_ptr, arrivals_ptr,
    E, Mdim, Fdim,
    stride_hp, stride_we, stride_wm, stride_wf, stride_sm, stride_yp, stride_it, stride_ik, stride_twt, stride_twk,
    stride_ot, stride_om,
    K: tl.constexpr, N_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr, FUSED_SUM: tl.constexpr, USE_DOT: tl.constexpr = False, DOT_FP32: tl.constexpr = False,
):
    # one program per (pair p = t*(K+N_SHARED) + j, block of BLOCK_N of M):
    # y[p, n] = tw[t, j] * w[n, :] @ h[p], w = w_down[ids[t, j]] or slice j-K of the shared down_proj
    # (weight 1.0). FUSED_SUM: the last of token t's pairs to finish this block of M (an arrival
    # counter per (t, block), reset by it) writes out[t, block] = sum_j y[...] as _sum_kernel does
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    # ids and the routing weights come from the router, two kernels back (the up kernel is between):
    # under PDL they and the first weight tile are read before the grid-dependency wait
    t, jr, routed, ok, base, row_stride = _gemv_pair(ids_ptr, w_ptr, sw_ptr, p, E, Fdim, stride_it, stride_ik,
                                                     stride_we, stride_wm, stride_sm, stride_wf, K, N_SHARED, False)
    tw = tl.load(tw_ptr + t * stride_twt + jr * stride_twk).to(tl.float32)
    if N_SHARED > 0:
        tw = tl.where(routed, tw, 1.0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mn = (offs_n < Mdim) & ok
    h_ptrs = h_ptr + p.to(tl.int64) * stride_hp + offs_k
    w_ptrs = base + offs_n[:, None] * row_stride + offs_k[None, :] * stride_wf
    w = tl.load(w_ptrs, mask=mn[:, None] & (offs_k < Fdim)[None, :], other=0.0)
    if USE_PDL:
        gdc_wait()  # h comes from the up kernel
        gdc_launch_dependents()
    hv = tl.load(h_ptrs, mask=offs_k < Fdim, other=0.0)
    if USE_DOT:
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc = _row_times_tile(acc, hv, w, USE_DOT, DOT_FP32)
    h_ptrs += BLOCK_K
    w_ptrs += BLOCK_K * stride_wf
    for k0 in range(BLOCK_K, Fdim, BLOCK_K):
        if EVEN_K:
            hv = tl.load(h_ptrs)
            w = tl.load(w_ptrs, mask=mn[:, None], other=0.0)
        else:
            mk = (k0 + offs_k) < Fdim
            hv = tl.load(h_ptrs, mask=mk, other=0.0)
            w = tl.load(w_ptrs, mask=mn[:, None] & mk[None, :], other=0.0)
        acc = _row_times_tile(acc, hv, w, USE_DOT, DOT_FP32)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wf
    y = _row_sums(acc, USE_DOT) * tw
    mo = offs_n < Mdim
    tl.store(y_ptr + p.to(tl.int64) * stride_yp + offs_n, y.to(y_ptr.dtype.element_ty), mask=mo)
    if FUSED_SUM:
        # every thread's row is stored before the arrival is counted (release); the last arrival reads
        # the other pairs' rows through L2 (.cg) after its acquire, in pair order (as _sum_kernel)
        tl.debug_barrier()
        counter = arrivals_ptr + t * tl.num_programs(1) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == K + N_SHARED - 1:
            total = _sum_pairs(y_ptr, ids_ptr, t, offs_n, mo, E, stride_yp, stride_it, stride_ik, K, N_SHARED,
                               BLOCK_N, True)
            tl.store(out_ptr + t * stride_ot + offs_n * stride_om, total.to(out_ptr.dtype.element_ty), mask=mo)
            tl.store(counter, 0)  # ready for the next call (the kernel boundary publishes it)


def launch_gemv(x, w_up, w_down, tw, ids, h, y, out, *, block_n_up: int, block_k_up: int, block_n_down: int,
                block_k_down: int, num_warps: int, num_stages: int, shared_up=None, shared_down=None,
                arrivals=None, use_dot: bool = False, dot_fp32: bool = False) -> None:
    """h [P, F], y [P, M] (unit stride along the last dim; P = T*(k+S)): each pair's relu²
    activations and its weighted contribution, written then read; then the fixed-order sum into
    out [T, M]: by the down kernel's last arrivals when ``arrivals`` (int32, at least
    T * cdiv(M, block_n_down) zeros, left zero) is given, else by ``_sum_kernel``.

    shared_up [S*F, M], shared_down [M, S*F] (or None): a relu² shared expert run as S more pairs of
    weight 1.0 per token (its strides along M and F equal w_up's and w_down's).

    ``use_dot``: the tensor-core tiles (block_n_* >= 16; see the module docstring), in fp32 with fp32
    weights or ``dot_fp32`` (the interpreter's).

    Under programmatic dependent launch (``fastmamba.ops._common.pdl``, grids of one wave) the down
    kernel reads the ids, the routing weights and its first weight tile before its wait, and the up
    kernel's shared-slice programs read x and their weights without waiting: the kernel launched
    just before ``fused_moe`` (the router) must write neither x nor the weights (ids and routing
    weights are read by the up kernel's routed pairs first, after their wait)."""
    T, M = x.shape
    E, F, _ = w_up.shape
    K = ids.shape[1]
    S = 0 if shared_up is None else shared_up.shape[0] // F
    P = T * (K + S)
    dot_fp32 = dot_fp32 or x.dtype == torch.float32
    grid_up, grid_down = (P, cdiv(F, block_n_up)), (P, cdiv(M, block_n_down))
    pdl_up = pdl_active(x, grid_up[0] * grid_up[1], num_warps)
    pdl_down = pdl_active(x, grid_down[0] * grid_down[1], num_warps)
    sf = shared_up.stride(0) if S else 0
    sm = shared_down.stride(0) if S else 0
    lean(_up_gemv_kernel)[grid_up](
        x, w_up, shared_up, h, ids, E, F, M,
        x.stride(0), x.stride(1), w_up.stride(0), w_up.stride(1), w_up.stride(2), sf, h.stride(0),
        ids.stride(0), ids.stride(1),
        K=K, N_SHARED=S, BLOCK_N=block_n_up, BLOCK_K=block_k_up, EVEN_K=M % block_k_up == 0, USE_PDL=pdl_up,
        USE_DOT=use_dot, DOT_FP32=dot_fp32, num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl_up,
    )
    fused_sum = arrivals is not None
    lean(_down_gemv_kernel)[grid_down](
        h, w_down, shared_down, y, ids, tw, out, arrivals, E, M, F,
        h.stride(0), w_down.stride(0), w_down.stride(1), w_down.stride(2), sm, y.stride(0),
        ids.stride(0), ids.stride(1), tw.stride(0), tw.stride(1), out.stride(0), out.stride(1),
        K=K, N_SHARED=S, BLOCK_N=block_n_down, BLOCK_K=block_k_down, EVEN_K=F % block_k_down == 0,
        USE_PDL=pdl_down, FUSED_SUM=fused_sum, USE_DOT=use_dot, DOT_FP32=dot_fp32, num_warps=num_warps,
        num_stages=num_stages, launch_pdl=pdl_down,
    )
    if not fused_sum:
        launch_sum(y, out, ids, E, n_shared=S,
                   use_pdl=pdl_active(x, T * cdiv(M, min(1024, next_power_of_2(M))), 4))
