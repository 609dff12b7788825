"""Triton kernel: residual add + RMSNorm in one pass (one read of x and residual, two writes)."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from fastmamba.ops._common.launch import lean
from fastmamba.ops._common.host_math import next_power_of_2


@triton.jit(do_not_specialize=["eps", "x_eps"])
def _add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, sq_ptr,
    D, eps, J, x_width, x_eps,
    stride_x, stride_res, stride_y, stride_res_out, stride_sq,
    HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
    HAS_PENDING: tl.constexpr = False, BLOCK_J: tl.constexpr = 1,
):
    # one program per row
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    s = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_PENDING:  # x = (rows g * norm_weight) @ W^T: scale by the deferred norm's 1 / rms(g)
        offs_j = tl.arange(0, BLOCK_J)
        ss = tl.sum(tl.load(sq_ptr + row * stride_sq + offs_j, mask=offs_j < J, other=0.0), axis=0)
        s = s * (1.0 / tl.sqrt(ss / x_width + x_eps))
    if HAS_RESIDUAL:
        s += tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(res_out_ptr + row * stride_res_out + cols, s.to(res_out_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / D + eps)
    tl.store(y_ptr + row * stride_y + cols, (s * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def num_warps_for(D: int) -> int:
    """About 8 elements per thread (one 16-byte bf16 vector), 1 to 16 warps."""
    return max(1, min(16, next_power_of_2(D) // 256))


def launch_add_rmsnorm(x, residual, weight, y, res_out, eps: float, *, num_warps: int, use_pdl: bool,
                       sumsq=None, x_width: int = 1, x_eps: float = 0.0) -> None:
    """x, residual (or None), y, res_out: (M, D) row views with unit column stride; sumsq (M, J)
    fp32 with unit column stride, or None: x's row r is first scaled by
    rsqrt(sum(sumsq[r]) / x_width + x_eps) (a deferred norm)."""
    M, D = x.shape
    block_d = next_power_of_2(D)
    J = sumsq.shape[1] if sumsq is not None else 0
    lean(_add_rmsnorm_kernel)[(M,)](
        x, residual, weight, y, res_out, sumsq, D, float(eps), J, x_width, float(x_eps),
        x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0), res_out.stride(0),
        sumsq.stride(0) if sumsq is not None else 0,
        HAS_RESIDUAL=residual is not None, BLOCK_D=block_d, USE_PDL=use_pdl,
        HAS_PENDING=sumsq is not None, BLOCK_J=next_power_of_2(max(J, 1)),
        num_warps=num_warps, launch_pdl=use_pdl,
    )
