"""Plain-PyTorch reference for gated RMSNorm (the executable definition of the op).

Written for a reviewer, not for speed: fp32 inside, one line per step. Dh is the normalised
(last) dimension, split into Dh // group_size groups; each (row, group) gets its own rstd:

    norm_before_gate=True:   y = x * rstd(x) * weight + bias;   y = y * silu(z)   (when z is given)
    norm_before_gate=False:  v = x * silu(z)   (when z is given, else v = x)
                             y = v * rstd(v) * weight + bias
    rstd(v) = 1 / sqrt(mean(v**2 over the group) + eps)

Matches ``mamba_ssm.ops.triton.layernorm_gated.rms_norm_ref`` with ``upcast=True``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rmsnorm_ref(
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
    """Same contract as :func:`fastmamba.ops.gated_rmsnorm.rmsnorm_fn`; see its docstring.

    Inputs are not validated here (the public function does that before dispatching).
    """
    Dh = x.shape[-1]
    group_size = Dh if group_size is None else group_size
    G = Dh // group_size

    v = x.float()
    if z is not None and not norm_before_gate:
        v = v * F.silu(z.float())

    v_groups = v.unflatten(-1, (G, group_size))                      # (..., G, group_size)
    rstd = 1.0 / torch.sqrt(v_groups.square().mean(dim=-1, keepdim=True) + eps)
    y = (v_groups * rstd).flatten(-2) * weight.float()               # (..., Dh)
    if bias is not None:
        y = y + bias.float()

    if z is not None and norm_before_gate:
        y = y * F.silu(z.float())

    y = y.to(x.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y
