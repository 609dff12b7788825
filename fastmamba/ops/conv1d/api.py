"""Public entry for the conv1d decode step: checks, allocation, the registered in-place op."""
from __future__ import annotations

from typing import Optional

import torch

from fastmamba.ops._common.host_values import host_reads_allowed
from fastmamba.ops._common.checks import (
    FLOAT_DTYPES,
    check_index_values,
    INDEX_DTYPES,
    check_dtype,
    check_indices,
    check_same_device,
    check_same_dtype,
    check_shape,
    parse_activation,
    check_tensors,
    check_int,
)
from fastmamba.ops._common.dispatch import call_directly, use_triton
from fastmamba.ops._common import pdl as _pdl
from fastmamba.ops._common.plans import PlanCache, sig
from fastmamba.ops._common import slot_errors
from fastmamba.ops.conv1d import configs as conv_configs
from fastmamba.ops.conv1d.kernel import causal_conv1d_update_launch, causal_conv1d_update_plan, launch_update_plan
from fastmamba.ops.conv1d.ref import causal_conv1d_update_ref

_OP = "causal_conv1d_update"
_WIDTHS = range(2, 7)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | bool | None = None,
    cache_seqlens: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
    *,
    pad_slot_id: int = -1,
    num_accepted_tokens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of the depthwise causal conv (drop-in for causal_conv1d's / vLLM's op).

    x          [B, D] or [B, D, L]  fp32, bf16 or fp16, any strides; read. L > 1 verifies L
                                    speculative tokens at once (L is compiled in: keep it small)
    conv_state [S, D, state_len]    fp32, bf16 or fp16 (may differ from x), any strides, e.g. the
                                    channel-last view of an [S, state_len, D] buffer; state_len >= W-1
                                    (W-1 as in vLLM, W as in mamba_ssm). Rows of the requests'
                                    slots are mutated in place; other rows are not touched
    weight     [D, W]               fp32, bf16 or fp16 (e.g. fp32 next to a bf16 x), W in 2..6
    bias       [D]                  fp32, bf16 or fp16, or None
    activation None, "silu" or "swish" (True / False are read as "silu" / None, as vLLM does)
    cache_seqlens [B] int32/int64   circular-buffer mode (causal_conv1d): x[:, :, t] is written at
                                    state column (cache_seqlens[b] + t) % state_len and the window
                                    is the W-1 columns circularly before it; outputs read the
                                    state as it was before this call's writes. Not modified.
    conv_state_indices [B] int32/int64: state row per request (None: row b, needs S >= B);
                                    rows equal to pad_slot_id get y = 0 and touch no state; a value
                                    outside [0, S) raises ValueError, at once where reading it costs
                                    no synchronize (CPU indices, a call signature's first call), else
                                    (repeated plain calls on a GPU) the kernel skips the row and the
                                    op's next call raises (fastmamba.ops._common.slot_errors)
    num_accepted_tokens [B] int32/int64 (vLLM speculative decoding): history length
                                    h = num_accepted_tokens[b] + W - 2, i.e. token 0's window starts
                                    at state column num_accepted_tokens[b] - 1; values must lie in
                                    [1, state_len - W + 2]. Excludes cache_seqlens.
    out        like x               written when given (may be x itself)
    Returns y  like x (shape and dtype): y[t] = act(bias + sum_k weight[:, k] * hist[h-(W-1)+t+k])
               with hist = concat(state[:, :h], x) and h = state_len unless num_accepted_tokens;
               the new state is hist[:, h+L-state_len : h+L] (negative columns written as 0).

    Precision: x, the state, weight and bias are converted to fp32 as they are loaded; the window
    sum, bias and SiLU run in fp32; y is rounded once to x's dtype, and the state stores x's values
    in the state's dtype. All checks run before anything is written. Two requests must not share
    a (non-pad) slot. Index range checks read the indices on the host (one sync), except while a
    CUDA graph is being captured.
    Reference: fastmamba.ops.conv1d.ref.causal_conv1d_update_ref

    >>> x = torch.tensor([[1.0, 2.0]])                        # B=1, D=2
    >>> state = torch.tensor([[[0.0, 0.0, 3.0], [1.0, 1.0, 1.0]]])  # S=1, D=2, state_len=3
    >>> causal_conv1d_update(x, state, torch.ones(2, 4))      # W=4: sum of the last 4 inputs
    tensor([[4., 5.]])
    >>> state                                                  # shifted left, x appended
    tensor([[[0., 3., 1.],
             [1., 1., 2.]]])
    """
    # Fast path: a signature an earlier call validated (every check but the index values depends on
    # the signature alone): check the slot values, allocate, launch (issue 19: eager host time).
    if num_accepted_tokens is None and pad_slot_id.__class__ is int and type(x) is torch.Tensor:
        try:
            key = (x.shape, x.stride(), x.dtype, x.device, sig(conv_state), sig(weight), sig(bias),
                   sig(cache_seqlens), sig(conv_state_indices), sig(out), activation, pad_slot_id, _pdl._enabled,
                   conv_configs._forced.value, _device_check(conv_state_indices))
        except (AttributeError, TypeError):  # a non-tensor or an unhashable activation: the checks say which
            key = None
        checked_on_device = key is not None and key[-1]
        if checked_on_device and slot_errors.slot_record(_OP, x.device)[1][0]:
            slot_errors.raise_pending(_OP, x.device, SLOT_NAMES)  # what an earlier call's kernel found
        plan = _PLANS.get(key)
        if plan is not None and use_triton(x) and call_directly(x):
            if not checked_on_device and conv_state_indices is not None and host_reads_allowed(conv_state_indices):
                check_index_values(_OP, "conv_state_indices", conv_state_indices, conv_state.shape[0], pad_slot_id)
            if out is None:
                out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            launch_update_plan(plan, x, conv_state, weight, bias, cache_seqlens, conv_state_indices, None, out)
            return out
    else:
        key = None
    check_tensors(_OP, [("x", x), ("conv_state", conv_state), ("weight", weight)],
                  [("bias", bias), ("cache_seqlens", cache_seqlens), ("conv_state_indices", conv_state_indices),
                   ("num_accepted_tokens", num_accepted_tokens), ("out", out)])
    pad_slot_id = check_int(_OP, "pad_slot_id", pad_slot_id)
    silu = parse_activation(_OP, activation)
    _check_inputs(
        x, conv_state, weight, bias, cache_seqlens, conv_state_indices, num_accepted_tokens, out, pad_slot_id
    )
    slot_errors.raise_pending(_OP, x.device, SLOT_NAMES)  # an earlier lean call's bad index: report it at this call
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if key is not None and use_triton(x) and call_directly(x) and _PLANS.has_room():
        x3 = x.unsqueeze(-1) if x.dim() == 2 else x
        out3 = out.unsqueeze(-1) if out.dim() == 2 else out
        plan = _PLANS[key] = causal_conv1d_update_plan(
            x3, conv_state, weight, bias, cache_seqlens, conv_state_indices, None, out3, silu, pad_slot_id,
            report_slots=key[-1])
        launch_update_plan(plan, x, conv_state, weight, bias, cache_seqlens, conv_state_indices, None, out)
        return out
    op = _causal_conv1d_update_impl if call_directly() else _causal_conv1d_update_
    op(
        x, conv_state, weight, bias, cache_seqlens, conv_state_indices, num_accepted_tokens, out, silu, pad_slot_id
    )
    return out


# Launch plans of plain eager calls whose signature passed every check (see the fast path above),
# keyed by each tensor's shape, strides, dtype and device, the activation and the pad id (and the
# PDL switch, which the plan depends on). Tests that swap a kernel-choice hook clear it
# (``plans.clear_plans``).
_PLANS = PlanCache("causal_conv1d_update", 1024)


# Whether the lean path checks CPU indices in the kernel too (tests of the device check without a
# GPU; on a CPU the host read costs no synchronize, so it stays off).
DEVICE_CHECK_CPU = False
SLOT_NAMES = ("conv_state_indices",)
slot_errors.NAMES[_OP] = SLOT_NAMES


def _device_check(idx: torch.Tensor | None) -> bool:
    """Whether a lean call leaves ``idx``'s range check to the kernel (reported at the next call:
    slot_errors.py) instead of reading it on the host: GPU indices the caller has not vouched for."""
    return slot_errors.checked_on_device(idx, DEVICE_CHECK_CPU)



# Registered so torch.compile and CUDA-graph capture see the in-place writes. The schema is
# inferred from these annotations (typing.Optional, which every supported torch version reads).
def _causal_conv1d_update_impl(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    cache_seqlens: Optional[torch.Tensor],
    conv_state_indices: Optional[torch.Tensor],
    num_accepted_tokens: Optional[torch.Tensor],
    out: torch.Tensor,
    silu: bool,
    pad_slot_id: int,
) -> None:
    """In-place op on checked inputs: writes ``out`` and the requests' rows of ``conv_state``."""
    if use_triton(x):
        x3 = x.unsqueeze(-1) if x.dim() == 2 else x
        out3 = out.unsqueeze(-1) if out.dim() == 2 else out
        causal_conv1d_update_launch(
            x3, conv_state, weight, bias, cache_seqlens, conv_state_indices, num_accepted_tokens, out3,
            silu, pad_slot_id,
        )
    else:
        causal_conv1d_update_ref(
            x, conv_state, weight, bias, "silu" if silu else None, cache_seqlens, conv_state_indices,
            pad_slot_id=pad_slot_id, num_accepted_tokens=num_accepted_tokens, out=out,
        )


# plain eager calls skip the dispatcher (dispatch.call_directly) and run the same function
_causal_conv1d_update_ = torch.library.custom_op(
    "fastmamba::causal_conv1d_update_", mutates_args=("conv_state", "out"))(_causal_conv1d_update_impl)


@_causal_conv1d_update_.register_fake
def _(x, conv_state, weight, bias, cache_seqlens, conv_state_indices, num_accepted_tokens, out, silu, pad_slot_id):
    return None


def _check_inputs(
    x, conv_state, weight, bias, cache_seqlens, conv_state_indices, num_accepted_tokens, out, pad_slot_id
) -> None:
    """Raise ValueError / TypeError naming the argument; reads nothing but shapes, except the
    index range checks (one host sync each, skipped while a CUDA graph is being captured)."""
    if x.dim() not in (2, 3):
        raise ValueError(f"{_OP}: `x` expected shape (B, D) or (B, D, L), got {tuple(x.shape)}")
    B, D = x.shape[:2]
    L = x.shape[2] if x.dim() == 3 else 1
    if L < 1:
        raise ValueError(f"{_OP}: `x` expected at least one token (L >= 1), got shape {tuple(x.shape)}")
    check_same_device(
        _OP,
        [("x", x), ("conv_state", conv_state), ("weight", weight), ("bias", bias), ("cache_seqlens", cache_seqlens),
         ("conv_state_indices", conv_state_indices), ("num_accepted_tokens", num_accepted_tokens), ("out", out)],
    )
    check_dtype(_OP, "x", x, FLOAT_DTYPES)

    check_shape(_OP, "weight", weight, [("D", D), ("W", None)])
    W = weight.shape[1]
    if W not in _WIDTHS:
        raise ValueError(f"{_OP}: `weight` width W expected in 2..6, got {W} (shape {tuple(weight.shape)})")
    check_dtype(_OP, "weight", weight, FLOAT_DTYPES)  # fp32 weights next to 16-bit x, as causal-conv1d accepts
    if bias is not None:
        check_shape(_OP, "bias", bias, [("D", D)])
        check_dtype(_OP, "bias", bias, FLOAT_DTYPES)

    check_shape(_OP, "conv_state", conv_state, [("S", None), ("D", D), ("state_len", None)])
    check_dtype(_OP, "conv_state", conv_state, FLOAT_DTYPES)
    S, _, state_len = conv_state.shape
    if state_len < W - 1:
        raise ValueError(
            f"{_OP}: `conv_state` state_len expected >= W-1 = {W - 1}, got {state_len} "
            f"(shape {tuple(conv_state.shape)})"
        )

    if out is not None:
        if tuple(out.shape) != tuple(x.shape):
            raise ValueError(f"{_OP}: `out` expected shape {tuple(x.shape)} (as x), got {tuple(out.shape)}")
        check_same_dtype(_OP, [("x", x), ("out", out)])

    if cache_seqlens is not None and num_accepted_tokens is not None:
        raise ValueError(f"{_OP}: `cache_seqlens` (circular buffer) and `num_accepted_tokens` cannot be combined")
    if cache_seqlens is not None:
        check_dtype(_OP, "cache_seqlens", cache_seqlens, INDEX_DTYPES)
        check_shape(_OP, "cache_seqlens", cache_seqlens, [("B", B)])
    if num_accepted_tokens is not None:
        check_dtype(_OP, "num_accepted_tokens", num_accepted_tokens, INDEX_DTYPES)
        check_shape(_OP, "num_accepted_tokens", num_accepted_tokens, [("B", B)])
        hi = state_len - W + 2
        if host_reads_allowed(num_accepted_tokens):
            bad = (num_accepted_tokens < 1) | (num_accepted_tokens > hi)
            if conv_state_indices is not None:
                bad &= conv_state_indices != pad_slot_id
            if bool(bad.any()):
                raise ValueError(
                    f"{_OP}: `num_accepted_tokens` values must lie in [1, state_len - W + 2] = [1, {hi}]; "
                    f"got {num_accepted_tokens[bad][:4].tolist()}"
                )

    if conv_state_indices is not None:
        check_indices(_OP, "conv_state_indices", conv_state_indices, B, S, pad_slot_id)
    elif S < B:
        raise ValueError(
            f"{_OP}: without `conv_state_indices` request b uses state row b, so `conv_state` needs "
            f"S >= B = {B} rows, got S = {S}"
        )
