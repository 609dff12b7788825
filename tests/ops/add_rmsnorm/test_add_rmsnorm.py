"""add_rmsnorm vs its fp32 reference (CPU: Triton interpreter)."""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops import add_rmsnorm
from fastmamba.ops.add_rmsnorm.ref import add_rmsnorm_ref
from tests.helpers import tol


@pytest.mark.parametrize("rows,D,xdt,rdt,wdt", [
    (3, 80, torch.float32, torch.float32, torch.float32),   # base: D not a power of two
    (1, 80, torch.float32, torch.float32, torch.float32),   # one row
    (5, 96, torch.bfloat16, torch.float32, torch.bfloat16),  # Mamba-2: bf16 block output, fp32 residual
    (4, 64, torch.float16, None, torch.float16),             # no residual (the first block)
], ids=["base", "B1", "bf16-x-fp32-res", "no-residual"])
def test_matches_reference(rows, D, xdt, rdt, wdt, device):
    g = torch.Generator().manual_seed(rows * D)
    x = torch.randn(rows, 2, D, generator=g).to(device, xdt)[:, 1]  # strided rows
    res = None if rdt is None else torch.randn(rows, D, generator=g).to(device, rdt)
    w = (1 + 0.3 * torch.randn(D, generator=g)).to(device, wdt)
    y, s = add_rmsnorm(x, res, w, 1e-5)
    y_ref, s_ref = add_rmsnorm_ref(x, res, w, 1e-5)
    assert y.dtype == wdt and s.dtype == (rdt or torch.float32)
    torch.testing.assert_close(s, s_ref, **tol(xdt, s.dtype))
    torch.testing.assert_close(y.float(), y_ref.float(), **tol(xdt, wdt))


def test_bad_input():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"`weight` expected shape \(8,\)"):
        add_rmsnorm(x, None, torch.ones(7))
    with pytest.raises(ValueError, match="`residual` expected shape"):
        add_rmsnorm(x, torch.randn(2, 9), torch.ones(8))
    with pytest.raises(TypeError, match="`x` expected dtype"):
        add_rmsnorm(x.int(), None, torch.ones(8))
