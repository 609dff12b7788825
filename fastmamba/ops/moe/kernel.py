"""Triton kernels of the MoE ops: the router's selection, the token-expert alignment, the grouped
GEMMs (up_proj + relu², down_proj + routing weight), the k-sum, and the few-token GEMV path.

Letters as in ``ref.py``: T tokens, M model (or latent) width, F expert width, E experts, k experts
per token, P = T*k token-expert pairs, BM rows of a GEMM block.

Grouped path (any T), every buffer sized from (T, k, E, BM) alone, no host read (CUDA-graph safe):
    counts[E], pairs                  the alignment. Expert e's pairs take the rows start[e] ..
                                      start[e] + count[e] of a virtual order, start[e] the exclusive
                                      cumsum of the counts each padded to BM, so a block of BM rows
                                      holds one expert. Where E * P is small (Nano: T <= 1365)
                                      one launch writes per-expert lists (_align_expert_kernel, one
                                      program per expert, pair order, no atomics); else four launches
                                      write the pairs at their rows (a memset, _count_kernel's
                                      histogram, _starts_kernel, _scatter_kernel's atomic cursors)
    h[pos, F]   <- _up_kernel         relu(x[t] @ w_up[e]^T)² for the BM rows of a block, one expert
                                      per block (found by searching the padded cumsum)
    y[p, M]     <- _down_kernel       weight[p] * h[pos] @ w_down[e]^T, written at the pair's row
    out[t, M]   <- _sum_kernel        sum over the k pairs of token t, fp32, fixed order
A row's result never depends on which rows share its block (each row of a tile is its own dot),
so the nondeterministic order the atomics give inside an expert does not change ``out``: the op
is deterministic run to run.

GEMV path (few pairs): no alignment at all; each program streams one chosen expert's rows, so a
step reads only the selected experts' weights (a pair per program keeps thousands of programs, so
enough bytes are in flight at batch 1). A shared expert of width S*F adds S pairs per token (its
slices read in place, weight 1.0):
    h[p, F]     <- _up_gemv_kernel    one program per (pair, block of F)
    y[p, M]     <- _down_gemv_kernel  one program per (pair, block of M), times the routing weight;
                                      with arrival counters, the last of a token's pairs to finish
                                      a block of M sums them (as _sum_kernel, same order)
    out[t, M]   <- _sum_kernel        as above (without arrival counters)

Router of a few tokens (``moe_gate``): _gate_kernel, the logits of ``rows`` experts per program,
then the last program to arrive routes every token (``_select_experts``, as _route_kernel).

Arrival counters (``_gate_kernel``, the fused k-sum): each program stores its results, a CTA
barrier, then one acq_rel atomic add on its counter; the program that sees the last count reads
the others' results through L2 (``.cg``), writes, and sets the counter back to 0 for the next call.
The order of the sums never depends on which program arrives last, so results are deterministic.

Under the CPU interpreter 16-bit ``tl.dot`` is wrong in Triton 3.6: ``DOT_FP32`` upcasts the tiles.

Files: this one holds the grouped GEMMs and the k-sum (``_up_kernel``, ``_down_kernel``,
``_sum_kernel``); ``router_kernel.py`` the router (``_route_kernel``, ``_gate_kernel``);
``align_kernel.py`` the alignment; ``gemv_kernel.py`` the GEMV path; ``kernel_common.py`` the
@triton.jit pieces they (and ops/fp8's grouped GEMMs) share and the alignment's layout.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fastmamba.ops._common.host_math import cdiv, next_power_of_2
from fastmamba.ops._common.launch import lean
from fastmamba.ops.moe.kernel_common import AlignLayout, _sum_pairs, block_of_program, load_pairs


@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    if IEEE:  # fp32 inputs: full-precision products, not tf32
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["stride_se"])
def _up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_ptr, counts_ptr,
    E, Fdim, Mdim, K,
    stride_xt, stride_xm, stride_we, stride_wf, stride_wm, stride_hr, stride_se,
    BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr, PER_EXPERT: tl.constexpr,
):
    # one program per (block of BM sorted rows = one expert's pairs, block of BLOCK_N of F):
    # h[rows, n] = relu(x[tokens] @ w_up[e, n, :]^T)²
    pid_m, pid_n, e, e_start, e_count, rows_used = block_of_program(counts_ptr, E, Fdim, BM, BLOCK_N, GROUP_M,
                                                                    BLOCK_E)
    if pid_m * BM >= rows_used:
        return
    offs_r = pid_m * BM + tl.arange(0, BM)
    real = (offs_r - e_start) < e_count
    pair = load_pairs(sorted_ptr, e, e_start, offs_r, real, stride_se, PER_EXPERT)
    tok = (pair // K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # weight rows past F wrap around (read, never stored): the weight loads need no mask along N
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xm
    b_ptrs = w_ptr + e.to(tl.int64) * stride_we + (offs_n % Fdim)[None, :] * stride_wf + offs_k[:, None] * stride_wm
    acc = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, Mdim, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=real[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            mk = (k0 + offs_k) < Mdim
            a = tl.load(a_ptrs, mask=real[:, None] & mk[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mk[:, None], other=0.0)
        acc = _dot(a, b, acc, DOT_FP32, IEEE)
        a_ptrs += BLOCK_K * stride_xm
        b_ptrs += BLOCK_K * stride_wm
    acc = tl.maximum(acc, 0.0)
    h = acc * acc
    tl.store(h_ptr + offs_r.to(tl.int64)[:, None] * stride_hr + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=real[:, None] & (offs_n < Fdim)[None, :])


@triton.jit(do_not_specialize=["stride_se"])
def _down_kernel(
    h_ptr, w_ptr, y_ptr, sorted_ptr, counts_ptr, tw_ptr,
    E, Mdim, Fdim, K,
    stride_hr, stride_we, stride_wm, stride_wf, stride_yp, stride_twt, stride_twk, stride_se,
    BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr, PER_EXPERT: tl.constexpr,
):
    # one program per (block of BM sorted rows, block of BLOCK_N of M):
    # y[pair, n] = weight[pair] * h[rows] @ w_down[e, n, :]^T, written at the pair's row
    pid_m, pid_n, e, e_start, e_count, rows_used = block_of_program(counts_ptr, E, Mdim, BM, BLOCK_N, GROUP_M,
                                                                    BLOCK_E)
    if pid_m * BM >= rows_used:
        return
    offs_r = pid_m * BM + tl.arange(0, BM)
    real = (offs_r - e_start) < e_count
    pair = load_pairs(sorted_ptr, e, e_start, offs_r, real, stride_se, PER_EXPERT)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # h's pad rows were never written: masked (real) like x's in the up kernel
    a_ptrs = h_ptr + offs_r.to(tl.int64)[:, None] * stride_hr + offs_k[None, :]
    b_ptrs = w_ptr + e.to(tl.int64) * stride_we + (offs_n % Mdim)[None, :] * stride_wm + offs_k[:, None] * stride_wf
    acc = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, Fdim, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=real[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            mk = (k0 + offs_k) < Fdim
            a = tl.load(a_ptrs, mask=real[:, None] & mk[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mk[:, None], other=0.0)
        acc = _dot(a, b, acc, DOT_FP32, IEEE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wf
    tw = tl.load(tw_ptr + (pair // K) * stride_twt + (pair % K) * stride_twk, mask=real, other=0.0)
    y = acc * tw.to(tl.float32)[:, None]
    tl.store(y_ptr + pair.to(tl.int64)[:, None] * stride_yp + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=real[:, None] & (offs_n < Mdim)[None, :])


@triton.jit
def _sum_kernel(y_ptr, out_ptr, ids_ptr, E, Mdim, stride_yp, stride_ot, stride_om, stride_it, stride_ik,
                K: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr, N_SHARED: tl.constexpr = 0):
    # one program per (token, block of BLOCK_N of M): out[t] = sum_j y[t*(K+N_SHARED) + j], fp32, j in
    # order; a pair whose id lies outside [0, E) was never sorted (its y row is unwritten) and adds nothing
    if USE_PDL:  # y comes from the kernel just before
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < Mdim
    acc = _sum_pairs(y_ptr, ids_ptr, t, offs_n, mn, E, stride_yp, stride_it, stride_ik, K, N_SHARED, BLOCK_N, False)
    tl.store(out_ptr + t * stride_ot + offs_n * stride_om, acc.to(out_ptr.dtype.element_ty), mask=mn)


def launch_grouped(x, w_up, w_down, tw, ids, counts, pairs, layout: AlignLayout, h, y, out, *, block_m: int,
                   block_n_up: int, block_k_up: int, block_n_down: int, block_k_down: int, group_m: int,
                   num_warps: int, num_stages: int, dot_fp32: bool) -> None:
    """The up / down GEMMs and the k-sum after ``launch_align``. h [grouped_rows(P, E, block_m), F]
    and y [P, M] have unit stride along their last dim."""
    T, M = x.shape
    E, F, _ = w_up.shape
    K = ids.shape[1]
    rows = h.shape[0]
    n_blocks_m = rows // block_m
    block_e = max(16, next_power_of_2(E))
    ieee = x.dtype.itemsize == 4
    lean(_up_kernel)[(n_blocks_m * cdiv(F, block_n_up),)](
        x, w_up, h, pairs, counts, E, F, M, K,
        x.stride(0), x.stride(1), w_up.stride(0), w_up.stride(1), w_up.stride(2), h.stride(0), layout.stride,
        BM=block_m, BLOCK_N=block_n_up, BLOCK_K=block_k_up, GROUP_M=group_m, BLOCK_E=block_e,
        EVEN_K=M % block_k_up == 0, DOT_FP32=dot_fp32, IEEE=ieee, PER_EXPERT=layout.per_expert,
        num_warps=num_warps, num_stages=num_stages,
    )
    lean(_down_kernel)[(n_blocks_m * cdiv(M, block_n_down),)](
        h, w_down, y, pairs, counts, tw, E, M, F, K,
        h.stride(0), w_down.stride(0), w_down.stride(1), w_down.stride(2), y.stride(0), tw.stride(0), tw.stride(1),
        layout.stride,
        BM=block_m, BLOCK_N=block_n_down, BLOCK_K=block_k_down, GROUP_M=group_m, BLOCK_E=block_e,
        EVEN_K=F % block_k_down == 0, DOT_FP32=dot_fp32, IEEE=ieee, PER_EXPERT=layout.per_expert,
        num_warps=num_warps, num_stages=num_stages,
    )
    launch_sum(y, out, ids, E)


def launch_sum(y, out, ids, E: int, *, n_shared: int = 0, use_pdl: bool = False) -> None:
    """out [T, M] = the sum over j of y [T*(k+n_shared), M] (routed rows of pairs whose id lies in
    [0, E), then the shared slices' rows)."""
    T, M = out.shape
    block_n = min(1024, next_power_of_2(M))
    lean(_sum_kernel)[(T, cdiv(M, block_n))](
        y, out, ids, E, M, y.stride(0), out.stride(0), out.stride(1), ids.stride(0), ids.stride(1),
        K=ids.shape[1], BLOCK_N=block_n, USE_PDL=use_pdl, N_SHARED=n_shared, num_warps=4, launch_pdl=use_pdl,
    )
