"""Plain-PyTorch reference for the SSM state update (the executable definition of the op).

Written for a reviewer, not for speed: an explicit loop over requests and tokens, fp32 inside.
Shapes use the letters of STYLE.md: B requests, T tokens per request, H heads, P head dim,
G groups of B/C, N state size, S cache slots.

One token, for each head h and request b (g = h // (H // G)):
    dt'   = softplus(dt + dt_bias)             (dt_softplus=True)
    state = state * exp(A * dt') + (dt' * x)[:, None] * B[g][None, :]   (A = -exp(A) if A_is_log)
    y     = state @ C[g] + D * x
    y     = y * silu(z)                        (when z is given)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastmamba.ops._common.checks import check_index_values


def selective_state_update_ref(
    state: torch.Tensor,
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
    dst_state_batch_indices: torch.Tensor | None = None,
    intermediate_states: torch.Tensor | None = None,
    rand_seed: torch.Tensor | None = None,
    A_is_log: bool = False,
) -> torch.Tensor:
    """Same contract as :func:`fastmamba.ops.selective_state_update`; see its docstring.

    ``rand_seed`` is accepted for signature parity, but the reference always rounds the stored
    state to nearest: stochastic rounding differs from it by at most one unit in the last place.
    """
    del rand_seed
    # every slot index is checked before anything is written (no partial writes, no row S-3 for -3)
    check_index_values("selective_state_update_ref", "state_batch_indices", state_batch_indices, state.shape[0],
                       pad_slot_id)
    check_index_values("selective_state_update_ref", "dst_state_batch_indices", dst_state_batch_indices,
                       state.shape[0], pad_slot_id)
    no_heads = x.dim() == 2  # mamba_ssm's (B, D) form: one "head" of P = D channels
    multi_token = x.dim() == 4
    if no_heads:
        state, x, dt, B, C = (t.unsqueeze(1) for t in (state, x, dt, B, C))
        A = A.unsqueeze(0)
        D = D.unsqueeze(0) if D is not None else None
        z = z.unsqueeze(1) if z is not None else None
        dt_bias = dt_bias.unsqueeze(0) if dt_bias is not None else None
    if not multi_token:  # add the token axis: x (B, 1, H, P), B/C (B, 1, G, N)
        x, dt, B, C = (t.unsqueeze(1) for t in (x, dt, B, C))
        z = z.unsqueeze(1) if z is not None else None
    nreq, ntok, nheads, _ = x.shape
    ngroups = B.shape[2]
    heads_per_group = nheads // ngroups

    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    A32 = -torch.exp(A.float()) if A_is_log else A.float()
    if A32.dim() == 1:  # [H]: one value per head
        A32 = A32[:, None, None]
    for b in range(nreq):
        src = b if state_batch_indices is None else int(state_batch_indices[b])
        dst = src if dst_state_batch_indices is None else int(dst_state_batch_indices[b])
        if src == pad_slot_id:
            continue  # padded row: output stays zero, nothing is written
        s = state[src].float()  # (H, P, N)
        for t in range(ntok):
            d = dt[b, t].float()
            if dt_bias is not None:
                d = d + dt_bias.float()
            if dt_softplus:
                d = F.softplus(d)
            Bh = B[b, t].float().repeat_interleave(heads_per_group, dim=0)  # (H, N)
            Ch = C[b, t].float().repeat_interleave(heads_per_group, dim=0)
            xb = x[b, t].float()  # (H, P)
            s = s * torch.exp(A32 * d[..., None]) + (d * xb)[..., None] * Bh[:, None, :]
            yt = torch.einsum("hpn,hn->hp", s, Ch)
            if D is not None:
                yt = yt + xb * D.float()
            if z is not None:
                yt = yt * F.silu(z[b, t].float())
            y[b, t] = yt
            if intermediate_states is not None:
                intermediate_states[b, t] = s.to(intermediate_states.dtype)
        if dst != pad_slot_id:
            state[dst] = s.to(state.dtype)

    if not multi_token:
        y = y.squeeze(1)
    if no_heads:
        y = y.squeeze(1)
    if out is not None:
        out.copy_(y.to(out.dtype))
        return out
    return y.to(x.dtype)
