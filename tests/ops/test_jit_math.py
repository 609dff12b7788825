"""The shared @triton.jit helpers: the approximate silu (inline PTX, GPU only) against torch."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from fastmamba.ops._common.jit_math import silu_approx


@triton.jit
def _silu_kernel(x_ptr, out_ptr, n, FAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, silu_approx(x, FAST), mask=offs < n)


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [True, False])
def test_silu_approx_matches_torch_over_the_fp32_range(fast):
    """Both paths against float64 silu: random normals plus the extremes where 1 + exp(-x)
    overflows (x << 0 must give 0, not NaN) or underflows (x >> 0 must give x)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.cat([
        torch.randn(100_003, device="cuda", generator=g) * 4,
        torch.tensor([-1e30, -3e3, -100.0, -88.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 88.0, 100.0, 3e3, 1e30],
                     device="cuda"),
    ])
    out = torch.full_like(x, float("nan"))
    _silu_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), FAST=fast, BLOCK=1024)
    ref = torch.nn.functional.silu(x.double())
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs()
    # relative to max(|silu(x)|, 1e-30): the approximate exp2 and reciprocal are good to a few ulp
    assert (err <= 4e-6 * ref.abs() + 1e-30).all(), f"worst relative error {(err / ref.abs().clamp_min(1e-30)).max():.3g}"
