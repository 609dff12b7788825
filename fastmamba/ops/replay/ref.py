"""Plain-PyTorch reference for the replay state update (the executable definition of the op).

Written for a reviewer, not for speed: explicit loops over requests and tokens, fp32 inside, and
the same in-place writes as the kernels. Letters as in STYLE.md: B requests, T tokens per request
(K drafts + 1), H heads, P head dim, G groups of B/C, N state size, S cache slots.

For each request b with slot = state_batch_indices[b], k = prev_accepted[slot], r = buf_idx[slot],
per head h (g = h // (H // G)), cA = old_cumA[r, slot], dto = old_dt[r, slot]:
    1. replay   S = exp(cA[k-1]) S + sum_{s<k} exp(cA[k-1] - cA[s]) dto[s] old_x[s] (x) old_B[r, s]
                state[slot] = S                                  (k = 0: S and state[slot] unchanged)
    2. outputs  dt'_t = softplus(dt_t + dt_bias);  from S, token by token:
                S_t = exp(A dt'_t) S_{t-1} + dt'_t x_t (x) B_t,   y_t = S_t C_t + D x_t,   y_t *= silu(z_t)
    3. record   old_x[slot] = x;  old_B / old_dt / old_cumA[1 - r, slot] = B, dt', cumsum_t(A dt'_t)
buf_idx and prev_accepted are read, never written (see commit_accepted).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _per_head(t: torch.Tensor | None, lead: int) -> torch.Tensor | None:
    """A per-head tensor given with extra tied trailing dims ((H, P, N) A, (H, P) D, (B, T, H, P)
    dt) -> its per-head values (the first element of each trailing run)."""
    if t is None:
        return None
    while t.dim() > lead:
        t = t[..., 0]
    return t


def replay_selective_state_update_ref(
    state: torch.Tensor,
    old_x: torch.Tensor,
    old_B: torch.Tensor,
    old_dt: torch.Tensor,
    old_cumA: torch.Tensor,
    buf_idx: torch.Tensor,
    prev_accepted: torch.Tensor,
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
) -> torch.Tensor:
    """Same contract as :func:`fastmamba.ops.replay_selective_state_update`; see its docstring.

    ``rand_seed`` is accepted for signature parity, but the reference always rounds the stored
    state to nearest: stochastic rounding differs from it by at most one unit in the last place.
    """
    del rand_seed
    nreq, ntok, nheads, _ = x.shape
    heads_per_group = nheads // B.shape[2]
    A32 = _per_head(A, 1).float()  # (H,)
    D32 = _per_head(D, 1).float() if D is not None else None
    bias32 = _per_head(dt_bias, 1).float() if dt_bias is not None else None
    dt = _per_head(dt, 3)  # (B, T, H)

    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for b in range(nreq):
        slot = b if state_batch_indices is None else int(state_batch_indices[b])
        if slot == pad_slot_id:
            continue  # padded row: output stays zero, nothing is read or written
        k = int(prev_accepted[slot])
        r = int(buf_idx[slot])

        # 1. replay the previous step's k accepted tokens onto the committed state
        s = state[slot].float()  # (H, P, N)
        if k > 0:
            last = old_cumA[r, slot, k - 1].float()  # (H,)
            s = s * torch.exp(last)[:, None, None]
            for j in range(k):
                w = torch.exp(last - old_cumA[r, slot, j].float()) * old_dt[r, slot, j].float()  # (H,)
                Bh = old_B[r, slot, j].float().repeat_interleave(heads_per_group, dim=0)  # (H, N)
                s = s + (w[:, None] * old_x[slot, j].float())[..., None] * Bh[:, None, :]
            state[slot] = s.to(state.dtype)

        # 2. this step's T outputs, token by token from the (fp32) replayed state
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

        # 3. record this step's inputs for the next replay (the write buffer is 1 - r)
        old_x[slot] = x[b].to(old_x.dtype)
        old_B[1 - r, slot] = B[b].to(old_B.dtype)
        old_dt[1 - r, slot] = d.to(old_dt.dtype)
        old_cumA[1 - r, slot] = torch.cumsum(A32 * d, dim=0).to(old_cumA.dtype)

    if out is not None:
        out.copy_(y.to(out.dtype))
        return out
    return y.to(x.dtype)
