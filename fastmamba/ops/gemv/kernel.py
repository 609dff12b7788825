"""Triton kernel: y = x @ W^T (+ bias) for a few rows of x (decode-time projections).

At decode batch sizes a linear layer is a matrix-vector product: it streams the weight matrix once
and does two flops per weight byte, so it is bound by HBM bandwidth, and by how soon the stream
starts. One program per block of BLOCK_N output features walks K in BLOCK_K steps, each a
[BLOCK_N, BLOCK_K] weight tile loaded with 16-byte vectors along K (the weight's contiguous dim);
the M <= BLOCK_M rows of x are tiny and come from L2. Under programmatic dependent launch (PDL) the
first weight tile is loaded before the grid-dependency wait (a weight is never written by the
kernel before), so the stream starts while the previous kernel finishes.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fastmamba.ops._common.dispatch import interpreter_enabled
from fastmamba.ops._common.launch import lean
from fastmamba.ops._common.host_math import cdiv, next_power_of_2


@triton.jit
def _gemv_tile(acc, x_ptr, w, offs_m, offs_k, M, K, stride_xm, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
               EVEN: tl.constexpr):
    """acc + x[:, offs_k] @ w^T; w [BLOCK_N, BLOCK_K] (weight dtype)."""
    if EVEN:
        xm = offs_m[:, None] < M
    else:
        xm = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=xm, other=0.0)  # [BLOCK_M, BLOCK_K]
    if USE_DOT:  # tensor cores; the padded rows of x are zeros
        if DOT_FP32:  # (the CPU interpreter, whose 16-bit tl.dot is wrong in Triton 3.6)
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x.to(w.dtype), tl.trans(w), acc)
    else:  # one row: fp32 FMAs, [BLOCK_N, BLOCK_K] partial sums reduced at the end
        acc += w.to(tl.float32) * x.to(tl.float32)
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, EVEN: tl.constexpr, USE_PDL: tl.constexpr,
):
    # one program per block of BLOCK_N output features, all M rows
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_kb = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    mn = offs_n < N
    if EVEN:
        w = tl.load(w_rows + offs_kb[None, :])
    else:
        w = tl.load(w_rows + offs_kb[None, :], mask=mn[:, None] & (offs_kb[None, :] < K), other=0.0)
    if USE_PDL:
        gdc_wait()  # x comes from the kernel before; the first weight tile is already in flight
        gdc_launch_dependents()
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc = _gemv_tile(acc, x_ptr, w, offs_m, offs_kb, M, K, stride_xm, USE_DOT, DOT_FP32, EVEN)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + offs_kb
        if EVEN:
            w = tl.load(w_rows + offs_k[None, :])
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=mn[:, None] & (offs_k[None, :] < K), other=0.0)
        acc = _gemv_tile(acc, x_ptr, w, offs_m, offs_k, M, K, stride_xm, USE_DOT, DOT_FP32, EVEN)
    if USE_DOT:
        y = acc  # [BLOCK_M, BLOCK_N]
    else:
        y = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & mn[None, :])


def launch_gemv(x, weight, bias, y, *, block_n: int, block_k: int, num_warps: int, num_stages: int,
                use_dot: bool, use_pdl: bool) -> None:
    """x (M, K), y (M, N): unit stride along the last dim; weight (N, K) with unit stride along K;
    bias (N,) or None. ``use_dot`` False needs M == 1."""
    M, K = x.shape
    N = weight.shape[0]
    block_m = max(16, next_power_of_2(M)) if use_dot else 1
    lean(_gemv_kernel)[(cdiv(N, block_n),)](
        x, weight, bias, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        USE_DOT=use_dot, DOT_FP32=interpreter_enabled(), EVEN=(N % block_n == 0 and K % block_k == 0), USE_PDL=use_pdl,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=use_pdl,
    )
