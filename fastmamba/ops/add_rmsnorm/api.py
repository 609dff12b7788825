"""Public entry of the fused residual add + RMSNorm (the boundary between two Mamba-2 blocks)."""
from __future__ import annotations

from typing import Optional

import torch

from fastmamba.ops._common.checks import FLOAT_DTYPES, check_dtype, check_same_device, check_unit_stride
from fastmamba.ops._common.dispatch import call_directly, use_triton
from fastmamba.ops._common.pdl import pdl_active
from fastmamba.ops.add_rmsnorm.kernel import launch_add_rmsnorm, num_warps_for
from fastmamba.ops.add_rmsnorm.ref import add_rmsnorm_ref
from fastmamba.ops.gated_rmsnorm.api import check_eps

_OP = "add_rmsnorm"


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float = 1e-5,
    *,
    residual_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = residual + x``; returns ``(rmsnorm(s) * weight, s)`` in one kernel.

    x          (..., D)  float, last-dim stride 1; read (a block's output, or the embeddings)
    residual   (..., D)  float or None (then s = x); read
    weight     (D,)      float, stride 1; y takes its dtype
    eps        added to the mean square inside the square root: a finite number >= 0
    residual_dtype       fp32, bf16 or fp16: dtype of the returned s (default: residual's, fp32
                         without one)
    Returns y (..., D) in weight's dtype and the new residual s (..., D), both freshly allocated
    and contiguous. Math in fp32. Reference: fastmamba.ops.add_rmsnorm.ref.add_rmsnorm_ref
    """
    if x.dim() < 1:
        raise ValueError(f"{_OP}: `x` expected shape (..., D), got a 0-d tensor")
    D = x.shape[-1]
    eps = check_eps(_OP, eps)
    check_dtype(_OP, "x", x, FLOAT_DTYPES)
    check_dtype(_OP, "weight", weight, FLOAT_DTYPES)
    if weight.shape != (D,):
        raise ValueError(f"{_OP}: `weight` expected shape ({D},) (x's last dim), got {tuple(weight.shape)}")
    if residual is not None:
        check_dtype(_OP, "residual", residual, FLOAT_DTYPES)
        if residual.shape != x.shape:
            raise ValueError(f"{_OP}: `residual` expected shape {tuple(x.shape)} (same as x), got {tuple(residual.shape)}")
    check_same_device(_OP, [("x", x), ("residual", residual), ("weight", weight)])
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        if t is not None:
            check_unit_stride(_OP, name, t, -1)
    if residual_dtype is not None and residual_dtype not in FLOAT_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in FLOAT_DTYPES)
        raise TypeError(f"{_OP}: `residual_dtype` expected one of ({names}) or None, got {residual_dtype!r}")
    rdtype = residual_dtype or (residual.dtype if residual is not None else torch.float32)
    y = torch.empty(x.shape, dtype=weight.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=rdtype, device=x.device)
    op = _add_rmsnorm_impl if call_directly(x) else torch.ops.fastmamba.add_rmsnorm_
    op(x, residual, weight, y, s, eps)
    return y, s


# Registered so that torch.compile (fullgraph) treats the launch as one opaque op writing y and s.
@torch.library.custom_op("fastmamba::add_rmsnorm_", mutates_args=("y", "s"))
def _add_rmsnorm_(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, y: torch.Tensor, s: torch.Tensor,
    eps: float,
) -> None:
    """Op on checked inputs; y and s are new contiguous tensors of x's shape."""
    _add_rmsnorm_impl(x, residual, weight, y, s, eps)


def _add_rmsnorm_impl(x, residual, weight, y, s, eps) -> None:
    if not use_triton(x):
        y_ref, s_ref = add_rmsnorm_ref(x, residual, weight, eps, residual_dtype=s.dtype)
        y.copy_(y_ref)
        s.copy_(s_ref)
        return
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.shape[0] == 0:
        return
    r2 = residual.reshape(-1, D) if residual is not None else None
    warps = num_warps_for(D)
    launch_add_rmsnorm(x2, r2, weight, y.view(-1, D), s.view(-1, D), eps, num_warps=warps,
                       use_pdl=pdl_active(x, x2.shape[0], warps))


@_add_rmsnorm_.register_fake
def _(x, residual, weight, y, s, eps):
    return None
