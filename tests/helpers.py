"""Shared test utilities: poisoned buffers, dtype tolerances, seeded generators."""
from __future__ import annotations

import torch

# (atol, rtol) by the lowest-precision dtype involved; the reference runs in fp32 from the same
# low-precision inputs (STYLE.md section 5).
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (5e-2, 1e-2),
}


def tol(*dtypes: torch.dtype) -> dict[str, float]:
    """assert_close kwargs for the loosest of ``dtypes``."""
    order = [torch.float32, torch.float16, torch.bfloat16]
    worst = max(dtypes, key=order.index)
    atol, rtol = TOLERANCES[worst]
    return {"atol": atol, "rtol": rtol}


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer that fails any comparison where the kernel forgot to write."""
    return torch.full_like(t, float("nan"))


def seeded(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g
