"""The shared expert run as routed experts of the same call (Nemotron-3 Nano: one launch for both).

A non-gated relu² expert of width S*F splits exactly into S experts of width F: relu² acts on each
feature alone and down_proj sums over the features, so

    shared(x) = down_s @ relu(up_s @ x)²  =  sum_i down_s[:, iF:(i+1)F] @ relu(up_s[iF:(i+1)F] @ x)²

Appending those S slices to the routed experts (once, when the weights are loaded) and S pairs of
weight 1.0 to every token's routing makes ``fused_moe`` compute routed + shared in the same kernels:
at batch 1 the GEMV path then streams 6 routed + 2 shared slices of Nano in one pass. Only where the
shared expert sees the same input as the routed ones (not Super's LatentMoE, whose routed experts
run in the latent width) and its width is a multiple of the routed width (Nano: 3712 = 2 x 1856).
"""
from __future__ import annotations

import torch

from fastmamba.ops._common.checks import INDEX_DTYPES, check_dtype, check_same_dtype, check_tensors
from fastmamba.ops.moe.ref import Routing

_OP = "fuse_shared_expert"


def fuse_shared_expert(w_up: torch.Tensor, w_down: torch.Tensor, shared_up: torch.Tensor,
                       shared_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed experts followed by the shared expert's S = F_s / F slices (new tensors: a copy).

    w_up [E, F, M], w_down [E, M, F]: the routed experts; shared_up [F_s, M], shared_down [M, F_s]
    (``shared_experts.up_proj.weight`` / ``down_proj.weight``), same dtype, F_s a multiple of F.
    Returns (w_up [E+S, F, M], w_down [E+S, M, F]); rows [:E] are the routed experts (keep views of
    them, drop the originals). Use with ``append_shared_routing(routing, E, S)``.
    """
    check_tensors(_OP, [("w_up", w_up), ("w_down", w_down), ("shared_up", shared_up), ("shared_down", shared_down)])
    check_same_dtype(_OP, [("w_up", w_up), ("w_down", w_down), ("shared_up", shared_up), ("shared_down", shared_down)])
    if w_up.dim() != 3:
        raise ValueError(f"{_OP}: `w_up` expected shape (E, F, M), got {tuple(w_up.shape)}")
    E, F, M = w_up.shape
    if tuple(w_down.shape) != (E, M, F):
        raise ValueError(f"{_OP}: `w_down` expected shape (E={E}, M={M}, F={F}), got {tuple(w_down.shape)}")
    if shared_up.dim() != 2 or shared_up.shape[1] != M or F == 0 or shared_up.shape[0] % F:
        raise ValueError(f"{_OP}: `shared_up` expected shape (F_s, M={M}) with F_s a multiple of F={F}, "
                         f"got {tuple(shared_up.shape)}")
    Fs = shared_up.shape[0]
    if tuple(shared_down.shape) != (M, Fs):
        raise ValueError(f"{_OP}: `shared_down` expected shape (M={M}, F_s={Fs}), got {tuple(shared_down.shape)}")
    S = Fs // F
    up = torch.cat([w_up, shared_up.reshape(S, F, M)], dim=0)
    down = torch.cat([w_down, shared_down.reshape(M, S, F).permute(1, 0, 2)], dim=0)
    return up, down


def append_shared_routing(routing: Routing, num_routed: int, num_slices: int) -> Routing:
    """Every token's routing plus the shared slices: weights [T, k+S] (the slices weigh 1.0, no
    routed scaling), ids [T, k+S] (experts num_routed .. num_routed+S-1 appended). New tensors,
    built on the device without a host read."""
    weights, ids = routing
    check_tensors("append_shared_routing", [("weights", weights), ("ids", ids)])
    check_dtype("append_shared_routing", "ids", ids, INDEX_DTYPES)
    if ids.dim() != 2 or tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"append_shared_routing: `weights` and `ids` expected the same shape (T, k), got "
                         f"{tuple(weights.shape)} and {tuple(ids.shape)}")
    T = ids.shape[0]
    extra = torch.arange(num_routed, num_routed + num_slices, dtype=ids.dtype, device=ids.device)
    return Routing(torch.cat([weights, weights.new_ones(T, num_slices)], dim=1),
                   torch.cat([ids, extra.expand(T, num_slices)], dim=1))
