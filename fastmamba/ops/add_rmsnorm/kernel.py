"""Triton kernel: residual add + RMSNorm in one pass (one read of x and residual, two writes)."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from fastmamba.ops._common.launch import lean
from fastmamba.ops._common.host_math import next_power_of_2


@triton.jit(do_not_specialize=["eps"])
def _add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr,
    D, eps,
    stride_x, stride_res, stride_y, stride_res_out,
    HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
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
    if HAS_RESIDUAL:
        s += tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(res_out_ptr + row * stride_res_out + cols, s.to(res_out_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / D + eps)
    tl.store(y_ptr + row * stride_y + cols, (s * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def num_warps_for(D: int) -> int:
    """About 8 elements per thread (one 16-byte bf16 vector), 1 to 16 warps."""
    return max(1, min(16, next_power_of_2(D) // 256))


def launch_add_rmsnorm(x, residual, weight, y, res_out, eps: float, *, num_warps: int, use_pdl: bool) -> None:
    """x, residual (or None), y, res_out: (M, D) row views with unit column stride."""
    M, D = x.shape
    block_d = next_power_of_2(D)
    lean(_add_rmsnorm_kernel)[(M,)](
        x, residual, weight, y, res_out, D, float(eps),
        x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0), res_out.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK_D=block_d, USE_PDL=use_pdl,
        num_warps=num_warps, launch_pdl=use_pdl,
    )
