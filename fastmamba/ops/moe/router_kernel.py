"""The router's kernels: ``_route_kernel`` (``moe_route``, one program per token, from the
logits) and ``_gate_kernel`` (``moe_gate``, a few tokens: the router GEMV, then the last program to
arrive routes every token); both select through ``_select_experts``. Arrival counters: see
``kernel.py``'s docstring."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fastmamba.ops._common.host_math import cdiv, next_power_of_2
from fastmamba.ops._common.launch import lean


@triton.jit
def _select_experts(logit, logit_row_ptr, stride_le, offs_e, me, bias_ptr, EG,
                    HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                    TOP2: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """One token's selection from its fp32 logits [BLOCK_E] (``me``: the real experts; the same
    logits are in memory at ``logit_row_ptr``, ``stride_le`` apart): sigmoid, bias for selection,
    grouped top-k (group score = sum of its best two), top-k by repeated argmax (ties: the lower id),
    renorm. Returns (weights [BLOCK_K] fp32 before the scaling, ids [BLOCK_K] int32).

    Each argmax is one int64 max over (the choice's bits mapped to a signed order, then BLOCK_E-1-id):
    the larger choice, and on a tie the lower id, as max-then-min-id gives in two reductions; the
    chosen experts' scores are then read back from memory (one gather) instead of a third reduction
    per expert."""
    score = 1.0 / (1.0 + tl.exp(-logit))
    choice = score
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + offs_e, mask=me, other=0.0).to(tl.float32)
    neg_inf = float("-inf")
    choice = tl.where(me, choice, neg_inf)
    if N_GROUP > 1:
        # in_g[g, e]: expert e belongs to group g (E // N_GROUP experts per group)
        offs_g = tl.arange(0, BLOCK_G)
        in_g = ((offs_e[None, :] // EG) == offs_g[:, None]) & me[None, :]
        cg = tl.where(in_g, choice[None, :], neg_inf)  # [BLOCK_G, BLOCK_E]
        best1 = tl.max(cg, axis=1)
        group_score = best1
        if TOP2:  # a group's score: the sum of its two best choices
            first = tl.min(tl.where(in_g & (cg == best1[:, None]), offs_e[None, :], BLOCK_E), axis=1)
            best2 = tl.max(tl.where(offs_e[None, :] == first[:, None], neg_inf, cg), axis=1)
            group_score = best1 + best2
        group_score = tl.where(offs_g < N_GROUP, group_score, neg_inf)
        keep_g = offs_g < 0  # all False
        for _ in tl.static_range(TOPK_GROUP):
            gm = tl.max(group_score, axis=0)
            gi = tl.min(tl.where(group_score == gm, offs_g, BLOCK_G), axis=0)
            keep_g = keep_g | (offs_g == gi)
            group_score = tl.where(offs_g == gi, neg_inf, group_score)
        keep_e = tl.max((in_g & keep_g[:, None]).to(tl.int32), axis=0) > 0
        choice = tl.where(keep_e, choice, neg_inf)
    offs_k = tl.arange(0, BLOCK_K)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    bits = choice.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed-int order = float order (no NaN)
    key = (ordered.to(tl.int64) << 32) | (BLOCK_E - 1 - offs_e).to(tl.int64)
    taken = tl.full([BLOCK_E], -9223372036854775807 - 1, tl.int64)
    for j in tl.static_range(TOP_K):
        i = (BLOCK_E - 1) - (tl.max(key, axis=0) & 0xFFFFFFFF).to(tl.int32)
        top_i = tl.where(offs_k == j, i, top_i)
        key = tl.where(offs_e == i, taken, key)
    mk = offs_k < TOP_K
    top_logit = tl.load(logit_row_ptr + top_i * stride_le, mask=mk, other=0.0, cache_modifier=".cg").to(tl.float32)
    top_w = tl.where(mk, 1.0 / (1.0 + tl.exp(-top_logit)), 0.0)
    if RENORM:
        top_w = top_w / (tl.sum(top_w, axis=0) + 1e-20)
    return top_w, top_i


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,
    E, EG, scale,
    stride_lt, stride_le, stride_wt, stride_it,
    HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    TOP2: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # one program per token: sigmoid, bias, grouped selection, top-k by repeated argmax, renorm, scale
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    me = offs_e < E
    logit = tl.load(logits_ptr + t * stride_lt + offs_e * stride_le, mask=me, other=0.0).to(tl.float32)
    top_w, top_i = _select_experts(logit, logits_ptr + t * stride_lt, stride_le, offs_e, me, bias_ptr, EG, HAS_BIAS,
                                   TOP_K, N_GROUP, TOPK_GROUP, TOP2, RENORM, BLOCK_E, BLOCK_G, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    mk = offs_k < TOP_K
    tl.store(weights_ptr + t * stride_wt + offs_k, top_w * scale, mask=mk)
    tl.store(ids_ptr + t * stride_it + offs_k, top_i, mask=mk)


def launch_route(logits, bias, weights, ids, *, top_k: int, n_group: int, topk_group: int, renorm: bool,
                 scale: float) -> None:
    """logits [T, E]; bias [E] contiguous or None; weights [T, k] fp32 and ids [T, k] int32, unit stride along k."""
    T, E = logits.shape
    EG = E // n_group
    lean(_route_kernel)[(T,)](
        logits, bias, weights, ids, E, EG, float(scale),
        logits.stride(0), logits.stride(1), weights.stride(0), ids.stride(0),
        HAS_BIAS=bias is not None, TOP_K=top_k, N_GROUP=n_group, TOPK_GROUP=topk_group, TOP2=EG >= 2,
        RENORM=renorm, BLOCK_E=next_power_of_2(E), BLOCK_G=next_power_of_2(n_group),
        BLOCK_K=next_power_of_2(top_k), num_warps=4 if E >= 256 else 1,
    )


@triton.jit(do_not_specialize=["T"])
def _gate_kernel(
    x_ptr, w_ptr, bias_ptr, logits_ptr, weights_ptr, ids_ptr, arrivals_ptr,
    T, E, Mdim, EG, scale,
    stride_xt, stride_xm, stride_we, stride_wm, stride_wt, stride_it,
    HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    TOP2: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_M: tl.constexpr, USE_PDL: tl.constexpr,
):
    # one program per ROWS experts: their logits for the T tokens (the fp32 router weights times x
    # read in its own dtype, fp32 accumulation) into logits [T, E]; the last program to finish (an
    # arrival counter, reset by it) then routes every token as _route_kernel does
    g = tl.program_id(0)
    offs_r = g * ROWS + tl.arange(0, ROWS)
    mr = offs_r < E
    offs_m = tl.arange(0, BLOCK_M)
    w_ptrs = w_ptr + offs_r.to(tl.int64)[:, None] * stride_we + offs_m[None, :] * stride_wm
    # the first tile of the router weights is read before the wait (no kernel writes them)
    if EVEN_M:
        w_first = tl.load(w_ptrs, mask=mr[:, None], other=0.0)
    else:
        w_first = tl.load(w_ptrs, mask=mr[:, None] & (offs_m < Mdim)[None, :], other=0.0)
    if USE_PDL:  # x comes from the kernel just before (the router weights do not)
        gdc_wait()
        gdc_launch_dependents()
    for t in range(T):
        x_ptrs = x_ptr + t * stride_xt + offs_m * stride_xm
        xv = tl.load(x_ptrs, mask=offs_m < Mdim, other=0.0)
        acc = w_first.to(tl.float32) * xv.to(tl.float32)[None, :]
        for m0 in range(BLOCK_M, Mdim, BLOCK_M):
            if EVEN_M:
                xv = tl.load(x_ptrs + m0 * stride_xm)
                w = tl.load(w_ptrs + m0 * stride_wm, mask=mr[:, None], other=0.0)
            else:
                mm = (m0 + offs_m) < Mdim
                xv = tl.load(x_ptrs + m0 * stride_xm, mask=mm, other=0.0)
                w = tl.load(w_ptrs + m0 * stride_wm, mask=mr[:, None] & mm[None, :], other=0.0)
            acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
        tl.store(logits_ptr + t * E + offs_r, tl.sum(acc, axis=1), mask=mr)
    # every thread's logits are stored before the arrival is counted (release), and the last program
    # reads the others' through L2 (.cg) after its acquire
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        offs_e = tl.arange(0, BLOCK_E)
        me = offs_e < E
        offs_k = tl.arange(0, BLOCK_K)
        mk = offs_k < TOP_K
        for t in range(T):
            logit = tl.load(logits_ptr + t * E + offs_e, mask=me, other=0.0, cache_modifier=".cg")
            top_w, top_i = _select_experts(logit, logits_ptr + t * E, 1, offs_e, me, bias_ptr, EG, HAS_BIAS, TOP_K,
                                           N_GROUP, TOPK_GROUP, TOP2, RENORM, BLOCK_E, BLOCK_G, BLOCK_K)
            tl.store(weights_ptr + t * stride_wt + offs_k, top_w * scale, mask=mk)
            tl.store(ids_ptr + t * stride_it + offs_k, top_i, mask=mk)
        tl.store(arrivals_ptr, 0)  # ready for the next call (the kernel boundary publishes it)


def launch_gate(x, w, bias, logits, weights, ids, arrivals, *, top_k: int, n_group: int, topk_group: int,
                renorm: bool, scale: float, rows: int, block_m: int, num_warps: int = 4, use_pdl: bool = False) -> None:
    """x [T, M] any float dtype and strides; w [E, M] fp32 (rows of ``rows`` experts per program);
    bias [E] contiguous or None; logits [T, E] fp32 contiguous (scratch, written); weights [T, k]
    fp32 and ids [T, k] int32 with unit stride along k (written); arrivals: an int32 counter that is 0
    (left 0)."""
    T, M = x.shape
    E = w.shape[0]
    EG = E // n_group
    lean(_gate_kernel)[(cdiv(E, rows),)](
        x, w, bias, logits, weights, ids, arrivals, T, E, M, EG, float(scale),
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), weights.stride(0), ids.stride(0),
        HAS_BIAS=bias is not None, TOP_K=top_k, N_GROUP=n_group, TOPK_GROUP=topk_group, TOP2=EG >= 2,
        RENORM=renorm, BLOCK_E=next_power_of_2(E), BLOCK_G=next_power_of_2(n_group),
        BLOCK_K=next_power_of_2(top_k), ROWS=rows, BLOCK_M=block_m, EVEN_M=M % block_m == 0, USE_PDL=use_pdl,
        num_warps=num_warps, launch_pdl=use_pdl,
    )
