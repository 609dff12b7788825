"""Plain-PyTorch reference for the prefill causal conv: the executable definition of the ops.

Written for a reviewer, not for speed: one row (request or sequence) at a time, an explicit loop
over tokens, everything in fp32. Tests and benchmarks compare the Triton kernels against this file.

Dense (``causal_conv1d_fn``), row b with history H = initial_states[b] (W-1 columns, zeros if
None), sequence ids s = seq_idx[b] (all equal if None; history columns carry s[0])::

    ext       = concat(H, x[b])                      [D, W-1+L]    ext_id = concat(s[0] * (W-1), s)
    y[:, t]   = act(bias + sum_k weight[:, k] * ext[:, t+k] * (ext_id[t+k] == s[t]))   (0 where s[t] < 0)
    final[:, i] = ext[:, L+i] * (ext_id[L+i] == s[L-1]) * (s[L-1] >= 0)  i = 0 .. W-2

Ids < 0 mark padding tokens (causal-conv1d's contract): their outputs are zero, and as their ids
differ from every real token's, they enter no real token's window.

Packed (``causal_conv1d_varlen``), sequence b = tokens cu_seqlens[b] .. cu_seqlens[b+1]-1 with
slot = cache_indices[b] and Hist = conv_states[slot] if has_initial_state[b] else zeros
(state_len columns)::

    ext       = concat(Hist, x_seq.T)                [D, state_len+n]
    y[t]      = act(bias + sum_k weight[:, k] * ext[:, state_len-(W-1)+t+k])
    conv_states[slot] = ext[:, -state_len:]          (a pad slot: y = 0, state untouched)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _is_silu(activation: str | bool | None) -> bool:
    return activation in ("silu", "swish", True)


def causal_conv1d_fn_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    final_states_out: torch.Tensor | None = None,
    activation: str | bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`fastmamba.ops.conv1d_fn.causal_conv1d_fn` (same arguments, no checks).

    x [B, D, L]; weight [D, W]; bias [D]; seq_idx [B, L]; initial_states [B, D, W-1].
    Returns y [B, D, L] (contiguous, x's dtype), or (y, final_states [B, D, W-1] in x's dtype,
    or ``final_states_out`` written in place).
    """
    B, D, L = x.shape
    W = weight.shape[1]
    w = weight.float()
    b_vec = bias.float() if bias is not None else torch.zeros(D, device=x.device)
    y = torch.empty(B, D, L, dtype=torch.float32, device=x.device)
    final = torch.empty(B, D, W - 1, dtype=torch.float32, device=x.device)
    for b in range(B):
        hist = initial_states[b].float() if initial_states is not None else x.new_zeros(D, W - 1, dtype=torch.float32)
        ext = torch.cat([hist, x[b].float()], dim=-1)  # [D, W-1+L]
        ids = seq_idx[b].long() if seq_idx is not None else torch.zeros(L, dtype=torch.long, device=x.device)
        ext_ids = torch.cat([ids[:1].expand(W - 1), ids])  # history columns belong to the first token's sequence
        for t in range(L):
            same = (ext_ids[t : t + W] == ids[t])[None, :]  # [1, W]
            acc = b_vec + torch.where(same, w * ext[:, t : t + W], 0.0).sum(-1)
            y[b, :, t] = F.silu(acc) if _is_silu(activation) else acc
            if ids[t] < 0:  # padding: zero output; real tokens never see it (their ids differ)
                y[b, :, t] = 0.0
        # the last W-1 columns, kept if in the last token's sequence and that is not padding
        keep = ((ext_ids[L:] == ids[L - 1]) & (ids[L - 1] >= 0))[None, :]
        final[b] = torch.where(keep, ext[:, L:], 0.0)
    y = y.to(x.dtype)
    if final_states_out is not None:
        final_states_out.copy_(final)
        return y, final_states_out
    if return_final_states:
        return y, final.to(x.dtype)
    return y


def causal_conv1d_varlen_ref(
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
    """Reference for :func:`fastmamba.ops.conv1d_fn.causal_conv1d_varlen` (same arguments).

    x [T, D]; conv_states [S, D, state_len] (the sequences' slots mutated in place); cu_seqlens
    [B+1]; cache_indices, has_initial_state [B]. Returns y [T, D] in x's dtype (``out`` if given).
    Checks only the index values (cu_seqlens, cache_indices), before anything is written: a bad
    one raises ValueError, so the reference never writes outside the state pool.
    """
    T, D = x.shape
    _check_varlen_indices(cu_seqlens, cache_indices, T, conv_states.shape[0], pad_slot_id)
    W = weight.shape[1]
    state_len = conv_states.shape[-1]
    w = weight.float()
    b_vec = bias.float() if bias is not None else torch.zeros(D, device=x.device)
    y = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    for b in range(cu_seqlens.shape[0] - 1):
        start, end = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        slot = b if cache_indices is None else int(cache_indices[b])
        if cache_indices is not None and slot == pad_slot_id:
            continue  # padding: y stays 0, the state is not touched
        if has_initial_state is not None and bool(has_initial_state[b]):
            hist = conv_states[slot].float()
        else:
            hist = torch.zeros(D, state_len, device=x.device)
        ext = torch.cat([hist, x[start:end].float().T], dim=-1)  # [D, state_len + n]
        for t in range(end - start):
            first = state_len - (W - 1) + t  # token t's window ends at ext column state_len + t
            acc = b_vec + (w * ext[:, first : first + W]).sum(-1)
            y[start + t] = F.silu(acc) if _is_silu(activation) else acc
        conv_states[slot] = ext[:, ext.shape[1] - state_len :].to(conv_states.dtype)
    y = y.to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def _check_varlen_indices(
    cu_seqlens: torch.Tensor, cache_indices: torch.Tensor | None, T: int, S: int, pad_slot_id: int
) -> None:
    """The index values the reference relies on (it reads them on the host anyway)."""
    op = "causal_conv1d_varlen_ref"
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{op}: `cu_seqlens` expected to start at 0, never decrease and end at T = {T}, got {cu}")
    if cache_indices is None:
        if S < len(cu) - 1:
            raise ValueError(f"{op}: without `cache_indices` `conv_states` needs S >= B = {len(cu) - 1}, got {S}")
        return
    bad = [v for v in cache_indices.tolist() if v != pad_slot_id and not 0 <= v < S]
    if bad:
        raise ValueError(f"{op}: `cache_indices` values must lie in [0, {S}) or equal pad_slot_id={pad_slot_id}; got {bad[:4]}")
