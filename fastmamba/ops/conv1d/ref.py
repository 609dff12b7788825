"""Plain-PyTorch reference for the conv1d decode step: the executable definition of the op.

Written for a reviewer, not for speed: one request at a time, an explicit loop over tokens,
everything in fp32. Tests and benchmarks compare the Triton kernel against this file.

For request b with history ``Hist = concat(state_b[:, :h], x_b)`` (``h`` entries of state, then
the ``L`` new tokens)::

    y[:, t]   = act(bias + sum_k weight[:, k] * Hist[:, h - (W - 1) + t + k])     t = 0 .. L-1
    new state = Hist[:, h + L - state_len : h + L]      (columns at negative index read as 0)

* default:            h = state_len (the state is the last state_len inputs, oldest first)
* num_accepted_tokens: h = num_accepted_tokens[b] + W - 2 (vLLM's speculative-decoding rollback)
* cache_seqlens:      the state is a circular buffer; its logical order starts at physical column
                      cache_seqlens[b] % state_len, and x[:, t] is written at (cache_seqlens[b] + t)
                      % state_len. Outputs read the state as it was before the writes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastmamba.ops._common.checks import check_index_values


def causal_conv1d_update_ref(
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
    """Reference for :func:`fastmamba.ops.conv1d.causal_conv1d_update` (same arguments, no checks).

    x [B, D] or [B, D, L]; conv_state [S, D, state_len] (mutated in place); weight [D, W];
    bias [D]; index tensors [B]. Returns y with x's shape and dtype (written into ``out`` if given).
    """
    # every slot index is checked before anything is written (no partial writes, no row S-3 for -3)
    check_index_values("causal_conv1d_update_ref", "conv_state_indices", conv_state_indices, conv_state.shape[0],
                       pad_slot_id)
    silu = activation in ("silu", "swish", True)
    x3 = x.unsqueeze(-1) if x.dim() == 2 else x
    B, D, L = x3.shape
    state_len = conv_state.shape[-1]
    W = weight.shape[1]
    w = weight.float()
    b_vec = bias.float() if bias is not None else torch.zeros(D, device=x.device)

    y = torch.zeros(B, D, L, dtype=torch.float32, device=x.device)
    for b in range(B):
        slot = b if conv_state_indices is None else int(conv_state_indices[b])
        if conv_state_indices is not None and slot == pad_slot_id:
            continue  # padding row: y stays 0, no state is touched
        state = conv_state[slot].float()  # [D, state_len], physical order
        if cache_seqlens is not None:
            start = int(cache_seqlens[b]) % state_len
            state = torch.roll(state, shifts=-start, dims=-1)  # logical order, oldest first
            h = state_len
        elif num_accepted_tokens is not None:
            h = int(num_accepted_tokens[b]) + W - 2
        else:
            h = state_len
        # Left-pad with state_len zeros so that history columns at negative index read as 0.
        pad = state_len
        hist = torch.cat([state.new_zeros(D, pad), state[:, :h], x3[b].float()], dim=-1)

        for t in range(L):
            first = pad + h - (W - 1) + t  # the W-wide window of token t ends at x[:, t]
            acc = b_vec + (w * hist[:, first : first + W]).sum(-1)
            y[b, :, t] = F.silu(acc) if silu else acc

        if cache_seqlens is not None:
            for t in range(L):  # in token order: with L > state_len the later token wins
                conv_state[slot, :, (start + t) % state_len] = x3[b, :, t].to(conv_state.dtype)
        else:
            end = pad + h + L
            conv_state[slot] = hist[:, end - state_len : end].to(conv_state.dtype)

    y = y.to(x.dtype).reshape(x.shape)
    if out is None:
        return y
    out.copy_(y)
    return out
