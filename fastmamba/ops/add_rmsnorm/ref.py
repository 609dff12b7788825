"""Plain-PyTorch reference for the fused residual add + RMSNorm of a Mamba-2 block boundary.

    s = residual + x            (in fp32; residual None means s = x)
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
) -> tuple[torch.Tensor, torch.Tensor]:
    s = x.float() if residual is None else residual.float() + x.float()
    rdtype = residual_dtype or (residual.dtype if residual is not None else torch.float32)
    y = s * torch.rsqrt(s.square().mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(weight.dtype), s.to(rdtype)
