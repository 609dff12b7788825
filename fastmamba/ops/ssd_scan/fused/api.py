"""The varlen scan's one-launch path for short sequences, and the rule that picks it.

``ssd_scan_varlen`` takes this path when every sequence of the call is at most
``fused_configs.MAX_FUSED_LEN`` tokens (or when the caller passes ``fused=True``), except where the
chunked path would run the Hopper kernels and some sequence is longer than
``fused_configs.MAX_FUSED_LEN_HOPPER``: they beat the serial walk there. The longest
sequence is known on the host without a device read: the caller's ``max_seqlen``, else the values
of cu_seqlens that its checks read on the host anyway (CPU tensors: no extra read), else the packed
token count T, which bounds every sequence (GPU tensors, whose values are checked on the device;
inside trusted_inputs(), CUDA-graph capture, compile).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

from fastmamba.ops._common.dispatch import use_triton
from fastmamba.ops.ssd_scan.fused import configs as fused_configs
from fastmamba.ops.ssd_scan.fused.kernel import ssd_scan_fused_launch
from fastmamba.ops.ssd_scan.ref import ssd_scan_varlen_ref


def longest_sequence_bound(cu_values: list[int] | None, T: int, max_seqlen: int | None) -> int:
    """A host bound on the longest sequence: ``max_seqlen`` when given, else the lengths from the
    cu_seqlens values the op's checks read on the host (None under capture, compile or
    trusted_inputs(), where they read nothing), else T."""
    if max_seqlen is not None:
        return int(max_seqlen)
    if cu_values is not None:
        return max((int(b) - int(a) for a, b in zip(cu_values[:-1], cu_values[1:])), default=0)
    return T


def choose_fused(fused: bool | None, max_len: int, hopper_chunked: Callable[[], bool]) -> bool:
    """The path of one call: ``fused`` when the caller forces it, else short enough for the fused kernel,
    and, above ``fused_configs.MAX_FUSED_LEN_HOPPER`` tokens, only where the chunked path would not run
    the Hopper kernels (``hopper_chunked()``, asked only then: it costs host time)."""
    if fused is not None:
        return bool(fused)
    if max_len > fused_configs.MAX_FUSED_LEN:
        return False
    return max_len <= fused_configs.MAX_FUSED_LEN_HOPPER or not hopper_chunked()


def ssd_scan_varlen_fused_impl(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    ssm_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    D: Optional[torch.Tensor],
    z: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor],
    cache_indices: Optional[torch.Tensor],
    has_initial_state: Optional[torch.Tensor],
    out: torch.Tensor,
    chunk_states_out: Optional[torch.Tensor],
    chunk_size: int,
    dt_softplus: bool,
    dt_min: float,
    dt_max: float,
    pad_slot_id: int,
    A_is_log: bool,
    rand_seed: Optional[torch.Tensor],
    max_len: int,
    live_seqs: int,
    norm_weight: Optional[torch.Tensor],
    norm_sumsq: Optional[torch.Tensor],
) -> None:
    """In-place op on checked inputs (ssd_scan_varlen's): one launch of the fused kernel."""
    if not use_triton(x):
        ssd_scan_varlen_ref(
            x, dt, A, B, C, ssm_states, cu_seqlens, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias,
            dt_softplus=dt_softplus, dt_limit=(dt_min, dt_max), cache_indices=cache_indices,
            has_initial_state=has_initial_state, pad_slot_id=pad_slot_id, out=out, chunk_states_out=chunk_states_out,
            A_is_log=A_is_log, rand_seed=rand_seed, norm_weight=norm_weight, norm_sumsq=norm_sumsq,
        )
        return
    ssd_scan_fused_launch(
        x, dt, A, B, C, ssm_states, cu_seqlens, out, max_len=max_len, live_seqs=live_seqs or None,
        chunk_size=chunk_size, D=D, z=z,
        dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=(dt_min, dt_max), cache_indices=cache_indices,
        has_initial_state=has_initial_state, pad_slot_id=pad_slot_id, chunk_states_out=chunk_states_out,
        A_is_log=A_is_log, rand_seed=rand_seed, norm_weight=norm_weight, norm_sumsq=norm_sumsq,
    )


# Registered so torch.compile and CUDA-graph capture see the in-place writes; plain eager calls on
# plain tensors run the body directly (dispatch.call_directly): the dispatcher's round trip cost
# more host time than the whole layer's other ops.
_ssd_scan_varlen_fused_ = torch.library.custom_op(
    "fastmamba::ssd_scan_varlen_fused_", mutates_args=("ssm_states", "out", "chunk_states_out", "norm_sumsq"))(
    ssd_scan_varlen_fused_impl)


@_ssd_scan_varlen_fused_.register_fake
def _(x, dt, A, B, C, ssm_states, cu_seqlens, D, z, dt_bias, cache_indices, has_initial_state, out,
      chunk_states_out, chunk_size, dt_softplus, dt_min, dt_max, pad_slot_id, A_is_log, rand_seed, max_len,
      live_seqs, norm_weight, norm_sumsq):
    return None
