"""Public entries for the prefill causal conv: checks, allocation, the registered ops."""
from __future__ import annotations

from typing import Optional

import torch

from fastmamba.ops._common.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dtype,
    check_indices,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensors,
    parse_activation,
)
from fastmamba.ops._common import slot_errors, varlen_checks
from fastmamba.ops._common.dispatch import call_directly, use_triton
from fastmamba.ops._common.host_values import host_list, host_reads_allowed
from fastmamba.ops._common.plans import PlanCache, sig
from fastmamba.ops.conv1d_fn.kernel import causal_conv1d_fn_launch, is_channel_last
from fastmamba.ops.conv1d_fn.varlen_kernel import causal_conv1d_varlen_launch
from fastmamba.ops.conv1d_fn.ref import causal_conv1d_fn_ref, causal_conv1d_varlen_ref

_OP_FN = "causal_conv1d_fn"
_OP_VARLEN = "causal_conv1d_varlen"
_WIDTHS = range(2, 7)
_FLAG_DTYPES = (torch.bool, torch.int32, torch.int64)


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    final_states_out: torch.Tensor | None = None,
    activation: str | bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over a batch of prompts (drop-in for causal_conv1d's function, forward only).

    x       [B, D, L]   fp32, bf16 or fp16; read. Fast paths with 16-byte vector loads for
                        channel-last memory (the [B, L, D] buffer transposed, also a column slice
                        of a wider one such as Mamba-2's in_proj output) and channel-first memory
                        (stride 1 along L); any other strides work, unvectorized. Never copied.
    weight  [D, W]      fp32, bf16 or fp16 (need not be x's dtype: fp32 weights next to 16-bit x
                        as causal-conv1d's callers pass them), W in 2..6
    bias    [D]         fp32, bf16 or fp16 (any, as weight), or None
    seq_idx [B, L]      int32/int64 or None: sequence id of each token (several sequences packed
                        in one row). Input column j feeds token t only if their ids are equal;
                        the initial-state columns carry seq_idx[b, 0]. An id < 0 (e.g. -1) marks
                        a padding token, as in causal-conv1d: its output is zero and it enters no
                        other token's window (nor the final states).
    initial_states [B, D, W-1]  fp32, bf16 or fp16, any strides, or None (zeros): the W-1 inputs
                        before x[:, :, 0]; read
    return_final_states  also return the final states
    final_states_out [B, D, W-1]  fp32, bf16 or fp16, any strides: written with the final states
                        (implies returning them); may be ``initial_states`` itself
    activation None, "silu" or "swish" (True / False are read as "silu" / None)
    Returns y [B, D, L] in x's dtype, with x's layout for the two fast layouts (channel-last x gives
    the transposed view of a new [B, L, D] buffer), contiguous otherwise; or (y, final_states)
    when final states are asked for: final_states [B, D, W-1] = the last W-1 columns of
    ext = [initial_states | x], each zeroed if its sequence id differs from seq_idx[b, L-1]
    (all zeroed if that token is padding)
    (x's dtype and layout when allocated; also right for L < W-1).

    y[:, :, t] = act(bias + sum_k weight[:, k] * ext[:, :, t+k] * (id(t+k) == seq_idx[:, t])),
    and 0 where seq_idx[:, t] < 0.
    seq_idx, initial_states and final states work together. Precision: x, weight, bias and the
    initial states are read in their own dtypes and every product and sum is in fp32; y is rounded
    once to x's dtype, the final states to theirs. No host sync.
    Reference: fastmamba.ops.conv1d_fn.ref.causal_conv1d_fn_ref

    >>> x = torch.tensor([[[1.0, 2.0, 3.0]]])                  # B=1, D=1, L=3
    >>> y, final = causal_conv1d_fn(x, torch.ones(1, 2), initial_states=torch.tensor([[[5.0]]]),
    ...                             return_final_states=True)  # W=2: y[t] = x[t-1] + x[t]
    >>> y, final
    (tensor([[[6., 3., 5.]]]), tensor([[[3.]]]))
    """
    # a signature an earlier call validated skips the checks (they read nothing but it)
    try:
        key = (x.shape, x.stride(), x.dtype, x.device, sig(weight), sig(bias), sig(seq_idx), sig(initial_states),
               sig(final_states_out), return_final_states, activation)
        silu = _VALID_FN.get(key)
    except (AttributeError, TypeError):  # a non-tensor or an unhashable argument: the checks say which
        key, silu = None, None
    if silu is None or type(x) is not torch.Tensor:
        silu = parse_activation(_OP_FN, activation)
        _check_fn_inputs(x, weight, bias, seq_idx, initial_states, final_states_out)
        if key is not None:
            _VALID_FN.remember(key, silu)
    B, D, L = x.shape
    W = weight.shape[1]
    channel_last = is_channel_last(x)
    if channel_last:
        out = torch.empty(B, L, D, dtype=x.dtype, device=x.device).transpose(1, 2)
    else:
        out = torch.empty(B, D, L, dtype=x.dtype, device=x.device)
    final = final_states_out
    if final is None and return_final_states:
        if channel_last:
            final = torch.empty(B, W - 1, D, dtype=x.dtype, device=x.device).transpose(1, 2)
        else:
            final = torch.empty(B, D, W - 1, dtype=x.dtype, device=x.device)
    op = _causal_conv1d_fn_impl if call_directly(x) else torch.ops.fastmamba.causal_conv1d_fn_
    op(x, weight, bias, seq_idx, initial_states, final, out, silu)
    if final is not None:
        return out, final
    return out


# Signatures of causal_conv1d_fn calls that passed every check -> the parsed activation: each tensor's
# shape, strides, dtype and device, return_final_states and the activation (issue 19: host time).
_VALID_FN = PlanCache("causal_conv1d_fn", 1024)



def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | bool | None = None,
    *,
    pad_slot_id: int = -1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal conv over B packed prompts, continuing from and updating a slot cache (serving prefill).

    x           [T, D]        fp32, bf16 or fp16, any strides (typically a column slice of the
                              in_proj output: stride(1) == 1, stride(0) > D); read
    weight      [D, W]        fp32, bf16 or fp16 (need not be x's dtype), W in 2..6
    bias        [D]           fp32, bf16 or fp16 (any), or None
    conv_states [S, D, state_len]  fp32, bf16 or fp16 (may differ from x), any strides; state_len
                              >= W-1 (W-1 as in vLLM, W as in mamba_ssm, or longer). The rows of the
                              sequences' slots are mutated in place; other rows are not touched
    cu_seqlens  [B+1]         int32/int64: sequence b is tokens cu_seqlens[b] .. cu_seqlens[b+1]-1;
                              starts at 0, non-decreasing (empty sequences allowed), ends at T
    cache_indices [B]         int32/int64 slot per sequence (None: slot b, needs S >= B); entries
                              equal to pad_slot_id get y = 0 and touch no state. Two sequences
                              must not share a (non-pad) slot.
    has_initial_state [B]     bool/int32/int64 (None: all False): the slot holds the sequence's
                              history (its last W-1 columns are the inputs just before token 0);
                              otherwise the history is zeros and the old state is not read
    activation  None, "silu" or "swish" (True / False are read as "silu" / None)
    out         [T, D]        x's dtype, any strides, must not overlap x; written when given
    Returns y [T, D] (``out``, else a new contiguous tensor in x's dtype).

    Per sequence, with Hist = the slot's state (or zeros) and ext = [Hist | x_seq^T]:
    y[t] = act(bias + sum_k weight[:, k] * ext[:, state_len-(W-1)+t+k]), and afterwards the slot
    holds ext[:, -state_len:] (so a sequence shorter than state_len keeps part of the old state;
    an empty one keeps it all, or is zeroed without initial state).

    Precision: x, weight, bias and the slot's state are read in their own dtypes, everything is
    computed in fp32, y is rounded once to x's dtype and the new state to the cache's dtype (the
    state columns are copies of inputs, exact when the cache's dtype holds x's).

    All checks of shapes, dtypes and devices run before anything is written. The cu_seqlens and
    slot values: CPU tensors are read on the host and checked first; an eager call on GPU tensors
    checks them on the device with no synchronize (ops/_common/varlen_checks.py): a call with a
    bad value runs as padding (no state read or written, zero outputs) and the op's next call
    raises the ValueError (or ``fastmamba.ops.raise_pending_slot_errors()`` does). Nothing is
    checked where host reads are not allowed (CUDA-graph capture, torch.compile tracing,
    ``trusted_inputs()``: see fastmamba.ops._common.host_values); unchecked values never make the
    kernel read or write outside the tensors: a slot outside [0, S) acts as pad_slot_id, and the
    token ranges are clamped into [0, T].
    Reference: fastmamba.ops.conv1d_fn.ref.causal_conv1d_varlen_ref

    >>> x = torch.tensor([[1.0], [2.0], [3.0]])            # T=3 tokens of D=1 channel
    >>> states = torch.tensor([[[7.0]], [[9.0]]])          # S=2 slots, state_len=1
    >>> has_init = torch.tensor([True, False])
    >>> causal_conv1d_varlen(x, torch.ones(1, 2), None, states, torch.tensor([0, 1, 3]),
    ...                      has_initial_state=has_init)  # sequences [1.] and [2., 3.]; W=2
    tensor([[8.],
            [2.],
            [5.]])
    >>> states.flatten()
    tensor([1., 3.])
    """
    silu = parse_activation(_OP_VARLEN, activation)
    on_device = _check_varlen_inputs(x, weight, bias, conv_states, cu_seqlens, cache_indices, has_initial_state, out,
                                     pad_slot_id)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if on_device and cu_seqlens.shape[0] > 1:
        cu_seqlens, cache_indices = varlen_checks.sanitize(
            _OP_VARLEN, cu_seqlens, cache_indices, x.shape[0], conv_states.shape[0], pad_slot_id,
            cu_which=2, idx_which=1)
    op = _causal_conv1d_varlen_impl if call_directly(x) else torch.ops.fastmamba.causal_conv1d_varlen_
    with varlen_checks.launches_after(on_device, x):  # no PDL overlap with the check's writes
        op(x, weight, bias, conv_states, cu_seqlens, cache_indices, has_initial_state, out, silu, pad_slot_id)
    return out


# Registered so torch.compile sees the writes (eager calls on plain tensors skip the dispatcher
# and run the same body: see _direct). The schemas are inferred
# from these annotations (typing.Optional, which every supported torch version reads).
@torch.library.custom_op("fastmamba::causal_conv1d_fn_", mutates_args=("final_states", "out"))
def _causal_conv1d_fn_(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    seq_idx: Optional[torch.Tensor],
    initial_states: Optional[torch.Tensor],
    final_states: Optional[torch.Tensor],
    out: torch.Tensor,
    silu: bool,
) -> None:
    """Op on checked inputs: writes ``out`` and, when given, ``final_states``."""
    _causal_conv1d_fn_impl(x, weight, bias, seq_idx, initial_states, final_states, out, silu)


def _causal_conv1d_fn_impl(x, weight, bias, seq_idx, initial_states, final_states, out, silu) -> None:
    if use_triton(x):
        causal_conv1d_fn_launch(x, weight, bias, seq_idx, initial_states, final_states, out, silu)
        return
    res = causal_conv1d_fn_ref(
        x, weight, bias, seq_idx, initial_states, final_states_out=final_states, activation="silu" if silu else None
    )
    out.copy_(res[0] if isinstance(res, tuple) else res)


@_causal_conv1d_fn_.register_fake
def _(x, weight, bias, seq_idx, initial_states, final_states, out, silu):
    return None


@torch.library.custom_op("fastmamba::causal_conv1d_varlen_", mutates_args=("conv_states", "out"))
def _causal_conv1d_varlen_(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    conv_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cache_indices: Optional[torch.Tensor],
    has_initial_state: Optional[torch.Tensor],
    out: torch.Tensor,
    silu: bool,
    pad_slot_id: int,
) -> None:
    """In-place op on checked inputs: writes ``out`` and the sequences' rows of ``conv_states``."""
    _causal_conv1d_varlen_impl(
        x, weight, bias, conv_states, cu_seqlens, cache_indices, has_initial_state, out, silu, pad_slot_id
    )


def _causal_conv1d_varlen_impl(
    x, weight, bias, conv_states, cu_seqlens, cache_indices, has_initial_state, out, silu, pad_slot_id
) -> None:
    if use_triton(x):
        causal_conv1d_varlen_launch(
            x, weight, bias, conv_states, cu_seqlens, cache_indices, has_initial_state, out, silu, pad_slot_id
        )
    else:
        causal_conv1d_varlen_ref(
            x, weight, bias, conv_states, cu_seqlens, cache_indices, has_initial_state,
            "silu" if silu else None, pad_slot_id=pad_slot_id, out=out,
        )


@_causal_conv1d_varlen_.register_fake
def _(x, weight, bias, conv_states, cu_seqlens, cache_indices, has_initial_state, out, silu, pad_slot_id):
    return None


# The checks below test the common case (all fine) with plain comparisons and call the shared
# check_* helpers only to raise their messages: host time per call (issue 19 item 0).


def _check_weight_bias(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, D: int) -> int:
    if weight.dim() != 2 or weight.shape[0] != D:
        check_shape(op, "weight", weight, [("D", D), ("W", None)])
    W = weight.shape[1]
    if W not in _WIDTHS:
        raise ValueError(f"{op}: `weight` width W expected in 2..6, got {W} (shape {tuple(weight.shape)})")
    # any float dtype, independently of x (causal-conv1d accepts fp32 weights next to 16-bit x):
    # the kernels read both into fp32 registers
    if weight.dtype not in FLOAT_DTYPES:
        check_dtype(op, "weight", weight, FLOAT_DTYPES)
    if bias is not None:
        if bias.shape != (D,):
            check_shape(op, "bias", bias, [("D", D)])
        if bias.dtype not in FLOAT_DTYPES:
            check_dtype(op, "bias", bias, FLOAT_DTYPES)
    return W


def _check_fn_inputs(x, weight, bias, seq_idx, initial_states, final_states_out) -> None:
    """Raise ValueError / TypeError naming the argument; reads nothing but shapes and dtypes."""
    op = _OP_FN
    check_tensors(op, [("x", x), ("weight", weight)],
                  [("bias", bias), ("seq_idx", seq_idx), ("initial_states", initial_states),
                   ("final_states_out", final_states_out)])
    if x.dim() != 3:
        raise ValueError(f"{op}: `x` expected shape (B, D, L), got {tuple(x.shape)}")
    B, D, L = x.shape
    if L < 1:
        raise ValueError(f"{op}: `x` expected at least one token (L >= 1), got shape {tuple(x.shape)}")
    check_same_device(
        op,
        [("x", x), ("weight", weight), ("bias", bias), ("seq_idx", seq_idx), ("initial_states", initial_states),
         ("final_states_out", final_states_out)],
    )
    if x.dtype not in FLOAT_DTYPES:
        check_dtype(op, "x", x, FLOAT_DTYPES)
    W = _check_weight_bias(op, x, weight, bias, D)
    if seq_idx is not None:
        check_dtype(op, "seq_idx", seq_idx, INDEX_DTYPES)
        if seq_idx.shape != (B, L):
            check_shape(op, "seq_idx", seq_idx, [("B", B), ("L", L)])
    for name, t in (("initial_states", initial_states), ("final_states_out", final_states_out)):
        if t is not None:
            check_dtype(op, name, t, FLOAT_DTYPES)
            if t.shape != (B, D, W - 1):
                check_shape(op, name, t, [("B", B), ("D", D), ("W-1", W - 1)])


def _check_varlen_inputs(
    x, weight, bias, conv_states, cu_seqlens, cache_indices, has_initial_state, out, pad_slot_id
) -> bool:
    """Raise ValueError / TypeError naming the argument. The cu_seqlens values and the slot range
    are read on the host (one sync each on a GPU) where host_reads_allowed (not under CUDA-graph
    capture, torch.compile tracing or trusted_inputs()), except for GPU tensors, whose values the
    caller checks on the device (varlen_checks.sanitize): returns True for those."""
    op = _OP_VARLEN
    check_tensors(op, [("x", x), ("weight", weight), ("conv_states", conv_states), ("cu_seqlens", cu_seqlens)],
                  [("bias", bias), ("cache_indices", cache_indices), ("has_initial_state", has_initial_state),
                   ("out", out)])
    if isinstance(pad_slot_id, bool) or not isinstance(pad_slot_id, int):
        raise TypeError(f"{op}: `pad_slot_id` expected an int, got {type(pad_slot_id).__name__} {pad_slot_id!r}")
    if x.dim() != 2:
        raise ValueError(f"{op}: `x` expected shape (T, D), got {tuple(x.shape)}")
    T, D = x.shape
    check_same_device(
        op,
        [("x", x), ("weight", weight), ("bias", bias), ("conv_states", conv_states), ("cu_seqlens", cu_seqlens),
         ("cache_indices", cache_indices), ("has_initial_state", has_initial_state), ("out", out)],
    )
    if x.dtype not in FLOAT_DTYPES:
        check_dtype(op, "x", x, FLOAT_DTYPES)
    W = _check_weight_bias(op, x, weight, bias, D)

    if conv_states.dim() != 3 or conv_states.shape[1] != D:
        check_shape(op, "conv_states", conv_states, [("S", None), ("D", D), ("state_len", None)])
    if conv_states.dtype not in FLOAT_DTYPES:
        check_dtype(op, "conv_states", conv_states, FLOAT_DTYPES)
    S, _, state_len = conv_states.shape
    if state_len < W - 1:
        raise ValueError(
            f"{op}: `conv_states` state_len expected >= W-1 = {W - 1}, got {state_len} "
            f"(shape {tuple(conv_states.shape)})"
        )

    check_dtype(op, "cu_seqlens", cu_seqlens, INDEX_DTYPES)
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"{op}: `cu_seqlens` expected shape (B+1,), got {tuple(cu_seqlens.shape)}")
    B = cu_seqlens.shape[0] - 1
    on_device = varlen_checks.device_checked(x, cu_seqlens)
    slot_errors.raise_pending(op, x.device, VARLEN_NAMES)  # what an earlier call's device check found
    if not on_device and host_reads_allowed(cu_seqlens):
        cu = host_list(cu_seqlens)
        if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
            shown = cu if len(cu) <= 10 else cu[:5] + ["..."] + cu[-3:]
            raise ValueError(
                f"{op}: `cu_seqlens` expected to start at 0, never decrease and end at T = {T} "
                f"(x's tokens), got {shown}"
            )

    if cache_indices is not None:
        check_indices(op, "cache_indices", cache_indices, B, S, pad_slot_id, read=not on_device)
    elif S < B:
        raise ValueError(
            f"{op}: without `cache_indices` sequence b uses slot b, so `conv_states` needs S >= B = {B} "
            f"rows, got S = {S}"
        )
    if has_initial_state is not None:
        check_dtype(op, "has_initial_state", has_initial_state, _FLAG_DTYPES)
        if has_initial_state.shape != (B,):
            check_shape(op, "has_initial_state", has_initial_state, [("B", B)])
    if out is not None:
        if tuple(out.shape) != tuple(x.shape):
            raise ValueError(f"{op}: `out` expected shape {tuple(x.shape)} (as x), got {tuple(out.shape)}")
        check_same_dtype(op, [("x", x), ("out", out)])
    return on_device


VARLEN_NAMES = ("cache_indices", "cu_seqlens")  # argument numbers 1, 2 of the device check's record
slot_errors.NAMES[_OP_VARLEN] = VARLEN_NAMES
slot_errors.EFFECTS[_OP_VARLEN] = "that call ran as padding: no state was read or written, its outputs are zeros"
