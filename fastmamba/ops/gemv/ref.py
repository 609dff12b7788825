"""Plain-PyTorch reference of ``gemv``: y = x @ weight^T + bias, fp32 inside."""
from __future__ import annotations

import torch

from fastmamba.ops.add_rmsnorm.ref import add_rmsnorm_ref


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K), weight (N, K), bias (N,) or None -> y (..., N) in x's dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def rmsnorm_gemv_ref(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None, *, eps: float, group_size: int) -> torch.Tensor:
    """The two ops it fuses, as the unfused layer runs them: the grouped RMSNorm of x (fp32 inside,
    rounded to x's dtype), then ``gemv_ref``. x (..., K), norm_weight (K,), weight (N, K)."""
    K = x.shape[-1]
    xf = x.float().reshape(*x.shape[:-1], K // group_size, group_size)
    normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    normed = (normed.reshape(x.shape) * norm_weight.float()).to(x.dtype)
    return gemv_ref(normed, weight, bias)


def add_rmsnorm_gemv_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                         weight: torch.Tensor, bias: torch.Tensor | None = None, *, eps: float,
                         residual_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The two ops it fuses: ``add_rmsnorm`` (the block boundary), then ``gemv_ref`` on its output.
    Returns (y (..., N) in x's dtype, the new residual s)."""
    normed, s = add_rmsnorm_ref(x, residual, norm_weight, eps, residual_dtype=residual_dtype)
    return gemv_ref(normed.to(x.dtype), weight, bias), s
