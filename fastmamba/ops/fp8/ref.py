"""Plain-PyTorch references of the FP8 (e4m3) ops, fp32 inside: the executable definition of what
the kernels of ``kernel.py`` and ``fastmamba.layers.fp8_linear.FP8Linear`` compute.

Letters: T rows (tokens), K input features, N output features; MoE: M model width, E experts,
F expert width, k experts per token.

    quantize_per_token_ref(x)   s[t] = max(amax(|x[t]|), AMAX_FLOOR) / 448;  q[t] = e4m3(x[t] * (1 / s[t]))
    quantize_static_ref(x, s)   q = e4m3(clamp(x * (1 / s), -448, 448))
    quantize_weight_ref(w)      per channel (s[n] over row n) or per tensor (one s)
    fp8_linear_ref(x, w, sw, sx) (q(x) * sx) @ (w * sw)^T + bias, in x's dtype
    fp8_moe_ref(...)            fused_moe_ref with every expert GEMM as fp8_linear_ref

e4m3 here is ``torch.float8_e4m3fn`` (max 448, no infinity), rounded to nearest even; values are
clamped to +-448 first because torch's cast turns out-of-range values into NaN. Activations are
scaled by a multiply with the fp32 reciprocal of their scale (one IEEE division a row, ``div_rn`` in
the kernels), so a kernel's quantised bytes equal these bit for bit; a division per value cost the
decode GEMVs ~10 instructions each (docs/experiments/moe.md). Weights are quantised on load only
(here), by division.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0             # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-12          # an all-zero row gets a tiny positive scale (no 0/0)


def to_fp8_ref(x: torch.Tensor) -> torch.Tensor:
    """fp32 values -> e4m3 with saturation at +-448 (NaN stays NaN)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] float -> (q [T, K] e4m3, scale [T] fp32) with x[t] ~= q[t] * scale[t]."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp(min=AMAX_FLOOR) / FP8_MAX
    return to_fp8_ref(xf * (1.0 / scale)[:, None]), scale


def quantize_static_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, K] float, scale [] or [1] fp32 (a checkpoint's ``input_scale``) -> q [T, K] e4m3."""
    return to_fp8_ref(x.float() * (1.0 / scale.float().reshape(())))


def quantize_weight_ref(w: torch.Tensor, *, per_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] e4m3, scale [N] fp32 per channel, or [] per tensor)."""
    wf = w.float()
    if per_channel:
        scale = wf.abs().amax(dim=-1).clamp(min=AMAX_FLOOR) / FP8_MAX
        return to_fp8_ref(wf / scale[:, None]), scale
    scale = wf.abs().amax().clamp(min=AMAX_FLOOR) / FP8_MAX
    return to_fp8_ref(wf / scale), scale


def dequantize_ref(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [N, K] (or [E, N, K]) e4m3 and its scale: [] per tensor, [N] / [N, 1] per channel
    ([E] / [E, N] / [E, N, 1] for stacked experts) -> fp32 values."""
    s = scale.float()
    while s.dim() < q.dim():
        s = s.unsqueeze(-1)
    return q.float() * s


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 linear: x [..., K] float; weight [N, K] e4m3; weight_scale [] or [N] (or [N, 1]) fp32;
    input_scale None (dynamic per-token activations) or [] / [1] fp32 (static); bias [N] or None
    -> y [..., N] in x's dtype: (q(x) * sx) @ (weight * weight_scale)^T + bias, fp32 inside."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if input_scale is None:
        qx, sx = quantize_per_token_ref(x2)
        xd = qx.float() * sx[:, None]
    else:
        xd = quantize_static_ref(x2, input_scale).float() * input_scale.float().reshape(())
    y = xd @ dequantize_ref(weight, weight_scale).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, weight.shape[0])


def fp8_moe_ref(x: torch.Tensor, w_up: torch.Tensor, up_scale: torch.Tensor, w_down: torch.Tensor,
                down_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                up_input_scale: torch.Tensor | None = None,
                down_input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Routed relu² experts with e4m3 weights: ``fused_moe_ref`` where each expert GEMM is
    ``fp8_linear_ref``.

    x [T, M] float; w_up [E, F, M] e4m3 with up_scale [E] (per tensor) or [E, F] (per channel);
    w_down [E, M, F] e4m3 with down_scale [E] or [E, M]; topk_weights [T, k] fp32; topk_ids [T, k]
    int; up_input_scale / down_input_scale: None (dynamic per token) or one fp32 scale shared by
    every expert (ModelOpt's per-expert input scales are folded to their maximum on load, as vLLM
    does) -> [T, M] in x's dtype. The expert's hidden relu(up x)^2 is quantised again for ``down``.
    """
    T, M = x.shape
    out = torch.zeros(T, M, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in topk_ids.unique().tolist():
        tok, j = torch.where(topk_ids == e)
        h = torch.relu(fp8_linear_ref(xf[tok], w_up[e], up_scale[e], up_input_scale)).square()
        y = fp8_linear_ref(h, w_down[e], down_scale[e], down_input_scale)
        out.index_add_(0, tok, y * topk_weights[tok, j].float()[:, None])
    return out.to(x.dtype)
