"""Plain-PyTorch reference for the replay state update (the executable definition of the op).

Written for a reviewer, not for speed: explicit loops over requests and tokens, fp32 inside, and
the same in-place writes as the kernels. Letters as in STYLE.md: B requests, T tokens per request
(K drafts + 1), H heads, P head dim, G groups of B/C, N state size, S cache slots, and C_h the
history capacity of the cache (tokens per slot, >= T).

A slot holds a stored state and the inputs of the tokens consumed since it was stored (the
history): ``hist_len`` tokens accepted in earlier steps, then the previous step's T_prev tokens,
of which ``prev_accepted`` were accepted. For each request b with slot = state_batch_indices[b],
k = hist_len[slot] + prev_accepted[slot] (tokens to replay), r = buf_idx[slot],
cA = old_cumA[r, slot] (cumulative A dt' since the stored state), per head h (g = h // (H // G)):
    1. replay      S = exp(cA[k-1]) state + sum_{s<k} exp(cA[k-1] - cA[s]) old_dt[r, s] old_x[s] (x) old_B[r, s]
    2. checkpoint  if k + T > C_h (this step would overflow the history): state[slot] = S, and this
                   step's inputs start a new history in the other buffer (w = 1 - r, base 0, offset 0);
                   else state[slot] is left alone and they are appended (w = r, base k, offset cA[k-1])
    3. outputs     dt'_t = softplus(dt_t + dt_bias);  from S, token by token:
                   S_t = exp(A dt'_t) S_{t-1} + dt'_t x_t (x) B_t,   y_t = S_t C_t + D x_t,   y_t *= silu(z_t)
    4. record      old_x[slot, base + t] = x_t;  old_B / old_dt[w, slot, base + t] = B_t, dt'_t;
                   old_cumA[w, slot, base + t] = offset + cumsum_t(A dt')
buf_idx, prev_accepted and hist_len are read, never written (see ``commit_accepted_ref``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastmamba.ops._common.checks import check_index_values


def _per_head(t: torch.Tensor | None, lead: int) -> torch.Tensor | None:
    """A per-head tensor given with extra tied trailing dims ((H, P, N) A, (H, P) D, (B, T, H, P)
    dt) -> its per-head values (the first element of each trailing run)."""
    if t is None:
        return None
    while t.dim() > lead:
        t = t[..., 0]
    return t


def replayed_state(old_x, old_B, old_dt, old_cumA, state, slot: int, r: int, k: int) -> torch.Tensor:
    """Step 1 for one slot: the stored state with the first k history tokens of buffer r replayed,
    fp32 [H, P, N]."""
    s = state[slot].float()
    if k == 0:
        return s
    heads_per_group = old_dt.shape[-1] // old_B.shape[-2]
    last = old_cumA[r, slot, k - 1].float()  # (H,)
    s = s * torch.exp(last)[:, None, None]
    for j in range(k):
        w = torch.exp(last - old_cumA[r, slot, j].float()) * old_dt[r, slot, j].float()  # (H,)
        Bh = old_B[r, slot, j].float().repeat_interleave(heads_per_group, dim=0)  # (H, N)
        s = s + (w[:, None] * old_x[slot, j].float())[..., None] * Bh[:, None, :]
    return s


def replay_selective_state_update_ref(
    state: torch.Tensor,
    old_x: torch.Tensor,
    old_B: torch.Tensor,
    old_dt: torch.Tensor,
    old_cumA: torch.Tensor,
    buf_idx: torch.Tensor,
    prev_accepted: torch.Tensor,
    hist_len: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    state_batch_indices: torch.Tensor | None = None,
    *,
    pad_slot_id: int = -1,
    out: torch.Tensor | None = None,
    rand_seed: torch.Tensor | None = None,
    A_is_log: bool = False,
) -> torch.Tensor:
    """Same contract as :func:`fastmamba.ops.replay_selective_state_update`; see its docstring.

    ``rand_seed`` is accepted for signature parity, but the reference always rounds the stored
    state to nearest: stochastic rounding differs from it by at most one unit in the last place.
    """
    del rand_seed
    # every slot index is checked before anything is written (no partial writes, no row S-3 for -3)
    check_index_values("replay_selective_state_update_ref", "state_batch_indices", state_batch_indices,
                       state.shape[0], pad_slot_id)
    nreq, ntok, nheads, _ = x.shape
    capacity = old_x.shape[1]
    heads_per_group = nheads // B.shape[2]
    A32 = _per_head(A, 1).float()  # (H,)
    if A_is_log:
        A32 = -torch.exp(A32)
    D32 = _per_head(D, 1).float() if D is not None else None
    bias32 = _per_head(dt_bias, 1).float() if dt_bias is not None else None
    dt = _per_head(dt, 3)  # (B, T, H)

    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for b in range(nreq):
        slot = b if state_batch_indices is None else int(state_batch_indices[b])
        if slot == pad_slot_id:
            continue  # padded row: output stays zero, nothing is read or written
        k = int(hist_len[slot]) + int(prev_accepted[slot])
        r = int(buf_idx[slot])

        # 1. replay every accepted token of the history onto the stored state
        s = replayed_state(old_x, old_B, old_dt, old_cumA, state, slot, r, k)

        # 2. store it only when this step's inputs would overflow the history
        checkpoint = k + ntok > capacity
        if checkpoint:
            state[slot] = s.to(state.dtype)
            w, base, offset = 1 - r, 0, torch.zeros(nheads, device=x.device)
        else:
            w, base = r, k
            offset = old_cumA[r, slot, k - 1].float() if k > 0 else torch.zeros(nheads, device=x.device)

        # 3. this step's T outputs, token by token from the (fp32) replayed state
        d = dt[b].float()  # (T, H)
        if bias32 is not None:
            d = d + bias32
        if dt_softplus:
            d = F.softplus(d)
        h_state = s
        for t in range(ntok):
            Bh = B[b, t].float().repeat_interleave(heads_per_group, dim=0)
            Ch = C[b, t].float().repeat_interleave(heads_per_group, dim=0)
            xt = x[b, t].float()  # (H, P)
            h_state = h_state * torch.exp(A32 * d[t])[:, None, None] + (d[t][:, None] * xt)[..., None] * Bh[:, None, :]
            yt = torch.einsum("hpn,hn->hp", h_state, Ch)
            if D32 is not None:
                yt = yt + xt * D32[:, None]
            if z is not None:
                yt = yt * F.silu(z[b, t].float())
            y[b, t] = yt

        # 4. record this step's inputs in the history
        old_x[slot, base:base + ntok] = x[b].to(old_x.dtype)
        old_B[w, slot, base:base + ntok] = B[b].to(old_B.dtype)
        old_dt[w, slot, base:base + ntok] = d.to(old_dt.dtype)
        old_cumA[w, slot, base:base + ntok] = (offset + torch.cumsum(A32 * d, dim=0)).to(old_cumA.dtype)

    if out is not None:
        out.copy_(y.to(out.dtype))
        return out
    return y.to(x.dtype)


def commit_accepted_ref(
    buf_idx: torch.Tensor,
    prev_accepted: torch.Tensor,
    hist_len: torch.Tensor,
    slots: torch.Tensor,
    accepted: torch.Tensor,
    *,
    tokens: int,
    history: int,
    pad_slot_id: int = -1,
) -> None:
    """The bookkeeping after a call of T = ``tokens`` tokens on a cache of ``history`` capacity, per
    non-pad request b with slot = slots[b] and k = hist_len[slot] + prev_accepted[slot]:
        if k + T > history (the call stored the state):  hist_len = 0, buf_idx = 1 - buf_idx
        else:                                             hist_len = k
        prev_accepted = accepted[b]
    """
    check_index_values("commit_accepted_ref", "slots", slots, buf_idx.shape[0], pad_slot_id)
    for b, slot in enumerate(slots.tolist()):
        if slot == pad_slot_id:
            continue
        k = int(hist_len[slot]) + int(prev_accepted[slot])
        if k + tokens > history:
            hist_len[slot] = 0
            buf_idx[slot] = 1 - int(buf_idx[slot])
        else:
            hist_len[slot] = k
        prev_accepted[slot] = int(accepted[b])


def flush_ref(
    state: torch.Tensor,
    old_x: torch.Tensor,
    old_B: torch.Tensor,
    old_dt: torch.Tensor,
    old_cumA: torch.Tensor,
    buf_idx: torch.Tensor,
    prev_accepted: torch.Tensor,
    hist_len: torch.Tensor,
    slots: torch.Tensor,
    *,
    pad_slot_id: int = -1,
) -> None:
    """Store every non-pad slot's replayed state (all hist_len + prev_accepted accepted tokens) and
    empty its history: hist_len = prev_accepted = 0 (buf_idx is kept)."""
    check_index_values("flush_ref", "slots", slots, state.shape[0], pad_slot_id)
    for slot in slots.tolist():
        if slot == pad_slot_id:
            continue
        k = int(hist_len[slot]) + int(prev_accepted[slot])
        s = replayed_state(old_x, old_B, old_dt, old_cumA, state, slot, int(buf_idx[slot]), k)
        state[slot] = s.to(state.dtype)
        hist_len[slot] = 0
        prev_accepted[slot] = 0
