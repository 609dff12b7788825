"""The chunked scan's shared pieces: the strides its launchers pass for optional tensors, and the
@triton.jit helpers of its kernels (``kernel.py``), which the fused (``fused/kernel.py``) and
Hopper (``hopper/chunk_output_kernel.py``) kernels reuse: locating segments and chunks in the flat
token space, the PDL wait, the tensor-core product, the deferred norm's epilogue, rounding a state
into its dtype, a chunk's table entry and its own state contribution.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fastmamba.ops._common.jit_math import exp_approx, stochastic_round


def d_strides(D) -> tuple[int, int]:
    """The (per-head, per-channel) strides the scan kernels read D with: D [H] or [H, P] (a tensor),
    or None -> (0, 0)."""
    if D is None:
        return (0, 0)
    return (D.stride(0), 0) if D.dim() == 1 else (D.stride(0), D.stride(1))


def strides4(t) -> tuple[int, int, int, int]:
    """A 4-d tensor's strides, or (0, 0, 0, 0) for None (an optional state argument)."""
    return tuple(t.stride()) if t is not None else (0, 0, 0, 0)


@triton.jit
def _segment_chunks(cu_ptr, n_seg, Q: tl.constexpr, BLOCK_SEG: tl.constexpr):
    """Every segment's (first token, end token, chunk count, one past its last chunk), [BLOCK_SEG]."""
    offs = tl.arange(0, BLOCK_SEG)
    inside = offs < n_seg
    lo = tl.load(cu_ptr + offs, mask=inside, other=0).to(tl.int32)
    hi = tl.load(cu_ptr + offs + 1, mask=inside, other=0).to(tl.int32)
    n_chunks = (hi - lo + Q - 1) // Q
    return offs, lo, hi, n_chunks, tl.cumsum(n_chunks, 0)


@triton.jit
def _locate_chunk(cu_ptr, n_seg, c, Q: tl.constexpr, BLOCK_SEG: tl.constexpr):
    """Chunk ``c`` of the flat chunk list -> (segment, first flat token, length, valid)."""
    offs, lo, hi, n_chunks, ends = _segment_chunks(cu_ptr, n_seg, Q, BLOCK_SEG)
    seg = tl.sum((ends <= c).to(tl.int32), 0)
    sel = offs == seg
    first = tl.sum(tl.where(sel, ends - n_chunks, 0), 0)
    seg_lo = tl.sum(tl.where(sel, lo, 0), 0)
    seg_hi = tl.sum(tl.where(sel, hi, 0), 0)
    start = seg_lo + (c - first) * Q
    length = tl.minimum(seg_hi - start, Q)
    return seg, start, length, seg < n_seg


@triton.jit
def _locate_segment(cu_ptr, n_seg, seg, Q: tl.constexpr, BLOCK_SEG: tl.constexpr):
    """Segment ``seg`` -> (index of its first chunk, number of chunks, its length in tokens)."""
    offs, lo, hi, n_chunks, ends = _segment_chunks(cu_ptr, n_seg, Q, BLOCK_SEG)
    sel = offs == seg
    count = tl.sum(tl.where(sel, n_chunks, 0), 0)
    first = tl.sum(tl.where(sel, ends, 0), 0) - count
    seg_len = tl.sum(tl.where(sel, hi - lo, 0), 0)
    return first, count, seg_len


@triton.jit
def _wait_for_kernel_before(USE_PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr):
    """Under programmatic dependent launch: wait until the kernel before has finished (its writes
    visible), then, with PDL_TRIGGER, let the next kernel's programs launch. Nothing otherwise."""
    if USE_PDL:
        gdc_wait()
        if PDL_TRIGGER:
            gdc_launch_dependents()


@triton.jit
def _mma(a, b, acc, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """tl.dot(a, b, acc). DOT_UPCAST (set under the CPU interpreter for bf16 operands): the
    operands go in as fp32, since Triton 3.6's interpreter multiplies bf16 operands as their raw
    uint16 bit patterns (see docs/interpreter_bf16.md); never set on a GPU."""
    if DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


NORM_SPAN = tl.constexpr(16)  # columns of y per partial sum of squares in ``norm_sumsq`` (the deferred norm)


@triton.jit
def _defer_norm(y, nw_ptr, sq_rows, h, p0, P, mask_rows, ROWS: tl.constexpr, BLOCK_P: tl.constexpr):
    """The deferred gated RMSNorm's part in the scan (ssd_scan_varlen's ``norm_weight`` /
    ``norm_sumsq``) for the tile y [ROWS, BLOCK_P] of head h, columns p0 .. p0 + BLOCK_P - 1: stores
    the sums of y^2 over each 16 columns (row r's sum over the columns 16 j .. 16 j + 15 of the
    d_inner = H * P wide row goes to ``sq_rows[r] + j``) and returns y * norm_weight. The norm's
    1 / rms is then a per-token scale that the consumer applies (``add_rmsnorm``'s ``pending_norm``).
    BLOCK_P, p0 and P are multiples of 16."""
    SPANS: tl.constexpr = BLOCK_P // NORM_SPAN
    sums = tl.sum(tl.reshape(y * y, (ROWS, SPANS, NORM_SPAN)), axis=2)  # [ROWS, SPANS]
    offs_j = tl.arange(0, SPANS)
    tl.store(sq_rows[:, None] + (h * P + p0) // NORM_SPAN + offs_j[None, :], sums,
             mask=mask_rows[:, None] & (p0 + offs_j[None, :] * NORM_SPAN < P))
    offs_p = p0 + tl.arange(0, BLOCK_P)
    w = tl.load(nw_ptr + h * P + offs_p, mask=offs_p < P, other=0.0).to(tl.float32)
    return y * w[None, :]


@triton.jit
def _to_state_dtype(s, seed_ptr, elem, OUT_DTYPE: tl.constexpr, STOCHASTIC_ROUND: tl.constexpr):
    """fp32 ``s`` -> OUT_DTYPE: rounded to nearest, or stochastically with the random stream of
    the state update (seed ``*seed_ptr``, one number per state element ``elem``: slot, head, p, n)."""
    if STOCHASTIC_ROUND:
        return stochastic_round(s, tl.rand(tl.load(seed_ptr), elem.to(tl.int32)), OUT_DTYPE)
    else:
        return s.to(OUT_DTYPE)


@triton.jit
def _chunk_entry(table_ptr, c):
    """(first flat token, length, segment) of chunk ``c`` from the table ``_chunk_prep_kernel`` wrote."""
    start = tl.load(table_ptr + c * 4)
    length = tl.load(table_ptr + c * 4 + 1)
    seg = tl.load(table_ptr + c * 4 + 2)
    return start, length, seg


@triton.jit
def _local_state(x_chunk, B_chunk, cs_chunk, dt_chunk, length, cs_last, offs_p, offs_n, mp, mn,
                 stride_x_tok, stride_x_p, stride_B_tok, stride_B_n,
                 BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 FAST_MATH: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """A chunk's own state contribution S_loc = sum_s exp(cs_last - cs_s) dt'_s x_s B_s^T, [BLOCK_P,
    BLOCK_N] fp32, BLOCK_K tokens per tensor-core matmul. x_chunk / B_chunk point at the chunk's
    first token (head h / group g); cs_chunk / dt_chunk at its scratch rows."""
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, length, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < length
        w = tl.where(mk, exp_approx(cs_last - tl.load(cs_chunk + offs_k, mask=mk, other=0.0), FAST_MATH)
                     * tl.load(dt_chunk + offs_k, mask=mk, other=0.0), 0.0)
        x_t = tl.load(x_chunk + offs_k[None, :] * stride_x_tok + offs_p[:, None] * stride_x_p,
                      mask=mk[None, :] & mp[:, None], other=0.0)
        b_k = tl.load(B_chunk + offs_k[:, None] * stride_B_tok + offs_n[None, :] * stride_B_n,
                      mask=mk[:, None] & mn[None, :], other=0.0)
        # the weights go on the [P, K] x tile (half the elements of the [K, N] B tile at N = 2P), and
        # B enters the matmul as loaded
        acc = _mma((x_t.to(tl.float32) * w[None, :]).to(x_t.dtype), b_k, acc, DOT_PRECISION, DOT_UPCAST)
    return acc
