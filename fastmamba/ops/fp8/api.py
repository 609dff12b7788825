"""Public entries of the FP8 ops: activation quantisation (per-token dynamic, per-tensor static),
the decode-size W8A8 GEMV, and ``fp8_linear`` which picks among GEMV, ``torch._scaled_mm`` and the
reference. CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``) run ``kernel.py``; other
CPU tensors run ``ref.py``.
"""
from __future__ import annotations

import math

import torch

from fastmamba.ops._common.checks import FLOAT_DTYPES, check_dtype, check_same_device, check_tensors, check_unit_stride
from fastmamba.ops._common.dispatch import use_triton
from fastmamba.ops.fp8 import kernel
from fastmamba.ops.fp8.kernel import (
    launch_fp8_gemv,
    launch_moe_pair_gemv,
    launch_quantize_per_token,
    launch_quantize_static,
)
from fastmamba.ops.fp8.ref import FP8_DTYPE, fp8_linear_ref, fp8_moe_ref, quantize_per_token_ref, quantize_static_ref

GEMV_MAX_ROWS = 16      # rows up to which fp8_linear takes the Triton GEMV (decode and verify steps)
DEQUANT_MIN_TOKENS = 1024  # fp8_moe: from here the experts are dequantised for the grouped 16-bit kernel
_FP8 = (FP8_DTYPE,)


def _rows(op: str, x: torch.Tensor) -> torch.Tensor:
    check_tensors(op, [("x", x)])
    check_dtype(op, "x", x, FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError(f"{op}: `x` expected shape (..., K), got a scalar")
    check_unit_stride(op, "x", x, -1)
    return x.reshape(-1, x.shape[-1])


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token e4m3 quantisation.

    x  [..., K] fp32 / fp16 / bf16, unit stride along K; read
    Returns (q [T, K] e4m3 with T = prod(...), scale [T] fp32), new tensors, x[t] ~= q[t] * scale[t].
    Reference: fastmamba.ops.fp8.ref.quantize_per_token_ref (bit-equal).
    """
    x2 = _rows("quantize_per_token", x)
    if not use_triton(x2):
        return quantize_per_token_ref(x2)
    T, K = x2.shape
    q = torch.empty(T, K, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(T, dtype=torch.float32, device=x.device)
    if T and K:
        launch_quantize_per_token(x2, q, s)
    elif T:
        s.fill_(1e-12 / 448.0)
    return q, s


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static per-tensor e4m3 quantisation with a checkpoint's ``input_scale``.

    x      [..., K] fp32 / fp16 / bf16, unit stride along K; read
    scale  [] or [1] fp32, > 0; read on the device (no host sync)
    Returns q [T, K] e4m3. Reference: fastmamba.ops.fp8.ref.quantize_static_ref (bit-equal).
    """
    op = "quantize_static"
    x2 = _rows(op, x)
    check_tensors(op, [("scale", scale)])
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(f"{op}: `scale` expected one fp32 value, got shape {tuple(scale.shape)} {scale.dtype}")
    check_same_device(op, [("x", x), ("scale", scale)])
    if not use_triton(x2):
        return quantize_static_ref(x2, scale)
    q = torch.empty(x2.shape, dtype=FP8_DTYPE, device=x.device)
    if q.numel():
        launch_quantize_static(x2, scale.reshape(1), q)
    return q


def _channel_scale(op: str, scale: torch.Tensor, N: int) -> torch.Tensor:
    """[N] fp32 view of a per-tensor ([] / [1]) or per-channel ([N] / [N, 1]) weight scale."""
    if scale.dtype != torch.float32:
        raise ValueError(f"{op}: `weight_scale` expected fp32, got {scale.dtype}")
    if scale.numel() == 1:
        return scale.reshape(1).expand(N)
    if scale.numel() == N and scale.dim() <= 2:
        return scale.reshape(N)
    raise ValueError(f"{op}: `weight_scale` expected shape (), (1,), ({N},) or ({N}, 1), got {tuple(scale.shape)}")


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 ``x @ (weight * weight_scale)^T + bias`` for at most 16 rows (decode / verify steps):
    the activation is quantised to e4m3 (per token, or with the static ``input_scale``), then one
    bandwidth-bound kernel reads each weight tile once for all rows.

    x             [..., K] fp16 / bf16 / fp32, unit stride along K, at most 16 rows; read
    weight        [N, K] e4m3 (float8_e4m3fn), unit stride along K; read
    weight_scale  [] / [1] (per tensor) or [N] / [N, 1] (per channel) fp32
    input_scale   None (dynamic per token) or [] / [1] fp32
    bias          [N] or None
    out           [..., N] x's dtype, contiguous; written when given
    Returns y [..., N] in x's dtype. Reference: fastmamba.ops.fp8.ref.fp8_linear_ref.
    """
    op = "fp8_gemv"
    x2 = _rows(op, x)
    check_tensors(op, [("weight", weight), ("weight_scale", weight_scale)],
                  [("input_scale", input_scale), ("bias", bias), ("out", out)])
    check_dtype(op, "weight", weight, _FP8)
    K = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"{op}: `weight` expected shape (N, K={K}), got {tuple(weight.shape)}")
    check_unit_stride(op, "weight", weight, 1)
    N, T = weight.shape[0], x2.shape[0]
    if T > GEMV_MAX_ROWS:
        raise ValueError(f"{op}: x has {T} rows; at most {GEMV_MAX_ROWS} (use fp8_linear)")
    sw = _channel_scale(op, weight_scale, N)
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"{op}: `bias` expected shape ({N},), got {tuple(bias.shape)}")
    check_same_device(op, [("x", x), ("weight", weight), ("weight_scale", weight_scale),
                           ("input_scale", input_scale), ("bias", bias), ("out", out)])
    lead = tuple(x.shape[:-1])
    if out is not None and (out.dtype != x.dtype or tuple(out.shape) != lead + (N,) or not out.is_contiguous()):
        raise ValueError(f"{op}: `out` expected a contiguous {x.dtype} tensor of shape {lead + (N,)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if not use_triton(x2):
        y = fp8_linear_ref(x, weight, weight_scale, input_scale, bias)
        return y if out is None else out.copy_(y)
    y = out if out is not None else torch.empty(lead + (N,), dtype=x.dtype, device=x.device)
    if T and N:
        if kernel.FUSE_QUANT:  # x quantised inside the GEMV: one launch
            scale = None if input_scale is None else input_scale.reshape(1).float()
            launch_fp8_gemv(x2, scale, weight, sw, bias, y.view(T, N), quant=1 if input_scale is None else 2)
        else:
            if input_scale is None:
                q, sx = quantize_per_token(x2)
            else:
                q, sx = quantize_static(x2, input_scale), input_scale.reshape(1).expand(T)
            launch_fp8_gemv(q, sx.contiguous(), weight, sw, bias, y.view(T, N), quant=0)
    return y


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs e4m3 GEMMs on ``device`` (CUDA, compute capability >= 8.9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 linear with the path picked by shape and device.

    Same arguments as ``fp8_gemv`` (any number of rows). Paths: at most 16 rows and a Triton
    device (CUDA, or the CPU interpreter): ``fp8_gemv``; CUDA with FP8 tensor cores (sm89+):
    activation quantised by ``quantize_per_token`` / ``quantize_static``, then ``torch._scaled_mm``
    (cuBLASLt) with row-wise scales (the per-tensor weight scale broadcast to [1, N]); otherwise
    the reference (CPU, pre-Hopper GPUs). Returns y [..., N] in x's dtype.
    """
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() else x
    T = x2.shape[0] if x2.dim() == 2 else 0
    if T <= GEMV_MAX_ROWS and use_triton(x) and (not x.is_cuda or scaled_mm_supported(x.device)):
        return fp8_gemv(x, weight, weight_scale, input_scale, bias)
    if x.is_cuda and scaled_mm_supported(x.device) and x.dtype in (torch.float16, torch.bfloat16):
        N, K = weight.shape
        if K % 16 == 0 and N % 16 == 0:
            if input_scale is None:
                q, sx = quantize_per_token(x2)
            else:
                q, sx = quantize_static(x2, input_scale), input_scale.reshape(1).expand(T)
            sw = _channel_scale("fp8_linear", weight_scale, N)
            # row-wise scaling (cuBLASLt) writes bf16 only; the bias is added after
            y = torch._scaled_mm(q, weight.t(), scale_a=sx.reshape(T, 1).contiguous(),
                                 scale_b=sw.reshape(1, N).contiguous(), out_dtype=torch.bfloat16)
            if bias is not None:
                y = y + bias.to(y.dtype)
            return y.to(x.dtype).reshape(*x.shape[:-1], N)
    return fp8_linear_ref(x, weight, weight_scale, input_scale, bias)


def fp8_moe(x: torch.Tensor, w_up: torch.Tensor, up_scale: torch.Tensor, w_down: torch.Tensor,
            down_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
            up_input_scale: torch.Tensor | None = None,
            down_input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Routed relu² experts with e4m3 weights (W8A8): ``fp8_moe_ref``'s arguments and result.

    x [T, M] 16-bit or fp32; w_up [E, F, M] e4m3, up_scale [E] or [E, F] fp32; w_down [E, M, F]
    e4m3, down_scale [E] or [E, M] fp32; topk_weights [T, k] fp32; topk_ids [T, k] int32/int64;
    up_input_scale / down_input_scale None (dynamic per token) or one fp32 value -> [T, M] x's dtype.

    Paths: at most 16 tokens (decode, verify), CUDA or the CPU interpreter: the pair GEMV
    (``kernel._moe_pair_gemv_kernel``: one program per (token, chosen expert, block of outputs),
    only the chosen experts read; the relu² rows quantised per row between up and down; the k
    contributions summed in fp32 in order). More tokens on CUDA: every expert runs ``fp8_linear``
    on all T rows and the rows that did not choose it get weight 0 -- no host read (CUDA-graph
    safe), FP8 bytes, but E/k times the FLOPs of a grouped kernel; the Triton grouped FP8 MoE GEMM
    (ops/moe's grouped kernel with e4m3 tiles and per-expert scales) is the planned replacement.
    From ``DEQUANT_MIN_TOKENS`` tokens (long prefills), where the dense loop's E/k FLOPs dominate:
    the experts dequantised to x's dtype for the call (a transient 2 bytes a weight) and the
    activations quantised and dequantised, then the 16-bit grouped ``fused_moe``: W8A8 up to one
    16-bit rounding of weights and activations, except that down's input (the relu² rows) keeps
    16 bits instead of e4m3. CPU without the interpreter: the reference (a loop over the chosen experts).
    """
    op = "fp8_moe"
    check_tensors(op, [("x", x), ("w_up", w_up), ("up_scale", up_scale), ("w_down", w_down),
                       ("down_scale", down_scale), ("topk_weights", topk_weights), ("topk_ids", topk_ids)],
                  [("up_input_scale", up_input_scale), ("down_input_scale", down_input_scale)])
    check_dtype(op, "w_up", w_up, _FP8)
    check_dtype(op, "w_down", w_down, _FP8)
    if x.dim() != 2 or w_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"{op}: expected x (T, M), w_up (E, F, M), w_down (E, M, F), got {tuple(x.shape)}, "
                         f"{tuple(w_up.shape)}, {tuple(w_down.shape)}")
    T, M = x.shape
    E, F_, M2 = w_up.shape
    if M2 != M or tuple(w_down.shape) != (E, M, F_):
        raise ValueError(f"{op}: expected w_up (E, F, M={M}) and w_down (E, M, F), got {tuple(w_up.shape)} and "
                         f"{tuple(w_down.shape)}")
    for name, s, n in (("up_scale", up_scale, F_), ("down_scale", down_scale, M)):
        if s.dtype != torch.float32 or tuple(s.shape) not in ((E,), (E, n)):
            raise ValueError(f"{op}: `{name}` expected fp32 of shape ({E},) or ({E}, {n}), got {s.dtype} {tuple(s.shape)}")
    if tuple(topk_ids.shape) != tuple(topk_weights.shape) or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"{op}: `topk_ids` and `topk_weights` expected shape (T={T}, k), got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if not use_triton(x):
        return fp8_moe_ref(x, w_up, up_scale, w_down, down_scale, topk_weights, topk_ids,
                           up_input_scale=up_input_scale, down_input_scale=down_input_scale)
    if T <= GEMV_MAX_ROWS:
        return _fp8_moe_gemv(x, w_up, up_scale, w_down, down_scale, topk_weights, topk_ids,
                             up_input_scale, down_input_scale)
    if T >= DEQUANT_MIN_TOKENS:
        return _fp8_moe_dequantised(x, w_up, up_scale, w_down, down_scale, topk_weights, topk_ids, up_input_scale)
    if not x.is_cuda:
        return _fp8_moe_gemv(x, w_up, up_scale, w_down, down_scale, topk_weights, topk_ids,
                             up_input_scale, down_input_scale)
    out = torch.zeros(T, M, dtype=torch.float32, device=x.device)
    for e in range(E):
        gate = (topk_weights * (topk_ids == e)).sum(-1, keepdim=True)                 # [T, 1] fp32, 0 if not chosen
        h = torch.relu(fp8_linear(x, w_up[e], up_scale[e], up_input_scale)).square()
        out += fp8_linear(h, w_down[e], down_scale[e], down_input_scale).float() * gate
    return out.to(x.dtype)


def _fp8_moe_gemv(x, w_up, up_scale, w_down, down_scale, topk_weights, topk_ids, up_input_scale, down_input_scale):
    """The pair-GEMV path of ``fp8_moe`` (checked arguments; T <= 16 on a GPU)."""
    T, M = x.shape
    E, F_, _ = w_up.shape
    k = topk_ids.shape[1]
    P = T * k
    dev = x.device
    ids = topk_ids.reshape(P).to(torch.int32)
    ids = torch.where((ids >= 0) & (ids < E), ids, -1)   # an id outside [0, E) reads nothing, adds nothing
    tw = topk_weights.reshape(P).float().contiguous()
    su = up_scale.reshape(E, 1).expand(E, F_) if up_scale.dim() == 1 else up_scale
    sd = down_scale.reshape(E, 1).expand(E, M) if down_scale.dim() == 1 else down_scale
    if up_input_scale is None:
        xq, sx = quantize_per_token(x)
    else:
        xq, sx = quantize_static(x, up_input_scale), up_input_scale.reshape(1).expand(T).contiguous()
    h = torch.empty(P, F_, dtype=torch.float32, device=dev)
    yp = torch.empty(P, M, dtype=torch.float32, device=dev)
    if P == 0 or M == 0:
        return torch.zeros(T, M, dtype=x.dtype, device=dev)
    launch_moe_pair_gemv(xq, sx, w_up, su, ids, tw, h, top_k=k, per_pair=False, relu2=True)
    if down_input_scale is None:
        hq, sh = quantize_per_token(h)
    else:
        hq, sh = quantize_static(h, down_input_scale), down_input_scale.reshape(1).expand(P).contiguous()
    launch_moe_pair_gemv(hq, sh, w_down, sd, ids, tw, yp, top_k=k, per_pair=True, relu2=False)
    return yp.view(T, k, M).sum(1).to(x.dtype)


def _fp8_moe_dequantised(x, w_up, up_scale, w_down, down_scale, topk_weights, topk_ids, up_input_scale):
    """The long-prefill path of ``fp8_moe``: dequantised experts through the grouped ``fused_moe``."""
    from fastmamba.ops.moe import fused_moe  # a sibling op, imported at first use

    dt = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float32
    E, F_, M = w_up.shape
    su = up_scale.reshape(E, -1, 1).to(dt)       # [E, 1 or F, 1]
    sd = down_scale.reshape(E, -1, 1).to(dt)     # [E, 1 or M, 1]
    up = w_up.to(dt) * su
    down = w_down.to(dt) * sd
    if up_input_scale is None:
        q, s = quantize_per_token(x)
        xd = (q.to(dt) * s[:, None].to(dt))
    else:
        xd = quantize_static(x, up_input_scale).to(dt) * up_input_scale.to(dt)
    return fused_moe(xd, up, down, topk_weights, topk_ids).to(x.dtype)
