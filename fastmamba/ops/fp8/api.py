"""Public entries of the FP8 ops: activation quantisation (per-token dynamic, per-tensor static),
the decode-size W8A8 GEMV, and ``fp8_linear`` which picks among GEMV, ``torch._scaled_mm`` and the
reference. CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``) run ``kernel.py``; other
CPU tensors run ``ref.py``.
"""
from __future__ import annotations


import torch

from fastmamba.ops._common.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dtype,
    check_flag,
    check_same_device,
    check_tensors,
    check_unit_stride,
)
from fastmamba.ops._common.dispatch import interpreter_enabled, use_triton
from fastmamba.ops._common.host_values import host_reads_allowed
from fastmamba.ops._common.launch import on_device
from fastmamba.ops.fp8 import kernel
from fastmamba.ops.fp8.configs import gemv_config, moe_grouped_config
from fastmamba.ops.fp8.grouped_kernel import launch_moe_grouped, launch_sum
from fastmamba.ops.fp8.kernel import (
    launch_fp8_gemv,
    launch_moe_pair_gemv,
    launch_quantize_per_token,
    launch_quantize_static,
)
from fastmamba.ops.fp8.ref import FP8_DTYPE, fp8_linear_ref, fp8_moe_ref, quantize_per_token_ref, quantize_static_ref

GEMV_MAX_ROWS = 16      # rows up to which fp8_linear takes the Triton GEMV (decode and verify steps)
# tokens up to which fp8_moe takes the pair GEMV, above them the grouped kernel (untuned: the crossover is
# the fastmamba-fp8 / fastmamba-fp8-grouped rows of `python -m fastmamba.bench fp8 --kinds moe`)
MOE_GEMV_MAX_TOKENS = 16
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
             out: torch.Tensor | None = None, relu2_input: bool = False,
             add: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 ``x @ (weight * weight_scale)^T + bias`` for at most 16 rows (decode / verify steps):
    the activation is quantised to e4m3 (per token, or with the static ``input_scale``), then one
    bandwidth-bound kernel reads each weight tile once for all rows.

    x             [..., K] fp16 / bf16 / fp32, unit stride along K, at most 16 rows; read
    weight        [N, K] e4m3 (float8_e4m3fn), unit stride along K; read
    weight_scale  [] / [1] (per tensor) or [N] / [N, 1] (per channel) fp32
    input_scale   None (dynamic per token) or [] / [1] fp32
    bias          [N] or None
    out           [..., N] x's dtype, contiguous; written when given
    relu2_input   the product reads relu(x)² (rounded to x's dtype) instead of x: an MLP's down
                  projection fed its up projection's output, in one launch
    add           [..., N] x's dtype or None: returns add + the product (each rounded to x's dtype, as
                  ``y + add`` would be): a residual sum in the same launch
    Returns y [..., N] in x's dtype. Reference: fastmamba.ops.fp8.ref.fp8_linear_ref (of relu(x)²
    when ``relu2_input``, plus ``add``).
    """
    op = "fp8_gemv"
    x2 = _rows(op, x)
    check_tensors(op, [("weight", weight), ("weight_scale", weight_scale)],
                  [("input_scale", input_scale), ("bias", bias), ("out", out), ("add", add)])
    check_dtype(op, "weight", weight, _FP8)
    relu2_input = check_flag(op, "relu2_input", relu2_input)
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
                           ("input_scale", input_scale), ("bias", bias), ("out", out), ("add", add)])
    lead = tuple(x.shape[:-1])
    if out is not None and (out.dtype != x.dtype or tuple(out.shape) != lead + (N,) or not out.is_contiguous()):
        raise ValueError(f"{op}: `out` expected a contiguous {x.dtype} tensor of shape {lead + (N,)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if add is not None and (add.dtype != x.dtype or tuple(add.shape) != lead + (N,) or add.stride(-1) != 1):
        raise ValueError(f"{op}: `add` expected a {x.dtype} tensor of shape {lead + (N,)} with unit stride along N, "
                         f"got {add.dtype} {tuple(add.shape)} strides {add.stride()}")
    if not use_triton(x2):
        y = fp8_linear_ref(torch.relu(x).square() if relu2_input else x, weight, weight_scale, input_scale, bias)
        y = y if add is None else y + add
        return y if out is None else out.copy_(y)
    y = out if out is not None else torch.empty(lead + (N,), dtype=x.dtype, device=x.device)
    if T and N:
        add2 = add.reshape(T, N) if add is not None else None
        if kernel.FUSE_QUANT:  # x quantised inside the GEMV: one launch
            scale = None if input_scale is None else input_scale.reshape(1).float()
            launch_fp8_gemv(x2, scale, weight, sw, bias, y.view(T, N), quant=1 if input_scale is None else 2,
                            cfg=gemv_config(x2.device, "linear", T, N, K), relu2_input=relu2_input, add=add2)
        else:
            if relu2_input:
                x2 = torch.relu(x2).square()
            if input_scale is None:
                q, sx = quantize_per_token(x2)
            else:
                q, sx = quantize_static(x2, input_scale), input_scale.reshape(1).expand(T)
            launch_fp8_gemv(q, sx.contiguous(), weight, sw, bias, y.view(T, N), quant=0,
                            cfg=gemv_config(x2.device, "linear", T, N, K), add=add2)
    return y


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs e4m3 GEMMs on ``device`` (CUDA, compute capability >= 8.9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
               relu2_input: bool = False, add: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 linear with the path picked by shape and device.

    Same arguments as ``fp8_gemv`` (any number of rows; ``relu2_input`` and ``add`` are fused into
    the GEMV, applied as PyTorch ops around the other paths). Paths: at most 16 rows and a Triton
    device (CUDA, or the CPU interpreter): ``fp8_gemv``; CUDA with FP8 tensor cores (sm89+):
    activation quantised by ``quantize_per_token`` / ``quantize_static``, then ``torch._scaled_mm``
    (cuBLASLt) with row-wise scales (the per-tensor weight scale broadcast to [1, N]); otherwise
    the reference (CPU, pre-Hopper GPUs). Returns y [..., N] in x's dtype.
    """
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() else x
    T = x2.shape[0] if x2.dim() == 2 else 0
    if T <= GEMV_MAX_ROWS and use_triton(x) and (not x.is_cuda or scaled_mm_supported(x.device)):
        return fp8_gemv(x, weight, weight_scale, input_scale, bias, relu2_input=relu2_input, add=add)
    if relu2_input:
        x = torch.relu(x).square()
        x2 = x.reshape(-1, x.shape[-1]) if x.dim() else x
    y = _fp8_linear_unfused(x, x2, T, weight, weight_scale, input_scale, bias)
    return y if add is None else y + add


def _fp8_linear_unfused(x, x2, T, weight, weight_scale, input_scale, bias) -> torch.Tensor:
    """``fp8_linear`` above 16 rows (or without Triton): cuBLASLt where it runs e4m3, else the reference."""
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


def _check_moe(op, x, w_up, up_scale, w_down, down_scale, topk_weights, topk_ids, up_input_scale,
               down_input_scale, out) -> tuple[int, int, int, int, int]:
    """Every check of ``fp8_moe``'s arguments; returns (T, M, F, E, k)."""
    check_tensors(op, [("x", x), ("w_up", w_up), ("up_scale", up_scale), ("w_down", w_down),
                       ("down_scale", down_scale), ("topk_weights", topk_weights), ("topk_ids", topk_ids)],
                  [("up_input_scale", up_input_scale), ("down_input_scale", down_input_scale), ("out", out)])
    check_dtype(op, "x", x, FLOAT_DTYPES)
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
    check_unit_stride(op, "w_up", w_up, -1)
    check_unit_stride(op, "w_down", w_down, -1)
    for name, sc, n in (("up_scale", up_scale, F_), ("down_scale", down_scale, M)):
        if sc.dtype != torch.float32 or tuple(sc.shape) not in ((E,), (E, n)):
            raise ValueError(f"{op}: `{name}` expected fp32 of shape ({E},) or ({E}, {n}), got {sc.dtype} "
                             f"{tuple(sc.shape)}")
    for name, sc in (("up_input_scale", up_input_scale), ("down_input_scale", down_input_scale)):
        if sc is not None and (sc.numel() != 1 or sc.dtype != torch.float32):
            raise ValueError(f"{op}: `{name}` expected None or one fp32 value, got {sc.dtype} {tuple(sc.shape)}")
    check_dtype(op, "topk_ids", topk_ids, INDEX_DTYPES)
    check_dtype(op, "topk_weights", topk_weights, FLOAT_DTYPES)
    if tuple(topk_ids.shape) != tuple(topk_weights.shape) or topk_ids.dim() != 2 or topk_ids.shape[0] != T \
            or topk_ids.shape[1] < 1:
        raise ValueError(f"{op}: `topk_ids` and `topk_weights` expected shape (T={T}, k) with k >= 1, got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if out is not None and (out.dtype != x.dtype or tuple(out.shape) != (T, M)):
        raise ValueError(f"{op}: `out` expected a {x.dtype} tensor of shape ({T}, {M}), got {out.dtype} "
                         f"{tuple(out.shape)}")
    check_same_device(op, [("x", x), ("w_up", w_up), ("up_scale", up_scale), ("w_down", w_down),
                           ("down_scale", down_scale), ("topk_weights", topk_weights), ("topk_ids", topk_ids),
                           ("up_input_scale", up_input_scale), ("down_input_scale", down_input_scale), ("out", out)])
    # ids in [0, E): read only where that costs no device sync (CPU tensors, outside capture / tracing /
    # trusted inputs), as fused_moe does. On a GPU an id outside the range is not read: its pair adds nothing.
    if not topk_ids.is_cuda and host_reads_allowed(topk_ids) and topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= E:
            raise ValueError(f"{op}: `topk_ids` values must lie in [0, E={E}); got {lo if lo < 0 else hi}")
    return T, M, F_, E, topk_ids.shape[1]


def fp8_moe(x: torch.Tensor, w_up: torch.Tensor, up_scale: torch.Tensor, w_down: torch.Tensor,
            down_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
            up_input_scale: torch.Tensor | None = None, down_input_scale: torch.Tensor | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Routed relu² experts with e4m3 weights (W8A8): ``fp8_moe_ref``'s arguments and result.

    x                 [T, M] fp16 / bf16 / fp32, any strides; read
    w_up              [E, F, M] e4m3, unit stride along M; up_scale [E] (per tensor) or [E, F] (per channel) fp32
    w_down            [E, M, F] e4m3, unit stride along F; down_scale [E] or [E, M] fp32
    topk_weights      [T, k] float (read as fp32); topk_ids [T, k] int32/int64 in [0, E) (checked on CPU
                      tensors; on a GPU an id outside it adds nothing); any strides
    up_input_scale, down_input_scale   None (dynamic per-token activations) or one fp32 value (static)
    out               [T, M] x's dtype, any strides; written when given
    Returns [T, M] in x's dtype (``out`` when given). No host read of device values (CUDA-graph safe).

    Paths: CPU without ``TRITON_INTERPRET=1``: the reference. At most ``MOE_GEMV_MAX_TOKENS`` (16)
    tokens (decode, verify): the pair GEMV (``kernel._moe_pair_gemv_kernel``: one program per
    (token, chosen expert, block of outputs), only the chosen experts read). More tokens, on a GPU
    with FP8 tensor cores (sm89+) or the interpreter: ``fp8_moe_grouped``. More tokens on an older
    GPU (no e4m3 in Triton there): the experts dequantised for the call (a transient 2 bytes a
    weight) through the 16-bit grouped ``fused_moe`` (W8A8 up to a 16-bit rounding, except that
    down's input keeps 16 bits).
    """
    T, M, F_, E, k = _check_moe("fp8_moe", x, w_up, up_scale, w_down, down_scale, topk_weights, topk_ids,
                                up_input_scale, down_input_scale, out)
    if not use_triton(x):
        y = fp8_moe_ref(x, w_up, up_scale, w_down, down_scale, topk_weights, topk_ids,
                        up_input_scale=up_input_scale, down_input_scale=down_input_scale)
        return y if out is None else out.copy_(y)
    if T <= MOE_GEMV_MAX_TOKENS:
        y = _fp8_moe_gemv(x, w_up, up_scale, w_down, down_scale, topk_weights, topk_ids,
                          up_input_scale, down_input_scale)
        return y if out is None else out.copy_(y)
    if x.is_cuda and not scaled_mm_supported(x.device):
        y = _fp8_moe_dequantised(x, w_up, up_scale, w_down, down_scale, topk_weights, topk_ids, up_input_scale)
        return y if out is None else out.copy_(y)
    return _fp8_moe_grouped(x, w_up, up_scale, w_down, down_scale, topk_weights, topk_ids, up_input_scale,
                            down_input_scale, out, T, M, F_, E, k)


def fp8_moe_grouped(x: torch.Tensor, w_up: torch.Tensor, up_scale: torch.Tensor, w_down: torch.Tensor,
                    down_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                    up_input_scale: torch.Tensor | None = None, down_input_scale: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``fp8_moe`` on its grouped W8A8 path whatever T is (the path it takes above 16 tokens): same
    arguments and result. Needs a GPU with FP8 tensor cores (sm89+) or the CPU interpreter; other
    CPU tensors run the reference.

    Steps (grouped_kernel.launch_moe_grouped): x quantised to e4m3 (per token, or with ``up_input_scale``);
    ops/moe's alignment sorts the (token, expert) pairs by expert into blocks of BM rows (no host
    read: buffers sized from (T, k, E, BM)); up GEMM, e4m3 x e4m3 ``tl.dot`` with fp32 accumulation,
    scales and relu² in the epilogue, one row per pair; those rows quantised per row (or with
    ``down_input_scale``, inside the up kernel); down GEMM likewise, times the routing weight; the k
    contributions of each token summed in fp32 in a fixed order. Deterministic; reads only the
    experts some token chose. Reference: ``ref.fp8_moe_ref``.
    """
    op = "fp8_moe_grouped"
    T, M, F_, E, k = _check_moe(op, x, w_up, up_scale, w_down, down_scale, topk_weights, topk_ids,
                                up_input_scale, down_input_scale, out)
    if not use_triton(x):
        y = fp8_moe_ref(x, w_up, up_scale, w_down, down_scale, topk_weights, topk_ids,
                        up_input_scale=up_input_scale, down_input_scale=down_input_scale)
        return y if out is None else out.copy_(y)
    if x.is_cuda and not scaled_mm_supported(x.device):
        raise ValueError(f"{op}: needs a GPU with FP8 tensor cores (compute capability >= 8.9), got "
                         f"{torch.cuda.get_device_name(x.device)}; fp8_moe picks a path that runs there")
    return _fp8_moe_grouped(x, w_up, up_scale, w_down, down_scale, topk_weights, topk_ids, up_input_scale,
                            down_input_scale, out, T, M, F_, E, k)


def _fp8_moe_grouped(x, w_up, up_scale, w_down, down_scale, topk_weights, topk_ids, up_input_scale,
                     down_input_scale, out, T, M, F_, E, k):
    """The grouped path (checked arguments)."""
    dev = x.device
    y = out if out is not None else torch.empty(T, M, dtype=x.dtype, device=dev)
    if T == 0 or M == 0:
        return y
    if F_ == 0:  # an empty expert width: every contribution is an empty sum
        return y.zero_()
    su = up_scale.reshape(E, 1).expand(E, F_) if up_scale.dim() == 1 else up_scale      # [E, F], stride 0: per tensor
    sd = down_scale.reshape(E, 1).expand(E, M) if down_scale.dim() == 1 else down_scale  # [E, M]
    cfg = moe_grouped_config(T, k, E, M, F_, interpreter=interpreter_enabled())
    with on_device(x):
        xq = torch.empty(T, M, dtype=FP8_DTYPE, device=dev)
        if up_input_scale is None:
            sx = torch.empty(T, dtype=torch.float32, device=dev)
            launch_quantize_per_token(x, xq, sx)
        else:
            s = up_input_scale.reshape(1)
            launch_quantize_static(x, s, xq)
            sx = s.expand(T)
        hs = None if down_input_scale is None else down_input_scale.reshape(1)
        launch_moe_grouped(xq, sx, w_up, su, w_down, sd, topk_weights, topk_ids, hs, y, cfg)
    return y


def _static(scale: torch.Tensor | None) -> torch.Tensor | None:
    """A static input scale as the kernels read it: one fp32 value (None: dynamic per row)."""
    return None if scale is None else scale.reshape(1).float()


def _fp8_moe_gemv(x, w_up, up_scale, w_down, down_scale, topk_weights, topk_ids, up_input_scale, down_input_scale):
    """The pair-GEMV path of ``fp8_moe`` (checked arguments; T <= 16)."""
    T, M = x.shape
    E, F_, _ = w_up.shape
    k = topk_ids.shape[1]
    P = T * k
    dev = x.device
    ids = topk_ids.reshape(P)  # an id outside [0, E) reads nothing; the k-sum skips its pair
    tw = topk_weights.reshape(P).float().contiguous()
    su = up_scale.reshape(E, 1).expand(E, F_) if up_scale.dim() == 1 else up_scale
    sd = down_scale.reshape(E, 1).expand(E, M) if down_scale.dim() == 1 else down_scale
    if P == 0 or M == 0:
        return torch.zeros(T, M, dtype=x.dtype, device=dev)
    if x.stride(-1) != 1:  # T <= 16 rows: a copy of a few KB for the kernel's unit-stride rows
        x = x.contiguous()
    # x and h are quantised inside the pair GEMVs, per row as quantize_per_token does (or with the
    # static input scales): three launches with the k-sum, no quantisation kernel between them
    h = torch.empty(P, F_, dtype=torch.float32, device=dev)
    yp = torch.empty(P, M, dtype=torch.float32, device=dev)
    cfg = gemv_config(dev, "moe", 1, F_, M)
    launch_moe_pair_gemv(x, _static(up_input_scale), w_up, su, ids, tw, h, top_k=k, per_pair=False, relu2=True,
                         quant=1 if up_input_scale is None else 2, cfg=cfg)
    launch_moe_pair_gemv(h, _static(down_input_scale), w_down, sd, ids, tw, yp, top_k=k, per_pair=True, relu2=False,
                         quant=1 if down_input_scale is None else 2, cfg=cfg)
    out = torch.empty(T, M, dtype=x.dtype, device=dev)
    launch_sum(yp, out, topk_ids, E)  # the k pairs of each token in order, fp32, one launch
    return out


def _fp8_moe_dequantised(x, w_up, up_scale, w_down, down_scale, topk_weights, topk_ids, up_input_scale):
    """``fp8_moe`` above 16 tokens on a GPU without FP8 tensor cores: dequantised experts through the
    grouped 16-bit ``fused_moe``."""
    from fastmamba.ops.moe import fused_moe  # a sibling op, imported at first use

    dt = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float32
    E, F_, M = w_up.shape
    su = up_scale.reshape(E, -1, 1).to(dt)       # [E, 1 or F, 1]
    sd = down_scale.reshape(E, -1, 1).to(dt)     # [E, 1 or M, 1]
    up = w_up.to(dt) * su
    down = w_down.to(dt) * sd
    if up_input_scale is None:
        q, s = quantize_per_token(x if x.stride(-1) == 1 else x.contiguous())
        xd = (q.to(dt) * s[:, None].to(dt))
    else:
        xd = quantize_static(x if x.stride(-1) == 1 else x.contiguous(), up_input_scale).to(dt) * up_input_scale.to(dt)
    return fused_moe(xd, up, down, topk_weights, topk_ids).to(x.dtype)
