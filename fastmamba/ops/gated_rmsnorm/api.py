"""Public entry for gated RMSNorm: checks, row views, allocation, config pick, launch."""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from fastmamba.ops._common.checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_same_device,
    check_shape,
    check_tensors,
    check_unit_stride,
)
from fastmamba.ops._common.launch import on_device
from fastmamba.ops._common.plans import PlanCache, sig
from fastmamba.ops._common.dispatch import call_directly, use_triton
from fastmamba.ops.gated_rmsnorm.configs import pick_config
from fastmamba.ops.gated_rmsnorm.kernel import gated_rmsnorm_fwd
from fastmamba.ops.gated_rmsnorm.ref import rmsnorm_ref

_OP = "rmsnorm_fn"


def check_eps(op: str, eps: object) -> float:
    """``eps`` as a float: a real number (not a bool or a tensor), finite and >= 0; else an error
    naming the op (a negative eps makes rstd NaN for small rows, NaN or inf every output)."""
    if type(eps) is float and 0.0 <= eps < math.inf:  # the common case, without the abc check
        return eps
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{op}: `eps` expected a float, got {type(eps).__name__} {eps!r}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{op}: `eps` expected a finite number >= 0, got {eps!r}")
    return float(eps)


def rmsnorm_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    z: torch.Tensor | None = None,
    eps: float = 1e-6,
    group_size: int | None = None,
    norm_before_gate: bool = True,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Group-wise RMSNorm with an optional SiLU gate (drop-in for mamba_ssm's ``rmsnorm_fn``, forward only).

    x       (..., Dh)  fp32, bf16 or fp16; read. Last dim must have stride 1; the leading dims are
                       flattened to M rows with ``reshape`` (a view whenever the strides allow it,
                       e.g. a column slice of a wider tensor; otherwise reshape copies x).
    weight  (Dh,)      fp32, bf16 or fp16 (need not match x), stride 1; read
    bias    (Dh,)      or None; like weight
    z       (..., Dh)  same shape as x, or None; any float dtype, last-dim stride 1; read
    eps     added to the mean square inside the square root: a finite number >= 0
    group_size         columns per group (must divide Dh); None = Dh (one group). Each
                       (row, group) is normalised with its own rstd = 1/sqrt(mean(v**2) + eps).
    norm_before_gate   True:  y = x * rstd(x) * weight + bias, then y *= silu(z)
                       False: v = x * silu(z), y = v * rstd(v) * weight + bias
                       (without z both are plain RMSNorm)
    out     (..., Dh)  optional, same shape and dtype as x, last-dim stride 1, viewable as
                       (M, Dh) rows; written (every element), never read
    Returns y (..., Dh), x's dtype (``out`` when given). All math in fp32; no host sync, so the
    call can be captured in a CUDA graph. Inference only (no autograd).
    Reference: fastmamba.ops.gated_rmsnorm.ref.rmsnorm_ref

    >>> x, z = torch.randn(2, 8), torch.randn(2, 8)
    >>> y = rmsnorm_fn(x, torch.ones(8), None, z=z, group_size=4, norm_before_gate=False)
    >>> y.shape, y.dtype
    (torch.Size([2, 8]), torch.float32)
    """
    # Fast path: a signature an earlier call validated (the checks depend on it alone: no values)
    if out is None and type(x) is torch.Tensor and eps.__class__ is float:
        try:
            key = (x.shape, x.stride(), x.dtype, x.device, sig(weight), sig(bias), sig(z), eps, group_size,
                   norm_before_gate)
        except (AttributeError, TypeError):  # a non-tensor or an unhashable argument: the checks say which
            key = None
        gs = _VALID.get(key)
        if gs is not None and call_directly(x):
            y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            _rmsnorm_fn_impl(x, z, weight, bias, y, eps, gs, bool(norm_before_gate))
            return y
    else:
        key = None
    check_tensors(_OP, [("x", x), ("weight", weight)], [("bias", bias), ("z", z), ("out", out)])
    if x.dim() < 1:
        raise ValueError(f"{_OP}: `x` expected shape (..., Dh), got a 0-d tensor")
    Dh = x.shape[-1]
    eps = check_eps(_OP, eps)
    check_dtype(_OP, "x", x, FLOAT_DTYPES)
    check_dtype(_OP, "weight", weight, FLOAT_DTYPES)
    check_shape(_OP, "weight", weight, [("Dh", Dh)])
    if bias is not None:
        check_dtype(_OP, "bias", bias, FLOAT_DTYPES)
        check_shape(_OP, "bias", bias, [("Dh", Dh)])
    if z is not None:
        check_dtype(_OP, "z", z, FLOAT_DTYPES)
        if z.shape != x.shape:
            raise ValueError(f"{_OP}: `z` expected shape {tuple(x.shape)} (same as x), got {tuple(z.shape)}")
    if out is not None:
        if out.shape != x.shape:
            raise ValueError(f"{_OP}: `out` expected shape {tuple(x.shape)} (same as x), got {tuple(out.shape)}")
        if out.dtype != x.dtype:
            raise TypeError(f"{_OP}: `out` expected dtype {x.dtype} (same as x), got {out.dtype}")
    device = check_same_device(_OP, [("x", x), ("weight", weight), ("bias", bias), ("z", z), ("out", out)])
    if group_size is None:
        group_size = Dh
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or Dh % group_size:
        raise ValueError(f"{_OP}: `group_size` must be a positive divisor of Dh={Dh} (x's last dim), got {group_size!r}")
    for name, t in (("x", x), ("z", z), ("out", out), ("weight", weight), ("bias", bias)):
        if t is not None:
            check_unit_stride(_OP, name, t, -1)

    if key is not None:
        _VALID.remember(key, group_size)
    if out is None:
        y = torch.empty(x.shape, dtype=x.dtype, device=device)  # contiguous: viewable as rows
    else:
        y = out
        try:
            y.view(-1, Dh)
        except RuntimeError:
            raise ValueError(
                f"{_OP}: `out` must be viewable as (M, Dh) rows without a copy, got strides {tuple(y.stride())}"
            ) from None
    op = _rmsnorm_fn_impl if call_directly(x) else torch.ops.fastmamba.rmsnorm_fn_
    op(x, z, weight, bias, y, eps, group_size, bool(norm_before_gate))
    return y


# Signatures of calls without ``out`` that passed every check -> their group size (issue 19: the
# eager host path): every tensor's shape, strides, dtype and device, eps, group_size and the flag.
_VALID = PlanCache("rmsnorm_fn", 1024)



# Registered so that torch.compile (fullgraph) treats the launch as one opaque op that writes
# ``out``, instead of tracing into Triton's launcher. The schema is inferred from the annotations.
@torch.library.custom_op("fastmamba::rmsnorm_fn_", mutates_args=("out",))
def _rmsnorm_fn_(
    x: torch.Tensor,
    z: Optional[torch.Tensor],
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    out: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
) -> None:
    """Op on checked inputs (out: x's shape, viewable as rows): writes every element of ``out``."""
    _rmsnorm_fn_impl(x, z, weight, bias, out, eps, group_size, norm_before_gate)


def _rmsnorm_fn_impl(x, z, weight, bias, out, eps, group_size, norm_before_gate) -> None:
    if not use_triton(x):
        rmsnorm_ref(x, weight, bias, z, eps, group_size, norm_before_gate, out=out)
        return
    Dh = x.shape[-1]
    x_rows = x.reshape(-1, Dh)
    M = x_rows.shape[0]
    if M == 0 or Dh == 0:
        return
    z_rows = z.reshape(-1, Dh) if z is not None else None
    cfg = pick_config(M, group_size, Dh // group_size, x.dtype, x.device)
    with on_device(x):
        gated_rmsnorm_fwd(x_rows, z_rows, weight, bias, out.view(-1, Dh), eps, group_size, norm_before_gate, cfg)


@_rmsnorm_fn_.register_fake
def _(x, z, weight, bias, out, eps, group_size, norm_before_gate):
    return None


class RMSNormGated(torch.nn.Module):
    """Module form of :func:`rmsnorm_fn` (drop-in for mamba_ssm's ``layernorm_gated.RMSNorm``).

    Parameters: ``weight`` (hidden_size,) initialised to ones; ``bias`` (hidden_size,) zeros when
    ``bias=True``, else None. ``forward(x, z=None)`` returns ``rmsnorm_fn(x, weight, bias, z, ...)``.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        group_size: int | None = None,
        norm_before_gate: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.eps = check_eps("RMSNormGated", eps)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        return rmsnorm_fn(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                          norm_before_gate=self.norm_before_gate)

    def extra_repr(self) -> str:
        return (f"{self.weight.shape[0]}, eps={self.eps}, group_size={self.group_size}, "
                f"norm_before_gate={self.norm_before_gate}")
