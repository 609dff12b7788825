"""Public entry of the fused residual add + RMSNorm (the boundary between two Mamba-2 blocks)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from fastmamba.ops._common.checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_same_device,
    check_tensors,
    check_unit_stride,
)
from fastmamba.ops._common.dispatch import call_directly, use_triton
from fastmamba.ops._common.pdl import pdl_active
from fastmamba.ops.add_rmsnorm.kernel import launch_add_rmsnorm, num_warps_for
from fastmamba.ops.add_rmsnorm.ref import add_rmsnorm_ref
from fastmamba.ops.gated_rmsnorm.api import check_eps

_OP = "add_rmsnorm"


class PendingNorm(NamedTuple):
    """An RMSNorm deferred into its consumer: x = (g * norm_weight) @ W^T for rows g that were never
    normalised, so rmsnorm(g) * norm_weight @ W^T = x * rsqrt(sum(sumsq) / width + eps), per row.
    The SSD scan writes it (``ssd_scan_varlen``'s ``norm_weight`` / ``norm_sumsq``)."""

    sumsq: torch.Tensor  # (..., J) fp32: partial sums of g^2 (x's leading dims), unit stride along J
    width: int  # columns of g that the norm averages over (the mixer's d_inner)
    eps: float  # the deferred norm's epsilon


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float = 1e-5,
    *,
    residual_dtype: torch.dtype | None = None,
    pending_norm: PendingNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = residual + x``; returns ``(rmsnorm(s) * weight, s)`` in one kernel.

    x          (..., D)  float, last-dim stride 1; read (a block's output, or the embeddings)
    residual   (..., D)  float or None (then s = x); read
    weight     (D,)      float, stride 1; y takes its dtype
    eps        added to the mean square inside the square root: a finite number >= 0
    residual_dtype       fp32, bf16 or fp16: dtype of the returned s (default: residual's, fp32
                         without one)
    pending_norm         ``PendingNorm`` or None: x's rows still owe a norm's 1 / rms, which
                         scales them (in fp32) before the add
    Returns y (..., D) in weight's dtype and the new residual s (..., D), both freshly allocated
    and contiguous. Math in fp32. Reference: fastmamba.ops.add_rmsnorm.ref.add_rmsnorm_ref
    """
    check_tensors(_OP, [("x", x), ("weight", weight)], [("residual", residual)])
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
    sumsq, width, x_eps = _check_pending(x, pending_norm)
    y = torch.empty(x.shape, dtype=weight.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=rdtype, device=x.device)
    op = _add_rmsnorm_impl if call_directly(x) else torch.ops.fastmamba.add_rmsnorm_
    op(x, residual, weight, y, s, eps, sumsq, width, x_eps)
    return y, s


def _check_pending(x: torch.Tensor, pending: PendingNorm | None) -> tuple[torch.Tensor | None, int, float]:
    """add_rmsnorm's ``pending_norm``, checked: (sumsq or None, width, eps)."""
    if pending is None:
        return None, 1, 0.0
    if not isinstance(pending, PendingNorm):
        raise TypeError(f"{_OP}: `pending_norm` expected a PendingNorm or None, got {type(pending).__name__}")
    sumsq, width, x_eps = pending
    if not isinstance(sumsq, torch.Tensor) or sumsq.dim() != x.dim() or sumsq.shape[:-1] != x.shape[:-1]:
        got = tuple(sumsq.shape) if isinstance(sumsq, torch.Tensor) else type(sumsq).__name__
        raise ValueError(f"{_OP}: `pending_norm.sumsq` expected shape {tuple(x.shape[:-1]) + ('J',)} (x's leading "
                         f"dims), got {got}")
    check_dtype(_OP, "pending_norm.sumsq", sumsq, (torch.float32,))
    check_same_device(_OP, [("x", x), ("pending_norm.sumsq", sumsq)])
    check_unit_stride(_OP, "pending_norm.sumsq", sumsq, -1)
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"{_OP}: `pending_norm.width` expected a positive int, got {width!r}")
    return sumsq, width, check_eps(_OP, x_eps)


# Registered so that torch.compile (fullgraph) treats the launch as one opaque op writing y and s.
@torch.library.custom_op("fastmamba::add_rmsnorm_", mutates_args=("y", "s"))
def _add_rmsnorm_(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, y: torch.Tensor, s: torch.Tensor,
    eps: float, sumsq: Optional[torch.Tensor], width: int, x_eps: float,
) -> None:
    """Op on checked inputs; y and s are new contiguous tensors of x's shape."""
    _add_rmsnorm_impl(x, residual, weight, y, s, eps, sumsq, width, x_eps)


def _add_rmsnorm_impl(x, residual, weight, y, s, eps, sumsq=None, width=1, x_eps=0.0) -> None:
    if not use_triton(x):
        pending = PendingNorm(sumsq, width, x_eps) if sumsq is not None else None
        y_ref, s_ref = add_rmsnorm_ref(x, residual, weight, eps, residual_dtype=s.dtype, pending_norm=pending)
        y.copy_(y_ref)
        s.copy_(s_ref)
        return
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.shape[0] == 0:
        return
    r2 = residual.reshape(-1, D) if residual is not None else None
    sq2 = sumsq.reshape(-1, sumsq.shape[-1]) if sumsq is not None else None
    warps = num_warps_for(D)
    launch_add_rmsnorm(x2, r2, weight, y.view(-1, D), s.view(-1, D), eps, num_warps=warps,
                       use_pdl=pdl_active(x, x2.shape[0], warps), sumsq=sq2, x_width=width, x_eps=x_eps)


@_add_rmsnorm_.register_fake
def _(x, residual, weight, y, s, eps, sumsq, width, x_eps):
    return None
