"""The shared @triton.jit helpers: the approximate silu and exp (inline PTX, GPU only) against torch."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from fastmamba.ops._common.jit_math import exp_approx, silu_approx


@triton.jit
def _silu_kernel(x_ptr, out_ptr, n, FAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, silu_approx(x, FAST), mask=offs < n)


@triton.jit
def _exp_kernel(x_ptr, out_ptr, n, FAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, exp_approx(x, FAST), mask=offs < n)


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [True, False])
def test_exp_approx_matches_torch_on_decay_arguments(fast):
    """exp of the scan's log-decays (<= 0, down to -inf for masked entries) against float64:
    a few ulp where the result is a normal fp32, 0 at -inf and below the normal range."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.cat([
        -torch.rand(100_003, device="cuda", generator=g) * 80,
        torch.tensor([float("-inf"), -1e30, -200.0, -87.0, -1e-30, 0.0, 1e-30, 1.0, 20.0], device="cuda"),
    ])
    out = torch.full_like(x, float("nan"))
    _exp_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), FAST=fast, BLOCK=1024)
    ref = torch.exp(x.double())
    assert not torch.isnan(out).any()
    normal = ref >= torch.finfo(torch.float32).tiny
    err = (out.double() - ref).abs()
    assert (err[normal] <= 4e-6 * ref[normal]).all(), f"worst relative error {(err[normal] / ref[normal]).max():.3g}"
    assert (out[~normal] <= torch.finfo(torch.float32).tiny).all() and (out[~normal] >= 0).all()


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
