"""Nemotron-H's MLP layer: ``down_proj(relu(up_proj(x)) ** 2)``, not gated, no per-request state.

Parameter names follow transformers' ``NemotronHMLP``: ``up_proj`` [F, M], ``down_proj`` [M, F]
(each with a bias when ``mlp_bias``). Prefill and decode are the same per-token map.
"""
from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_model: int, intermediate_size: int, *, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.up_proj = nn.Linear(d_model, intermediate_size, bias=bias, device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, d_model, bias=bias, device=device, dtype=dtype)

    def forward(self, u: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """u [..., M] -> [..., M]; relu2 = relu(x)^2 (transformers' ``ACT2FN["relu2"]``). ``add``
        [..., M] (u's dtype) or None: returns add + the MLP's output (a MoE layer's routed sum).
        An FP8 down projection (``FP8Linear``) takes relu² and the sum into its GEMV: one launch
        where three elementwise kernels would follow it, with the same roundings."""
        h = self.up_proj(u)
        if getattr(self.down_proj, "fuses_relu2_input", False):
            return self.down_proj(h, relu2_input=True, add=add)
        y = self.down_proj(torch.relu(h).square())
        return y if add is None else y + add
