"""Plain-PyTorch reference for the chunked SSD scan (the executable definition of the prefill op).

Written for a reviewer, not for speed: the sequential recurrence, one token at a time, fp32 inside.
Letters as in STYLE.md: B requests, L tokens per request, T packed tokens, H heads, P head dim,
G groups of B/C (head h reads group h // (H // G)), N state size, S cache slots.

Per head h and token t (g = h // (H // G)):
    dt'   = clamp(softplus(dt + dt_bias), *dt_limit)    (softplus only when dt_softplus)
    state = state * exp(A[h] * dt') + dt' * x[t][:, None] * B[t, g][None, :]      [P, N]
    y[t]  = state @ C[t, g] + D[h] * x[t]
    y[t]  = y[t] * silu(z[t])                            (when z is given)
A new sequence starts from its initial state (or zeros): the chunking of the Triton kernel is an
implementation detail and does not change the result beyond rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def process_dt(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> torch.Tensor:
    """dt (..., H) -> fp32 step sizes: + dt_bias, softplus (identity above 20), clamped to dt_limit."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = torch.where(dt <= 20.0, F.softplus(dt), dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        dt = dt.clamp(min=lo, max=hi)
    return dt


def decay_rates(A: torch.Tensor, A_is_log: bool) -> torch.Tensor:
    """A [H] -> fp32 decay rates: A itself, or -exp(A) when A holds A_log (``A_is_log``)."""
    return -torch.exp(A.float()) if A_is_log else A.float()


def scan_segment(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Run the recurrence over one sequence, all fp32.

    x (L, H, P), dt (L, H) already processed, A (H,), B/C (L, G, N), state (H, P, N).
    Returns (y (L, H, P) without D and gate, final state (H, P, N), states at the end of every
    ``chunk_size`` tokens of the sequence (the last one possibly partial), or [] when chunk_size is None).
    """
    L, H, _ = x.shape
    G = B.shape[1]
    Bh = B.float().repeat_interleave(H // G, dim=1)  # (L, H, N)
    Ch = C.float().repeat_interleave(H // G, dim=1)
    state = state.float().clone()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    chunk_states = []
    for t in range(L):
        decay = torch.exp(A.float() * dt[t])  # (H,)
        state = state * decay[:, None, None] + (dt[t][:, None] * x[t].float())[:, :, None] * Bh[t][:, None, :]
        y[t] = torch.einsum("hpn,hn->hp", state, Ch[t])
        if chunk_size is not None and ((t + 1) % chunk_size == 0 or t == L - 1):
            chunk_states.append(state.clone())
    return y, state, chunk_states


def _finish(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
    """y (..., H, P) fp32 -> + D * x, * silu(z)."""
    if D is not None:
        Df = D.float()
        y = y + (Df[:, None] if Df.dim() == 1 else Df) * x.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y


def mamba_chunk_scan_combined_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    state_dtype: torch.dtype | None = None,
    *,
    A_is_log: bool = False,
):
    """Same contract as :func:`fastmamba.ops.mamba_chunk_scan_combined` (see its docstring).

    Segments of a row: a new one starts wherever seq_idx changes, or at each cu_seqlens entry
    when cu_seqlens is given (batch 1). initial_states feed the first segment of each row;
    final_states are the state after the row's last token. ``state_dtype`` only sets the
    kernel's internal precision and is ignored here (the reference is fp32 throughout).
    """
    del chunk_size, state_dtype
    A = decay_rates(A, A_is_log)
    nb, L, H, P = x.shape
    N = B.shape[-1]
    dtp = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    finals = torch.zeros(nb, H, P, N, dtype=torch.float32, device=x.device)
    varlen_states = []
    for b in range(nb):
        if cu_seqlens is not None:
            bounds = [int(v) for v in cu_seqlens.tolist()]
        elif seq_idx is not None:
            ids = seq_idx[b].tolist()
            bounds = [0] + [t for t in range(1, L) if ids[t] != ids[t - 1]] + [L]
        else:
            bounds = [0, L]
        for k, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            if k == 0 and initial_states is not None:
                state = initial_states[b].float()
            else:
                state = torch.zeros(H, P, N, dtype=torch.float32, device=x.device)
            if end > start:
                y_seg, state, _ = scan_segment(x[b, start:end], dtp[b, start:end], A, B[b, start:end], C[b, start:end], state)
                y[b, start:end] = y_seg
            varlen_states.append(state)
            finals[b] = state
    out = _finish(y, x, D, z).to(x.dtype)
    result = [out]
    if return_final_states:
        result.append(finals)
    if return_varlen_states:
        result.append(torch.stack(varlen_states))
    return result[0] if len(result) == 1 else tuple(result)


def ssd_scan_varlen_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    ssm_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    chunk_size: int = 256,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    pad_slot_id: int = -1,
    out: torch.Tensor | None = None,
    chunk_states_out: torch.Tensor | None = None,
    A_is_log: bool = False,
    rand_seed: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_sumsq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as :func:`fastmamba.ops.ssd_scan_varlen` (see its docstring).

    The final state of sequence b is stored into ``ssm_states[cache_indices[b]]`` rounded to
    nearest in the cache dtype; pad sequences get zero output and touch no slot. ``rand_seed`` is
    accepted for signature parity and ignored: stochastic rounding differs from rounding to
    nearest by at most one unit in the last place.
    """
    del rand_seed
    A = decay_rates(A, A_is_log)
    T, H, P = x.shape
    bounds = [int(v) for v in cu_seqlens.tolist()]
    nseq = len(bounds) - 1
    slots = list(range(nseq)) if cache_indices is None else [int(v) for v in cache_indices.tolist()]
    S = ssm_states.shape[0]
    bad = [v for v in slots if v != pad_slot_id and not 0 <= v < S]
    if bad:  # before anything is written
        raise ValueError(f"ssd_scan_varlen_ref: `cache_indices` values must lie in [0, {S}) or equal "
                         f"pad_slot_id={pad_slot_id}; got {bad[:4]}")
    flags = [False] * nseq if has_initial_state is None else [bool(v) for v in has_initial_state.tolist()]
    dtp = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    pad = torch.zeros(T, dtype=torch.bool, device=x.device)
    first_chunk = 0
    for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        n_chunks = -(-(end - start) // chunk_size)
        slot = slots[b]
        if slot == pad_slot_id:
            pad[start:end] = True
            first_chunk += n_chunks
            continue
        if flags[b]:
            state = ssm_states[slot].float()
        else:
            state = torch.zeros(ssm_states.shape[1:], dtype=torch.float32, device=x.device)
        y_seg, state, per_chunk = scan_segment(x[start:end], dtp[start:end], A, B[start:end], C[start:end], state, chunk_size)
        y[start:end] = y_seg
        if end > start:
            ssm_states[slot] = state.to(ssm_states.dtype)
        if chunk_states_out is not None:
            for k, s in enumerate(per_chunk):
                chunk_states_out[first_chunk + k] = s.to(chunk_states_out.dtype)
        first_chunk += n_chunks
    result = _finish(y, x, D, z)
    result[pad] = 0.0
    if norm_sumsq is not None:  # the deferred norm: sums of y^2 over each 16 columns, y * norm_weight
        result = result.reshape(T, H * P)
        norm_sumsq.copy_(result.square().reshape(T, H * P // 16, 16).sum(-1))
        result = (result * norm_weight.float()).reshape(T, H, P)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out.copy_(result.to(out.dtype))
    return out
