"""Plain-PyTorch reference for the fused residual add + RMSNorm of a Mamba-2 block boundary.

    s = residual + x            (in fp32; residual None means s = x; with a pending norm,
                                 x * rsqrt(sum(sumsq) / width + eps) per row)
    new_residual = s            (stored in residual_dtype)
    y = s * rstd(s) * weight    rstd(s) = 1 / sqrt(mean(s**2) + eps), stored in weight's dtype
"""
from __future__ import annotations

import torch


def add_rmsnorm_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float = 1e-5,
    *,
    residual_dtype: torch.dtype | None = None,
    pending_norm=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    if pending_norm is not None:  # fastmamba.ops.add_rmsnorm.api.PendingNorm
        sumsq, width, x_eps = pending_norm
        xf = xf * torch.rsqrt(sumsq.float().sum(-1, keepdim=True) / width + x_eps)
    s = xf if residual is None else residual.float() + xf
    rdtype = residual_dtype or (residual.dtype if residual is not None else torch.float32)
    y = s * torch.rsqrt(s.square().mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(weight.dtype), s.to(rdtype)
