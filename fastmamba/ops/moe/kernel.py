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
"""
from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fastmamba.ops._common.host_math import cdiv, next_power_of_2
from fastmamba.ops._common.launch import lean
from fastmamba.ops._common.pdl import pdl_active


# --- router -------------------------------------------------------------------------------------
@triton.jit
def _select_experts(logit, offs_e, me, bias_ptr, EG,
                    HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                    TOP2: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """One token's selection from its fp32 logits [BLOCK_E] (``me``: the real experts): sigmoid, bias
    for selection, grouped top-k (group score = sum of its best two), top-k by repeated argmax (ties:
    the lower id), renorm. Returns (weights [BLOCK_K] fp32 before the scaling, ids [BLOCK_K] int32)."""
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
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        m = tl.max(choice, axis=0)
        i = tl.min(tl.where(choice == m, offs_e, BLOCK_E), axis=0)
        w = tl.sum(tl.where(offs_e == i, score, 0.0), axis=0)
        top_w = tl.where(offs_k == j, w, top_w)
        top_i = tl.where(offs_k == j, i, top_i)
        choice = tl.where(offs_e == i, neg_inf, choice)
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
    top_w, top_i = _select_experts(logit, offs_e, me, bias_ptr, EG, HAS_BIAS, TOP_K, N_GROUP, TOPK_GROUP, TOP2,
                                   RENORM, BLOCK_E, BLOCK_G, BLOCK_K)
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
    if USE_PDL:  # x comes from the kernel just before (the router weights do not)
        gdc_wait()
        gdc_launch_dependents()
    for t in range(T):
        x_ptrs = x_ptr + t * stride_xt + offs_m * stride_xm
        acc = tl.zeros([ROWS, BLOCK_M], dtype=tl.float32)
        for m0 in range(0, Mdim, BLOCK_M):
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
            top_w, top_i = _select_experts(logit, offs_e, me, bias_ptr, EG, HAS_BIAS, TOP_K, N_GROUP, TOPK_GROUP,
                                           TOP2, RENORM, BLOCK_E, BLOCK_G, BLOCK_K)
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


# --- alignment ----------------------------------------------------------------------------------
@triton.jit
def _pair_ids(ids_ptr, offs_p, P, E, K, stride_it, stride_ik):
    """The expert of each pair p = t*K + j in ``offs_p`` and whether it is a real pair with an id in [0, E)."""
    mp = offs_p < P
    e = tl.load(ids_ptr + (offs_p // K) * stride_it + (offs_p % K) * stride_ik, mask=mp, other=0).to(tl.int32)
    ok = mp & (e >= 0) & (e < E)
    return e, ok


@triton.jit
def _padded_starts(counts_ptr, E, BM: tl.constexpr, BLOCK_E: tl.constexpr):
    """Per expert (a [BLOCK_E] vector): its token count, and the start and end of its rows in the
    sorted order, each expert's rows padded to a multiple of BM."""
    offs_e = tl.arange(0, BLOCK_E)
    c = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0)
    padded = (c + BM - 1) // BM * BM
    end = tl.cumsum(padded, axis=0)
    return offs_e, c, end - padded, end


@triton.jit(do_not_specialize=["P"])
def _count_kernel(ids_ptr, counts_ptr, P, E, K, stride_it, stride_ik,
                  BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    # one program per BLOCK_P pairs: a histogram of their experts, added to counts[E]
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    e, ok = _pair_ids(ids_ptr, offs_p, P, E, K, stride_it, stride_ik)
    hist = tl.histogram(e, BLOCK_E, mask=ok)
    offs_e = tl.arange(0, BLOCK_E)
    tl.atomic_add(counts_ptr + offs_e, hist, mask=(offs_e < E) & (hist > 0))


@triton.jit
def _starts_kernel(counts_ptr, cursor_ptr, E, BM: tl.constexpr, BLOCK_E: tl.constexpr):
    # one program: cursor[e] = the first row of expert e (exclusive cumsum of the BM-padded counts)
    offs_e, _, start, _ = _padded_starts(counts_ptr, E, BM, BLOCK_E)
    tl.store(cursor_ptr + offs_e, start, mask=offs_e < E)


@triton.jit(do_not_specialize=["P"])
def _scatter_kernel(ids_ptr, cursor_ptr, sorted_ptr, P, E, K, stride_it, stride_ik, BLOCK_P: tl.constexpr):
    # one program per BLOCK_P pairs: each pair takes the next row of its expert (an atomic cursor)
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    e, ok = _pair_ids(ids_ptr, offs_p, P, E, K, stride_it, stride_ik)
    row = tl.atomic_add(cursor_ptr + e, 1, mask=ok)
    tl.store(sorted_ptr + row, offs_p, mask=ok)


@triton.jit(do_not_specialize=["P", "stride_le"])
def _align_expert_kernel(ids_ptr, counts_ptr, lists_ptr, P, E, K, stride_it, stride_ik, stride_le,
                         BLOCK_P: tl.constexpr):
    # one program per expert, one launch, no atomics: the expert's pairs in pair order into its
    # list (lists[e, :count]) and its count; the GEMMs find each expert's padded rows from the counts
    me = tl.program_id(0)
    offs_j = tl.arange(0, BLOCK_P)
    base = lists_ptr + me.to(tl.int64) * stride_le
    seen = me * 0
    for p0 in range(0, P, BLOCK_P):
        offs_p = p0 + offs_j
        e, ok = _pair_ids(ids_ptr, offs_p, P, E, K, stride_it, stride_ik)
        mine = (ok & (e == me)).to(tl.int32)
        rank = tl.cumsum(mine, axis=0) - 1
        tl.store(base + seen + rank, offs_p, mask=mine > 0)
        seen += tl.sum(mine, axis=0)
    tl.store(counts_ptr + me, seen)


ALIGN_LISTS_MAX = 1 << 22  # E * P int32 entries (16 MiB): up to here per-expert lists in one launch ...
ALIGN_LISTS_MAX_PAIRS = 8192  # ... and up to 8 sequential chunks of 1024 pairs per program


class AlignLayout(NamedTuple):
    """Where the alignment puts each expert's pairs: per-expert lists [E, P] (``stride`` = P; one
    launch) or rows of the BM-padded expert-sorted order (``stride`` = 0; four launches)."""

    per_expert: bool
    entries: int  # int32 entries of the pair buffer
    stride: int


def align_layout(P: int, E: int, block_m: int, lists_max: int | None = None) -> AlignLayout:
    """Per-expert lists while E * P <= ``ALIGN_LISTS_MAX`` and P <= ``ALIGN_LISTS_MAX_PAIRS`` (Nano:
    T <= 1365; Super: T <= 186), else padded rows. ``lists_max`` replaces the first bound alone."""
    if P <= ALIGN_LISTS_MAX_PAIRS and E * P <= (ALIGN_LISTS_MAX if lists_max is None else lists_max):
        return AlignLayout(True, E * P, P)
    return AlignLayout(False, grouped_rows(P, E, block_m), 0)


def launch_align(ids, counts, cursor, pairs, *, E: int, block_m: int, layout: AlignLayout) -> None:
    """ids [T, k]; counts, cursor [E] int32, any contents (written: counts per expert; cursor is
    scratch); pairs [layout.entries] int32 (written at the real pairs' entries only).

    Per-expert lists: ``_align_expert_kernel`` (an expert's pairs in pair order). Padded rows: zero
    the counts, ``_count_kernel``, ``_starts_kernel``, ``_scatter_kernel`` (atomics: the order inside
    an expert varies from run to run, which no output depends on)."""
    T, K = ids.shape
    P = T * K
    if layout.per_expert:
        lean(_align_expert_kernel)[(E,)](ids, counts, pairs, P, E, K, ids.stride(0), ids.stride(1), layout.stride,
                                          BLOCK_P=1024, num_warps=4)
        return
    block_e = max(16, next_power_of_2(E))
    counts.zero_()
    block_p = 256
    grid = (cdiv(P, block_p),)
    lean(_count_kernel)[grid](ids, counts, P, E, K, ids.stride(0), ids.stride(1),
                              BLOCK_P=block_p, BLOCK_E=block_e, num_warps=4)
    lean(_starts_kernel)[(1,)](counts, cursor, E, BM=block_m, BLOCK_E=block_e, num_warps=4)
    lean(_scatter_kernel)[grid](ids, cursor, pairs, P, E, K, ids.stride(0), ids.stride(1),
                                BLOCK_P=block_p, num_warps=4)


# --- grouped GEMMs ------------------------------------------------------------------------------
@triton.jit
def _block_of_program(counts_ptr, E, n_cols, BM: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                      BLOCK_E: tl.constexpr):
    """The (row block, column block) this program owns, in groups of GROUP_M row blocks (weight
    tiles reused from L2 by the blocks of one expert), its expert, the first row of that expert,
    its count of real rows, and the number of rows in use (a block at or past it has nothing to do)."""
    pid = tl.program_id(0)
    n_blocks_n = tl.cdiv(n_cols, BLOCK_N)
    n_blocks_m = tl.num_programs(0) // n_blocks_n
    in_group = GROUP_M * n_blocks_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(n_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    offs_e, c, start, end = _padded_starts(counts_ptr, E, BM, BLOCK_E)
    row0 = pid_m * BM
    # expert of this block: the number of experts whose padded rows end at or before row0
    e = tl.sum(((end <= row0) & (offs_e < E)).to(tl.int32), axis=0)
    e_start = tl.sum(tl.where(offs_e == e, start, 0), axis=0)
    e_count = tl.sum(tl.where(offs_e == e, c, 0), axis=0)
    return pid_m, pid_n, e, e_start, e_count, tl.max(end, axis=0)


@triton.jit
def _load_pairs(pairs_ptr, e, e_start, offs_r, real, stride_se, PER_EXPERT: tl.constexpr):
    """The pair of each row (0 where not real): from expert e's list, or from the padded rows."""
    if PER_EXPERT:
        return tl.load(pairs_ptr + e.to(tl.int64) * stride_se + (offs_r - e_start), mask=real, other=0)
    return tl.load(pairs_ptr + offs_r, mask=real, other=0)


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
    pid_m, pid_n, e, e_start, e_count, rows_used = _block_of_program(counts_ptr, E, Fdim, BM, BLOCK_N, GROUP_M,
                                                                     BLOCK_E)
    if pid_m * BM >= rows_used:
        return
    offs_r = pid_m * BM + tl.arange(0, BM)
    real = (offs_r - e_start) < e_count
    pair = _load_pairs(sorted_ptr, e, e_start, offs_r, real, stride_se, PER_EXPERT)
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
    pid_m, pid_n, e, e_start, e_count, rows_used = _block_of_program(counts_ptr, E, Mdim, BM, BLOCK_N, GROUP_M,
                                                                     BLOCK_E)
    if pid_m * BM >= rows_used:
        return
    offs_r = pid_m * BM + tl.arange(0, BM)
    real = (offs_r - e_start) < e_count
    pair = _load_pairs(sorted_ptr, e, e_start, offs_r, real, stride_se, PER_EXPERT)
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
def _sum_pairs(y_ptr, ids_ptr, t, offs_n, mn, E, stride_yp, stride_it, stride_ik,
               K: tl.constexpr, N_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, CG: tl.constexpr):
    """sum_j y[t*(K+N_SHARED) + j, offs_n] in fp32, j in order: the K routed pairs whose id lies in
    [0, E) (another pair's row adds nothing), then the N_SHARED shared slices. CG: read through L2
    (rows other programs of the running kernel wrote)."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(K + N_SHARED):
        row = y_ptr + (t * (K + N_SHARED) + j) * stride_yp + offs_n
        m = mn
        if j < K:
            e = tl.load(ids_ptr + t * stride_it + j * stride_ik)
            m = mn & (e >= 0) & (e < E)
        if CG:
            acc += tl.load(row, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        else:
            acc += tl.load(row, mask=m, other=0.0).to(tl.float32)
    return acc


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


def grouped_rows(P: int, E: int, block_m: int) -> int:
    """Rows of the sorted, BM-padded order in the worst case: every expert that gets a pair pads
    its rows up to a multiple of BM (at most min(E, P) experts pad, each by at most BM - 1)."""
    rows = P + min(E, P) * (block_m - 1)
    return cdiv(rows, block_m) * block_m


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


# --- GEMV path (few tokens) ---------------------------------------------------------------------
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
def _up_gemv_kernel(
    x_ptr, w_ptr, sw_ptr, h_ptr, ids_ptr,
    E, Fdim, Mdim,
    stride_xt, stride_xm, stride_we, stride_wf, stride_wm, stride_sf, stride_hp, stride_it, stride_ik,
    K: tl.constexpr, N_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # one program per (pair p = t*(K+N_SHARED) + j, block of BLOCK_N of F):
    # h[p, n] = relu(w[n, :] @ x[t])², w = w_up[ids[t, j]] or slice j-K of the shared up_proj
    # (both have stride_wm along M)
    if USE_PDL:  # ids and x come from the kernels just before: nothing to read earlier
        gdc_wait()
        gdc_launch_dependents()
    p = tl.program_id(0)
    t, _, _, ok, base, row_stride = _gemv_pair(ids_ptr, w_ptr, sw_ptr, p, E, Fdim, stride_it, stride_ik, stride_we,
                                               stride_wf, stride_sf, stride_wm, K, N_SHARED, True)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mn = (offs_n < Fdim) & ok
    x_ptrs = x_ptr + t.to(tl.int64) * stride_xt + offs_k * stride_xm
    w_ptrs = base + offs_n[:, None] * row_stride + offs_k[None, :] * stride_wm
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, Mdim, BLOCK_K):
        if EVEN_K:
            xv = tl.load(x_ptrs)
            w = tl.load(w_ptrs, mask=mn[:, None], other=0.0)
        else:
            mk = (k0 + offs_k) < Mdim
            xv = tl.load(x_ptrs, mask=mk, other=0.0)
            w = tl.load(w_ptrs, mask=mn[:, None] & mk[None, :], other=0.0)
        acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
        x_ptrs += BLOCK_K * stride_xm
        w_ptrs += BLOCK_K * stride_wm
    hv = tl.maximum(tl.sum(acc, axis=1), 0.0)
    tl.store(h_ptr + p.to(tl.int64) * stride_hp + offs_n, (hv * hv).to(h_ptr.dtype.element_ty), mask=offs_n < Fdim)


@triton.jit
def _down_gemv_kernel(
    h_ptr, w_ptr, sw_ptr, y_ptr, ids_ptr, tw_ptr, out_ptr, arrivals_ptr,
    E, Mdim, Fdim,
    stride_hp, stride_we, stride_wm, stride_wf, stride_sm, stride_yp, stride_it, stride_ik, stride_twt, stride_twk,
    stride_ot, stride_om,
    K: tl.constexpr, N_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr, FUSED_SUM: tl.constexpr,
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
    acc = w.to(tl.float32) * hv.to(tl.float32)[None, :]
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
        acc += w.to(tl.float32) * hv.to(tl.float32)[None, :]
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wf
    y = tl.sum(acc, axis=1) * tw
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
                arrivals=None) -> None:
    """h [P, F], y [P, M] (unit stride along the last dim; P = T*(k+S)): each pair's relu²
    activations and its weighted contribution, written then read; then the fixed-order sum into
    out [T, M]: by the down kernel's last arrivals when ``arrivals`` (int32, at least
    T * cdiv(M, block_n_down) zeros, left zero) is given, else by ``_sum_kernel``.

    shared_up [S*F, M], shared_down [M, S*F] (or None): a relu² shared expert run as S more pairs of
    weight 1.0 per token (its strides along M and F equal w_up's and w_down's).

    Under programmatic dependent launch (``fastmamba.ops._common.pdl``, grids of one wave) the down
    kernel reads the ids, the routing weights and its first weight tile before its wait: the kernel
    launched just before ``fused_moe`` must not write the weights (ids and routing weights are
    read by the up kernel first, after its wait)."""
    T, M = x.shape
    E, F, _ = w_up.shape
    K = ids.shape[1]
    S = 0 if shared_up is None else shared_up.shape[0] // F
    P = T * (K + S)
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
        num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl_up,
    )
    fused_sum = arrivals is not None
    lean(_down_gemv_kernel)[grid_down](
        h, w_down, shared_down, y, ids, tw, out, arrivals, E, M, F,
        h.stride(0), w_down.stride(0), w_down.stride(1), w_down.stride(2), sm, y.stride(0),
        ids.stride(0), ids.stride(1), tw.stride(0), tw.stride(1), out.stride(0), out.stride(1),
        K=K, N_SHARED=S, BLOCK_N=block_n_down, BLOCK_K=block_k_down, EVEN_K=F % block_k_down == 0,
        USE_PDL=pdl_down, FUSED_SUM=fused_sum, num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl_down,
    )
    if not fused_sum:
        launch_sum(y, out, ids, E, n_shared=S,
                   use_pdl=pdl_active(x, T * cdiv(M, min(1024, next_power_of_2(M))), 4))
