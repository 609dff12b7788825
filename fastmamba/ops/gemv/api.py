"""Public entry of ``gemv``: a linear layer applied to a few rows (decode-time projections)."""
from __future__ import annotations

import math

import torch

from fastmamba.ops._common.checks import check_dtype, check_same_device, check_same_dtype, check_unit_stride
from fastmamba.ops._common.dispatch import use_triton
from fastmamba.ops._common.host_math import cdiv
from fastmamba.ops._common.pdl import pdl_active
from fastmamba.ops.add_rmsnorm import add_rmsnorm
from fastmamba.ops.gated_rmsnorm import rmsnorm_fn
from fastmamba.ops.gated_rmsnorm.api import check_eps
from fastmamba.ops.gemv.configs import MAX_ROWS, pick_config
from fastmamba.ops.gemv.kernel import launch_gemv, launch_rmsnorm_gemv
from fastmamba.ops.gemv.ref import add_rmsnorm_gemv_ref, gemv_ref, rmsnorm_gemv_ref

_OP = "gemv"
_NORM_OP = "rmsnorm_gemv"
_ADD_OP = "add_rmsnorm_gemv"
HALF_DTYPES = (torch.float16, torch.bfloat16)


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
    lead, M, N, K = _check_linear(_OP, x, weight, bias, out)
    if not use_triton(x):
        y = gemv_ref(x, weight, bias)
        return y if out is None else out.copy_(y)
    y = out if out is not None else torch.empty(lead + (N,), dtype=x.dtype, device=x.device)
    if M and N and not K:  # an empty sum
        y.copy_(bias.expand(lead + (N,)) if bias is not None else torch.zeros((), dtype=y.dtype, device=y.device))
    elif M and N:
        cfg = pick_config(M, K)
        # x.reshape: a view for the usual row-strided x
        launch_gemv(x.reshape(M, K), weight, bias, y.view(M, N), block_n=cfg.block_n, block_k=cfg.block_k,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages, use_dot=cfg.use_dot,
                    use_pdl=pdl_active(x, cdiv(N, cfg.block_n), cfg.num_warps))
    return y


def _check_linear(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  out: torch.Tensor | None, extra: tuple = ()) -> tuple[tuple[int, ...], int, int, int]:
    """gemv's argument checks (``extra``: more (name, tensor) pairs that share the device);
    returns (x's leading shape, rows M, N, K)."""
    check_dtype(op, "x", x, HALF_DTYPES)
    check_same_dtype(op, [("x", x), ("weight", weight)] + ([("bias", bias)] if bias is not None else []))
    check_same_device(op, [("x", x), ("weight", weight), ("bias", bias), ("out", out), *extra])
    if weight.dim() != 2 or x.dim() < 1 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{op}: `weight` expected shape (N, K={x.shape[-1] if x.dim() else '?'}) "
                         f"(K = x's last dim), got {tuple(weight.shape)}")
    N, K = weight.shape
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"{op}: `bias` expected shape ({N},), got {tuple(bias.shape)}")
    check_unit_stride(op, "x", x, -1)
    check_unit_stride(op, "weight", weight, 1)
    lead = tuple(x.shape[:-1])
    M = math.prod(lead)
    if M > MAX_ROWS:
        raise ValueError(f"{op}: x has {M} rows; at most {MAX_ROWS} (a matrix-vector product; use F.linear for more)")
    if out is not None:
        check_dtype(op, "out", out, (x.dtype,))
        if tuple(out.shape) != lead + (N,) or not out.is_contiguous():
            raise ValueError(f"{op}: `out` expected a contiguous tensor of shape {lead + (N,)}, got "
                             f"{tuple(out.shape)} (contiguous: {out.is_contiguous()})")
    return lead, M, N, K


def rmsnorm_gemv(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 *, eps: float, group_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gemv(rmsnorm(x) * norm_weight, weight, bias)`` in one kernel: the grouped RMSNorm (no gate,
    no norm bias: the Mamba-2 mixer's norm when silu(z) ran in the scan) applied to at most 16
    rows of x on their way into the projection, so the normalised rows are never written.

    x            (..., K)  fp16 or bf16, unit stride along K, at most 16 rows in all
    norm_weight  (K,)      the norm's weight (any float dtype)
    weight       (N, K)    x's dtype, unit stride along K;  bias (N,) x's dtype, or None
    eps          the norm's epsilon;  group_size: columns per normalised group (divides K)
    out          (..., N)  optional, x's dtype, contiguous; written
    Returns y (..., N) in x's dtype. Each row's sums of squares and the products accumulate in
    fp32; x * norm_weight enters the tensor cores in x's dtype and each group's 1 / rms scales its
    fp32 partial sum (the unfused path rounds x * norm_weight / rms instead: errors of one size).
    Shapes the kernel does not tile (K or group_size not a multiple of its K step) run the two ops
    unfused (``rmsnorm_fn``, then ``gemv``). Reference: fastmamba.ops.gemv.ref.rmsnorm_gemv_ref
    """
    lead, M, N, K = _check_linear(_NORM_OP, x, weight, bias, out, (("norm_weight", norm_weight),))
    check_dtype(_NORM_OP, "norm_weight", norm_weight, (torch.float32, *HALF_DTYPES))
    if tuple(norm_weight.shape) != (K,):
        raise ValueError(f"{_NORM_OP}: `norm_weight` expected shape (K={K},), got {tuple(norm_weight.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or K % group_size:
        raise ValueError(f"{_NORM_OP}: `group_size` expected a positive int dividing K={K}, got {group_size!r}")
    eps = check_eps(_NORM_OP, eps)
    if not use_triton(x):
        y = rmsnorm_gemv_ref(x, norm_weight, weight, bias, eps=eps, group_size=group_size)
        return y if out is None else out.copy_(y)
    cfg = pick_config(max(M, 2), K)  # the tensor-core tiles (for any row count)
    if not (M and N) or K % cfg.block_k or group_size % cfg.block_k or not norm_weight.is_contiguous():
        return gemv(rmsnorm_fn(x, norm_weight, None, None, eps, group_size, False), weight, bias, out=out)
    y = out if out is not None else torch.empty(lead + (N,), dtype=x.dtype, device=x.device)
    launch_rmsnorm_gemv(x.reshape(M, K), norm_weight, weight, bias, y.view(M, N), eps=eps, group_size=group_size,
                        block_n=cfg.block_n, block_k=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                        use_pdl=pdl_active(x, cdiv(N, cfg.block_n), cfg.num_warps))
    return y


def add_rmsnorm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None, *, eps: float,
                     residual_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rmsnorm`` (a block boundary: s = residual + x, then RMSNorm(s) * norm_weight) and the
    next block's in_proj ``gemv`` in one kernel, for at most 16 rows: the normalised rows are never
    written; the new residual s is (by one program).

    x            (..., K)  fp16 or bf16, unit stride along K (a block's output, or the embeddings)
    residual     (..., K)  any float dtype, unit stride along K, or None (s = x)
    norm_weight  (K,)      the block norm's weight;  weight (N, K) x's dtype;  bias (N,) or None
    residual_dtype  fp32, bf16 or fp16: the dtype of s (default: residual's, fp32 without one)
    Returns (y (..., N) in x's dtype, s (..., K) contiguous). fp32 inside, as ``rmsnorm_gemv``.
    Shapes the kernel does not tile run the two ops unfused.
    Reference: fastmamba.ops.gemv.ref.add_rmsnorm_gemv_ref
    """
    lead, M, N, K = _check_linear(_ADD_OP, x, weight, bias, None,
                                  (("norm_weight", norm_weight), ("residual", residual)))
    check_dtype(_ADD_OP, "norm_weight", norm_weight, (torch.float32, *HALF_DTYPES))
    if tuple(norm_weight.shape) != (K,):
        raise ValueError(f"{_ADD_OP}: `norm_weight` expected shape (K={K},), got {tuple(norm_weight.shape)}")
    if residual is not None:
        check_dtype(_ADD_OP, "residual", residual, (torch.float32, *HALF_DTYPES))
        if residual.shape != x.shape:
            raise ValueError(f"{_ADD_OP}: `residual` expected shape {tuple(x.shape)} (as x), got {tuple(residual.shape)}")
        check_unit_stride(_ADD_OP, "residual", residual, -1)
    if residual_dtype is not None and residual_dtype not in (torch.float32, *HALF_DTYPES):
        raise TypeError(f"{_ADD_OP}: `residual_dtype` expected float32, bfloat16, float16 or None, got {residual_dtype!r}")
    eps = check_eps(_ADD_OP, eps)
    rdtype = residual_dtype or (residual.dtype if residual is not None else torch.float32)
    if not use_triton(x):
        return add_rmsnorm_gemv_ref(x, residual, norm_weight, weight, bias, eps=eps, residual_dtype=rdtype)
    cfg = pick_config(max(M, 2), K)  # the tensor-core tiles (for any row count)
    if not (M and N) or K % cfg.block_k or not norm_weight.is_contiguous():
        normed, s = add_rmsnorm(x, residual, norm_weight, eps, residual_dtype=rdtype)
        return gemv(normed.to(x.dtype), weight, bias), s
    y = torch.empty(lead + (N,), dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=rdtype, device=x.device)
    launch_rmsnorm_gemv(x.reshape(M, K), norm_weight, weight, bias, y.view(M, N), eps=eps, group_size=K,
                        block_n=cfg.block_n, block_k=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                        use_pdl=pdl_active(x, cdiv(N, cfg.block_n), cfg.num_warps),
                        residual=residual.reshape(M, K) if residual is not None else None, sum_out=s.view(M, K))
    return y, s
