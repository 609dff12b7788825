"""Triton kernel for gated RMSNorm (forward only) and its launcher.

Layout: x, z and y are (M, Dh) row views (M = product of the leading dims) with unit column
stride and any row stride; weight and bias are (Dh,), contiguous. Dh = G * GROUP_SIZE.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fastmamba.ops._common.dispatch import inline_asm_ok
from fastmamba.ops._common.jit_math import silu_approx
from fastmamba.ops._common.pdl import TRIGGER_EARLY, pdl_active
from fastmamba.ops.gated_rmsnorm.configs import GatedRMSNormConfig
from fastmamba.ops._common.launch import lean
from fastmamba.ops._common.host_math import cdiv


@triton.heuristics({
    "HAS_Z": lambda args: args["z_ptr"] is not None,
    "HAS_BIAS": lambda args: args["b_ptr"] is not None,
})
@triton.jit(do_not_specialize=["M", "eps"])
def _gated_rmsnorm_fwd_kernel(
    x_ptr, z_ptr, w_ptr, b_ptr, y_ptr,
    M, eps,
    stride_x_m, stride_z_m, stride_y_m,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_TILE: tl.constexpr,
    NORM_BEFORE_GATE: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
    PDL_TRIGGER: tl.constexpr,
    FAST_MATH: tl.constexpr,  # silu on the approximate PTX exp2 / reciprocal (GPU only)
):
    # one program per (block of BLOCK_M rows, group); the group's GROUP_SIZE columns start at col0
    pid_m = tl.program_id(0)
    col0 = tl.program_id(1) * GROUP_SIZE
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = rows.to(tl.int64)  # rows * stride can pass 2**31 elements on long prefills
    x_rows = x_ptr + rows[:, None] * stride_x_m + col0           # [BLOCK_M, 1] pointers
    y_rows = y_ptr + rows[:, None] * stride_y_m + col0
    if HAS_Z:
        z_rows = z_ptr + rows[:, None] * stride_z_m + col0
    cols = tl.arange(0, BLOCK_N)

    if SINGLE_TILE:
        # The whole group is one register tile: one read of x and z, one write of y.
        col_mask = cols < GROUP_SIZE
        mask = row_mask[:, None] & col_mask[None, :]
        # weights first: under PDL they are read before the grid-dependency wait
        w = tl.load(w_ptr + col0 + cols, mask=col_mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            b = tl.load(b_ptr + col0 + cols, mask=col_mask, other=0.0).to(tl.float32)
        if USE_PDL:
            gdc_wait()
            if PDL_TRIGGER:
                gdc_launch_dependents()
        v = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_Z:
            z = tl.load(z_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if not NORM_BEFORE_GATE:
                v = v * silu_approx(z, FAST_MATH)
        # masked columns hold 0, so they add nothing to the sum of squares
        rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / GROUP_SIZE + eps)      # [BLOCK_M]
        y = v * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            y = y + b[None, :]
        if HAS_Z and NORM_BEFORE_GATE:
            y = y * silu_approx(z, FAST_MATH)
        tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # Group wider than one tile: pass 1 sums squares chunk by chunk, pass 2 re-reads x (and z,
        # mostly from L2), normalises and stores.
        if USE_PDL:
            gdc_wait()
            if PDL_TRIGGER:
                gdc_launch_dependents()
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for n0 in range(0, GROUP_SIZE, BLOCK_N):
            col_mask = n0 + cols < GROUP_SIZE
            mask = row_mask[:, None] & col_mask[None, :]
            v = tl.load(x_rows + n0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_Z and not NORM_BEFORE_GATE:
                z = tl.load(z_rows + n0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                v = v * silu_approx(z, FAST_MATH)
            acc += v * v
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / GROUP_SIZE + eps)
        for n0 in range(0, GROUP_SIZE, BLOCK_N):
            col_mask = n0 + cols < GROUP_SIZE
            mask = row_mask[:, None] & col_mask[None, :]
            v = tl.load(x_rows + n0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_Z:
                z = tl.load(z_rows + n0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                if not NORM_BEFORE_GATE:
                    v = v * silu_approx(z, FAST_MATH)
            w = tl.load(w_ptr + col0 + n0 + cols, mask=col_mask, other=0.0).to(tl.float32)
            y = v * rstd[:, None] * w[None, :]
            if HAS_BIAS:
                b = tl.load(b_ptr + col0 + n0 + cols, mask=col_mask, other=0.0).to(tl.float32)
                y = y + b[None, :]
            if HAS_Z and NORM_BEFORE_GATE:
                y = y * silu_approx(z, FAST_MATH)
            tl.store(y_rows + n0 + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def gated_rmsnorm_fwd(
    x: torch.Tensor,
    z: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
    cfg: GatedRMSNormConfig,
) -> None:
    """Launch the kernel on (M, Dh) row views; writes ``out``. Inputs are already validated."""
    M, Dh = x.shape
    G = Dh // group_size
    grid = (cdiv(M, cfg.block_m), G)
    use_pdl = pdl_active(x, grid[0] * grid[1], cfg.num_warps)
    lean(_gated_rmsnorm_fwd_kernel)[grid](
        x, z, weight, bias, out,
        M, float(eps),
        x.stride(0), z.stride(0) if z is not None else 0, out.stride(0),
        GROUP_SIZE=group_size,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        SINGLE_TILE=cfg.single_tile,
        NORM_BEFORE_GATE=bool(norm_before_gate),
        USE_PDL=use_pdl,
        PDL_TRIGGER=TRIGGER_EARLY,
        FAST_MATH=inline_asm_ok(x),
        num_warps=cfg.num_warps,
        launch_pdl=use_pdl,
    )
