"""FP8 (e4m3) W8A8 layers: ``FP8Linear`` for the dense projections and ``FP8Experts`` for the
routed MoE experts. Both hold the checkpoint's tensors under its names, so ``load_into`` copies
the bytes as they are:

    FP8Linear   weight        [N, K]  float8_e4m3fn
                weight_scale  []  (per tensor: ModelOpt FP8)  or  [N]  (per channel: compressed-tensors
                              "channel", ``--quantization fp8``), fp32
                input_scale   []  fp32 static activation scale (ModelOpt FP8), or absent: dynamic per token
                bias          [N] in the model dtype, when the layer has one
    FP8Experts  up_proj [E, F, M'] / down_proj [E, M', F] e4m3, up_proj_weight_scale [E] or [E, F],
                down_proj_weight_scale [E] or [E, M'], and with static activations
                up_proj_input_scale / down_proj_input_scale [] (the maximum over the experts' scales)

forward(x) = (q(x) * sx) @ (weight * weight_scale)^T + bias in x's dtype (``fastmamba.ops.fp8``:
the Triton GEMV for at most 16 rows, ``torch._scaled_mm`` on FP8 GPUs for more, the reference on
a CPU without the interpreter). The weights are never dequantised in memory.
"""
from __future__ import annotations

import torch
from torch import nn

from fastmamba.ops.fp8 import FP8_DTYPE, fp8_linear, fp8_moe, quantize_weight_ref


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class FP8Linear(nn.Module):
    """``nn.Linear``'s drop-in with e4m3 weights (see the module doc for the tensors)."""

    fuses_relu2_input = True  # forward(x, relu2_input=True, add=...): an MLP's down projection in one launch

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, per_channel: bool = True,
                 static_input: bool = False, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _frozen(torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.weight_scale = _frozen(torch.ones((out_features,) if per_channel else (), dtype=torch.float32,
                                               device=device))
        self.input_scale = _frozen(torch.ones((), dtype=torch.float32, device=device)) if static_input else None
        self.bias = _frozen(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    @property
    def per_channel(self) -> bool:
        return self.weight_scale.dim() == 1

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> "FP8Linear":
        """A 16-bit ``nn.Linear`` quantised on load: per-channel weight scales, dynamic per-token
        activations (``--quantization fp8``)."""
        w = linear.weight
        out = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, per_channel=True,
                  device=w.device, dtype=w.dtype)
        q, s = quantize_weight_ref(w, per_channel=True)
        out.weight.copy_(q)
        out.weight_scale.copy_(s)
        if linear.bias is not None:
            out.bias.copy_(linear.bias)
        return out

    def forward(self, x: torch.Tensor, *, relu2_input: bool = False, add: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype. ``relu2_input``: of relu(x)² instead of x; ``add``
        [..., N]: plus it (both fused into the decode GEMV: ``fastmamba.ops.fp8.fp8_linear``)."""
        return fp8_linear(x, self.weight, self.weight_scale, self.input_scale, self.bias, relu2_input=relu2_input,
                          add=add)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight=e4m3 per {'channel' if self.per_channel else 'tensor'}, "
                f"activations={'static per tensor' if self.input_scale is not None else 'dynamic per token'}")


class FP8Experts(nn.Module):
    """The routed experts of ``fastmamba.layers.moe.MoE`` with e4m3 weights; ``run(h, routing)``
    replaces the 16-bit ``fused_moe`` call (the MoE layer calls ``run`` when its experts have one)."""

    def __init__(self, n_experts: int, width: int, d_in: int, *, per_channel: bool = True,
                 static_input: bool = False, device=None):
        super().__init__()
        E, F_, M = n_experts, width, d_in
        self.up_proj = _frozen(torch.zeros(E, F_, M, dtype=FP8_DTYPE, device=device))
        self.down_proj = _frozen(torch.zeros(E, M, F_, dtype=FP8_DTYPE, device=device))
        f32 = dict(dtype=torch.float32, device=device)
        self.up_proj_weight_scale = _frozen(torch.ones((E, F_) if per_channel else (E,), **f32))
        self.down_proj_weight_scale = _frozen(torch.ones((E, M) if per_channel else (E,), **f32))
        self.up_proj_input_scale = _frozen(torch.ones((), **f32)) if static_input else None
        self.down_proj_input_scale = _frozen(torch.ones((), **f32)) if static_input else None

    @classmethod
    @torch.no_grad()
    def from_experts(cls, experts: nn.Module) -> "FP8Experts":
        """16-bit ``Experts`` (up_proj [E, F, M'], down_proj [E, M', F]) quantised per channel."""
        E, F_, M = experts.up_proj.shape
        out = cls(E, F_, M, per_channel=True, device=experts.up_proj.device)
        for name in ("up_proj", "down_proj"):
            w = getattr(experts, name)
            for e in range(E):  # one expert at a time: the fp32 temporaries stay one expert's size
                q, s = quantize_weight_ref(w[e], per_channel=True)
                getattr(out, name)[e].copy_(q)
                getattr(out, name + "_weight_scale")[e].copy_(s)
        return out

    def run(self, h: torch.Tensor, routing) -> torch.Tensor:
        """h [T, M'] -> [T, M'] in h's dtype: sum over each token's k experts (``fastmamba.ops.fp8.fp8_moe``:
        the pair GEMV for a decode step's few tokens, the grouped W8A8 kernel above; no host read)."""
        return fp8_moe(h, self.up_proj, self.up_proj_weight_scale, self.down_proj, self.down_proj_weight_scale,
                       routing.weights, routing.ids, up_input_scale=self.up_proj_input_scale,
                       down_input_scale=self.down_proj_input_scale)
