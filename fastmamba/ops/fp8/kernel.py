"""Triton kernels of the FP8 ops (e4m3 = ``tl.float8e4nv`` = ``torch.float8_e4m3fn``), one
launcher per kernel. The math each implements is in ``ref.py``; the checks are in ``api.py``.

Quantisation divides with ``div_rn`` (IEEE round-to-nearest, like torch's ``/``), clamps to
+-448 and rounds to the e4m3 grid in fp32 (``_round_e4m3``) before the cast, so the bytes it
writes equal the reference's. The explicit rounding is there for the CPU interpreter, whose
fp32 -> fp8e4nv cast does not round to nearest even (124.3 became 64, 100 became 104, subnormals
flushed: Triton 3.6); on a GPU the cast of an already representable value is exact, so it costs
a few ALU ops in a bandwidth-bound kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastmamba.ops.fp8.ref import AMAX_FLOOR, FP8_MAX


@triton.jit
def _round_e4m3(x):
    """fp32 x with |x| <= 448 -> the nearest e4m3 value (ties to even) as fp32: the grid step is
    2^(e - 3) for exponent e >= -6 and 2^-9 below (subnormals); x * (1 / step) is exact (powers of two),
    and adding then subtracting 1.5 * 2^23 rounds it to an integer, ties to even."""
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    g = tl.maximum(e, -6) - 3
    step = ((g + 127) << 23).to(tl.float32, bitcast=True)
    y = x * ((127 - g) << 23).to(tl.float32, bitcast=True)   # x / step, exact
    r = (y + 12582912.0) - 12582912.0
    return tl.where(r == 0.0, x * 0.0, r * step)  # a zero keeps x's sign (-0.0 as torch's cast)


@triton.jit(do_not_specialize=["T"])
def _quantize_per_token_kernel(x_ptr, q_ptr, s_ptr, T, K, stride_x_t, stride_q_t,
                               AMAX_MIN: tl.constexpr, QMAX: tl.constexpr, BLOCK_K: tl.constexpr):
    # one program per row t: amax over K (first pass), then scale and cast (second pass)
    t = tl.program_id(0)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * stride_x_t + k, mask=k < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.div_rn(tl.maximum(tl.max(amax, axis=0), AMAX_MIN), QMAX)
    tl.store(s_ptr + t, scale)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * stride_x_t + k, mask=k < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.div_rn(x, scale + tl.zeros_like(x)), -QMAX), QMAX)
        tl.store(q_ptr + t * stride_q_t + k, _round_e4m3(q.to(tl.float32)).to(tl.float8e4nv), mask=k < K)


def launch_quantize_per_token(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """x [T, K] (unit stride along K) -> q [T, K] e4m3, s [T] fp32 (written)."""
    T, K = x.shape
    block = min(1024, triton.next_power_of_2(max(K, 16)))
    _quantize_per_token_kernel[(T,)](x, q, s, T, K, x.stride(0), q.stride(0),
                                     AMAX_MIN=AMAX_FLOOR, QMAX=FP8_MAX, BLOCK_K=block, num_warps=4)


@triton.jit(do_not_specialize=["T"])
def _quantize_static_kernel(x_ptr, q_ptr, s_ptr, T, K, stride_x_t, stride_q_t,
                            QMAX: tl.constexpr, BLOCK_K: tl.constexpr):
    # one program per (row t, block of K): one scale for the whole tensor
    t = tl.program_id(0)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + t * stride_x_t + k, mask=k < K, other=0.0).to(tl.float32)
    scale = tl.load(s_ptr) + tl.zeros_like(x)
    q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -QMAX), QMAX)
    tl.store(q_ptr + t * stride_q_t + k, _round_e4m3(q.to(tl.float32)).to(tl.float8e4nv), mask=k < K)


def launch_quantize_static(x: torch.Tensor, scale: torch.Tensor, q: torch.Tensor) -> None:
    """x [T, K] (unit stride along K), scale one fp32 value -> q [T, K] e4m3 (written)."""
    T, K = x.shape
    block = min(1024, triton.next_power_of_2(max(K, 16)))
    _quantize_static_kernel[(T, triton.cdiv(K, block))](x, q, scale, T, K, x.stride(0), q.stride(0),
                                                       QMAX=FP8_MAX, BLOCK_K=block, num_warps=4)


@triton.heuristics({"HAS_BIAS": lambda a: a["b_ptr"] is not None})
@triton.jit(do_not_specialize=["T"])
def _fp8_gemv_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, T, N, K,
                     stride_x_t, stride_w_n, stride_sw_n, stride_y_t,
                     HAS_BIAS: tl.constexpr, QUANT: tl.constexpr, USE_DOT: tl.constexpr,
                     AMAX_MIN: tl.constexpr, QMAX: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # one program per block of N output features, all T (<= BLOCK_T) rows: each weight tile is read
    # once. USE_DOT: an e4m3 x e4m3 tensor-core dot over rows padded to 16; else FMA (1-2 rows).
    # QUANT 0: x is e4m3 with row scales sx; 1: x in 16/32 bits, quantised here per token (a first
    # pass over x for the row maxima; x is small and L2-resident); 2: x quantised here with the
    # static scale sx[0]. Products of two e4m3 values are exact in fp32; sums in fp32.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, BLOCK_T)
    if QUANT == 0:
        sx = tl.load(sx_ptr + t, mask=t < T, other=0.0)
    elif QUANT == 1:
        amax = tl.zeros([BLOCK_T], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xa = tl.load(x_ptr + t[:, None] * stride_x_t + k[None, :], mask=(t[:, None] < T) & (k[None, :] < K),
                         other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(xa), axis=1))
        sx = tl.div_rn(tl.maximum(amax, AMAX_MIN), QMAX + tl.zeros_like(amax))
    else:
        sx = tl.load(sx_ptr) + tl.zeros([BLOCK_T], dtype=tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + n[:, None] * stride_w_n + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K),
                    other=0.0)                                                   # [BLOCK_N, BLOCK_K] e4m3
        x = tl.load(x_ptr + t[:, None] * stride_x_t + k[None, :], mask=(t[:, None] < T) & (k[None, :] < K),
                    other=0.0)                                                   # [BLOCK_T, BLOCK_K]
        if QUANT != 0:  # the e4m3 value as fp32 (exact), as quantize_per_token / quantize_static write it
            xf = x.to(tl.float32)
            xq = tl.minimum(tl.maximum(tl.div_rn(xf, sx[:, None] + tl.zeros_like(xf)), -QMAX), QMAX)
            x = _round_e4m3(xq)
            if USE_DOT:
                x = x.to(tl.float8e4nv)
        if USE_DOT:
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    sw = tl.load(sw_ptr + n * stride_sw_n, mask=n < N, other=0.0)
    y = acc * sx[:, None] * sw[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + t[:, None] * stride_y_t + n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(t[:, None] < T) & (n[None, :] < N))


FMA_MAX_ROWS = 2  # more rows take the tensor-core dot (rows padded to 16)
FUSE_QUANT = True  # fp8_gemv quantises x inside the GEMV (False: a quantisation kernel first; for the bench)


def launch_fp8_gemv(x: torch.Tensor, sx: torch.Tensor | None, w: torch.Tensor, sw: torch.Tensor,
                    bias: torch.Tensor | None, y: torch.Tensor, *, quant: int) -> None:
    """x [T, K] (unit stride along K): e4m3 with sx [T] fp32 (quant 0), or 16/32-bit quantised in
    the kernel per token (quant 1, sx None) or with the one static scale sx (quant 2); w [N, K] e4m3,
    sw [N] fp32 (stride 0 for one scale), bias [N] or None -> y [T, N] (written). T <= 16.
    Untuned first cut (a configs.py table comes with the GPU benchmark: python -m fastmamba.bench fp8)."""
    T, K = x.shape
    N = w.shape[0]
    use_dot = T > FMA_MAX_ROWS
    block_t = 16 if use_dot else T
    block_n = 64 if use_dot else 32
    block_k = min(128, max(32, triton.next_power_of_2(K)))
    _fp8_gemv_kernel[(triton.cdiv(N, block_n),)](x, sx if sx is not None else sw, w, sw, bias, y, T, N, K,
                                                 x.stride(0), w.stride(0), sw.stride(0), y.stride(0), QUANT=quant,
                                                 USE_DOT=use_dot, AMAX_MIN=AMAX_FLOOR, QMAX=FP8_MAX,
                                                 BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)


@triton.jit(do_not_specialize=["P"])
def _moe_pair_gemv_kernel(q_ptr, sq_ptr, w_ptr, s_ptr, ids_ptr, tw_ptr, out_ptr, P, N, K, TOP_K,
                          stride_q_r, stride_w_e, stride_w_n, stride_s_e, stride_se_n, stride_o_p,
                          Q_PER_PAIR: tl.constexpr, RELU2: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # one program per (token-expert pair p = t * TOP_K + j, block of BLOCK_N outputs): the pair's
    # expert rows are streamed once (only the chosen experts are read), e4m3 x e4m3 products summed
    # in fp32. The input row is q[t] (up: Q_PER_PAIR False) or q[p] (down: Q_PER_PAIR True).
    # RELU2 (up): out = relu(acc * sq * s)^2; else (down): out = acc * sq * s * topk_weight[p].
    # An expert id outside [0, E) is not read and writes zeros.
    p = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = p // TOP_K
    row = p if Q_PER_PAIR else t
    e = tl.load(ids_ptr + p).to(tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(q_ptr + row * stride_q_r + k, mask=k < K, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e * stride_w_e + n[:, None] * stride_w_n + k[None, :],
                    mask=(n[:, None] < N) & (k[None, :] < K) & (e >= 0), other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    sw = tl.load(s_ptr + e * stride_s_e + n * stride_se_n, mask=(n < N) & (e >= 0), other=0.0)
    y = acc * tl.load(sq_ptr + row) * sw
    if RELU2:
        y = tl.maximum(y, 0.0)
        y = y * y
    else:
        y = y * tl.load(tw_ptr + p)
    tl.store(out_ptr + p * stride_o_p + n, y, mask=n < N)


def launch_moe_pair_gemv(q: torch.Tensor, sq: torch.Tensor, w: torch.Tensor, s: torch.Tensor, ids: torch.Tensor,
                         tw: torch.Tensor, out: torch.Tensor, *, top_k: int, per_pair: bool, relu2: bool) -> None:
    """q [T or P, K] e4m3 (unit stride along K), sq [T or P] fp32; w [E, N, K] e4m3 (unit stride
    along K); s [E, N] fp32 (stride 0 along N for per-tensor scales); ids [P] int32, the flattened
    [T, top_k] (an id outside [0, E) must come as -1: see fp8_moe); tw [P] fp32; out [P, N] fp32
    (written)."""
    P = ids.shape[0]
    E, N, K = w.shape
    block_n = 32
    block_k = min(128, max(32, triton.next_power_of_2(K)))
    _moe_pair_gemv_kernel[(P, triton.cdiv(N, block_n))](
        q, sq, w, s, ids, tw, out, P, N, K, top_k, q.stride(0), w.stride(0), w.stride(1), s.stride(0),
        s.stride(1), out.stride(0), Q_PER_PAIR=per_pair, RELU2=relu2, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4)
