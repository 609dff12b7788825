"""Plain-PyTorch reference of ``gemv``: y = x @ weight^T + bias, fp32 inside."""
from __future__ import annotations

import torch


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K), weight (N, K), bias (N,) or None -> y (..., N) in x's dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
