"""The argument checks both entries of ``api.py`` share: shapes, dtypes and devices of x, dt, A,
B, C, D, z, dt_bias; B and C in x's dtype; the varlen call's deferred-norm arguments."""
from __future__ import annotations

import torch

from fastmamba.ops._common.checks import FLOAT_DTYPES, check_dtype, check_same_device, check_shape, check_unit_stride
from fastmamba.ops.ssd_scan.chunked.kernel_common import NORM_SPAN

_DENSE = "mamba_chunk_scan_combined"
_VARLEN = "ssd_scan_varlen"


def _as_x_dtype(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``B`` / ``C`` in x's dtype: fp32 B and C next to 16-bit x (as mamba_ssm's callers pass them)
    are converted first, a copy of G*N values per token (small next to x's H*P); the scan's
    tensor-core dots then take x's dtype, as they do when the dtypes match."""
    return t if t.dtype == x.dtype else t.to(x.dtype)


def _check_common(op, x, dt, A, B, C, D, z, dt_bias, lead):
    """Shapes shared by both entries; ``lead`` are the leading (letter, size) pairs of x."""
    check_same_device(op, [("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z), ("dt_bias", dt_bias)])
    check_dtype(op, "x", x, FLOAT_DTYPES)
    H, P = x.shape[-2:]
    check_shape(op, "dt", dt, [*lead, ("H", H)])
    check_dtype(op, "dt", dt, FLOAT_DTYPES)
    check_shape(op, "A", A, [("H", H)])
    check_dtype(op, "A", A, FLOAT_DTYPES)
    check_shape(op, "B", B, [*lead, ("G", None), ("N", None)])
    G, N = B.shape[-2:]
    if G < 1 or H % G != 0:
        raise ValueError(f"{op}: heads H={H} must be a multiple of the groups G={G} of `B` (shape {tuple(B.shape)})")
    check_shape(op, "C", C, [*lead, ("G", G), ("N", N)])
    for name, t in (("B", B), ("C", C)):
        check_dtype(op, name, t, FLOAT_DTYPES)  # another float dtype than x's: converted (_as_x_dtype)
    if D is not None:
        check_dtype(op, "D", D, FLOAT_DTYPES)
        if tuple(D.shape) not in ((H,), (H, P)):
            raise ValueError(f"{op}: `D` expected shape (H,)=({H},) or (H, P)=({H}, {P}), got {tuple(D.shape)}")
    if z is not None:
        check_shape(op, "z", z, [*lead, ("H", H), ("P", P)])
        if z.dtype != x.dtype:
            raise TypeError(f"{op}: `z` has dtype {z.dtype} but `x` has {x.dtype}; they must match")
    if dt_bias is not None:
        check_shape(op, "dt_bias", dt_bias, [("H", H)])
        check_dtype(op, "dt_bias", dt_bias, FLOAT_DTYPES)
    return H, P, G, N

def _check_norm(x: torch.Tensor, norm_weight: torch.Tensor | None, norm_sumsq: torch.Tensor | None) -> None:
    """ssd_scan_varlen's deferred-norm arguments (tensors or None: checked at the entry): both or
    neither, shapes, dtypes, device."""
    if (norm_weight is None) != (norm_sumsq is None):
        raise ValueError(f"{_VARLEN}: pass both `norm_weight` and `norm_sumsq` (the deferred norm) or neither")
    if norm_weight is None:
        return
    T, H, P = x.shape
    if P % NORM_SPAN.value:
        raise ValueError(f"{_VARLEN}: the deferred norm needs P (the head dim) a multiple of {NORM_SPAN.value}, got P = {P}")
    check_same_device(_VARLEN, [("x", x), ("norm_weight", norm_weight), ("norm_sumsq", norm_sumsq)])
    check_shape(_VARLEN, "norm_weight", norm_weight, [("H * P", H * P)])
    check_dtype(_VARLEN, "norm_weight", norm_weight, FLOAT_DTYPES)
    check_unit_stride(_VARLEN, "norm_weight", norm_weight, 0)
    check_shape(_VARLEN, "norm_sumsq", norm_sumsq, [("T", T), ("H * P / 16", H * P // NORM_SPAN.value)])
    check_dtype(_VARLEN, "norm_sumsq", norm_sumsq, (torch.float32,))
    check_unit_stride(_VARLEN, "norm_sumsq", norm_sumsq, 1)
