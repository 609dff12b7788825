"""Public entry of ``gemv``: a linear layer applied to a few rows (decode-time projections)."""
from __future__ import annotations

import math

import torch

from fastmamba.ops._common.checks import check_dtype, check_same_device, check_same_dtype, check_unit_stride
from fastmamba.ops._common.dispatch import use_triton
from fastmamba.ops._common.host_math import cdiv
from fastmamba.ops._common.pdl import pdl_active
from fastmamba.ops.gemv.configs import MAX_ROWS, pick_config
from fastmamba.ops.gemv.kernel import launch_gemv
from fastmamba.ops.gemv.ref import gemv_ref

_OP = "gemv"
HALF_DTYPES = (torch.float16, torch.bfloat16)


def gemv_covers(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a decode-time projection ``F.linear(x, weight)`` should run as ``gemv``: CUDA, x fp16
    / bf16 with the weight's dtype (not an FP8 weight), at most ``MAX_ROWS`` rows, unit stride along K
    in both (where cuBLAS's small-M kernels read the weight at 65-75% of the copy rate)."""
    return (x.is_cuda and x.dtype in HALF_DTYPES and weight.dtype == x.dtype and x.dim() >= 1
            and x.numel() <= MAX_ROWS * x.shape[-1] and x.stride(-1) == 1 and weight.stride(-1) == 1)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for at most 16 rows of x, as one bandwidth-bound kernel.

    x       (..., K)  fp16 or bf16, unit stride along K, at most ``MAX_ROWS`` = 16 rows in all
    weight  (N, K)    x's dtype, unit stride along K (an ``nn.Linear`` weight); read only
    bias    (N,)      x's dtype, or None
    out     (..., N)  optional, x's dtype, contiguous; written
    Returns y (..., N) in x's dtype (``out`` when given); fp32 accumulation. Under programmatic
    dependent launch (``fastmamba.ops._common.pdl``) the first weight tile is read before the wait:
    the kernel launched just before must not write ``weight``.
    Reference: fastmamba.ops.gemv.ref.gemv_ref
    """
    check_dtype(_OP, "x", x, HALF_DTYPES)
    check_same_dtype(_OP, [("x", x), ("weight", weight)] + ([("bias", bias)] if bias is not None else []))
    check_same_device(_OP, [("x", x), ("weight", weight), ("bias", bias), ("out", out)])
    if weight.dim() != 2 or x.dim() < 1 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{_OP}: `weight` expected shape (N, K={x.shape[-1] if x.dim() else '?'}) "
                         f"(K = x's last dim), got {tuple(weight.shape)}")
    N, K = weight.shape
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"{_OP}: `bias` expected shape ({N},), got {tuple(bias.shape)}")
    check_unit_stride(_OP, "x", x, -1)
    check_unit_stride(_OP, "weight", weight, 1)
    lead = tuple(x.shape[:-1])
    M = math.prod(lead)
    if M > MAX_ROWS:
        raise ValueError(f"{_OP}: x has {M} rows; at most {MAX_ROWS} (a matrix-vector product; use F.linear for more)")
    if out is not None:
        check_dtype(_OP, "out", out, (x.dtype,))
        if tuple(out.shape) != lead + (N,) or not out.is_contiguous():
            raise ValueError(f"{_OP}: `out` expected a contiguous tensor of shape {lead + (N,)}, got "
                             f"{tuple(out.shape)} (contiguous: {out.is_contiguous()})")
    if not use_triton(x):
        y = gemv_ref(x, weight, bias)
        return y if out is None else out.copy_(y)
    y = out if out is not None else torch.empty(lead + (N,), dtype=x.dtype, device=x.device)
    if M and N and not K:  # an empty sum
        y.copy_(bias.expand(lead + (N,)) if bias is not None else torch.zeros((), dtype=y.dtype, device=y.device))
    elif M and N:
        cfg = pick_config(M, K, N, device=x.device, dtype=x.dtype)
        # x.reshape: a view for the usual row-strided x
        launch_gemv(x.reshape(M, K), weight, bias, y.view(M, N), block_n=cfg.block_n, block_k=cfg.block_k,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages, use_dot=cfg.use_dot,
                    use_pdl=pdl_active(x, cdiv(N, cfg.block_n), cfg.num_warps))
    return y
