"""Plain-PyTorch references of the MoE ops (Nemotron-3's router and relu² experts), fp32 inside.

Letters: T tokens, M model width (or the latent width of a LatentMoE), E routed experts, k experts
per token (top-k), F expert width, G expert groups for grouped selection.

    moe_route_ref:  scores = sigmoid(logits); choice = scores + bias; keep the ``topk_group`` best of
                    G groups (a group's score: the sum of its two best choices); top-k of the kept
                    choices; weights = scores at those experts (the bias selects only), divided by
                    their sum (+1e-20) when ``norm_topk_prob``, times ``routed_scaling_factor``.
    fused_moe_ref:  out[t] = sum_j weights[t, j] * down[e] @ relu(up[e] @ x[t])**2,  e = ids[t, j]
                    (+ down_s @ relu(up_s @ x[t])**2 with a shared expert: shared_expert_ref)
    moe_gate_ref:   moe_route_ref of the router's fp32 logits x @ weight^T

transformers' ``NemotronHTopkRouter`` / ``NemotronHExperts`` compute the same.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Routing(NamedTuple):
    """Each token's experts and their weights.

    weights [T, k] fp32   routing weight of each chosen expert (renormalised and scaled)
    ids     [T, k] int32  chosen expert ids in [0, E)
    """

    weights: torch.Tensor
    ids: torch.Tensor


def moe_route_ref(router_logits: torch.Tensor, correction_bias: torch.Tensor | None, *, top_k: int,
                  n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                  routed_scaling_factor: float = 1.0) -> Routing:
    """router_logits [T, E] (any float dtype, used in fp32); correction_bias [E] or None."""
    T, E = router_logits.shape
    scores = router_logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group > 1:
        grouped = choice.view(T, n_group, E // n_group)
        group_score = grouped.topk(min(2, E // n_group), dim=-1).values.sum(-1)        # [T, G]
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices                                          # [T, k]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return Routing(weights * routed_scaling_factor, ids.to(torch.int32))


def moe_gate_ref(x: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor | None, **selection) -> Routing:
    """x [T, M]; weight [E, M] -> ``moe_route_ref`` of the fp32 logits x @ weight^T (the router's
    ``F.linear(x.float(), weight.float())``); ``selection``: moe_route_ref's keywords."""
    return moe_route_ref(torch.nn.functional.linear(x.float(), weight.float()), correction_bias, **selection)


def shared_expert_ref(x: torch.Tensor, shared_up: torch.Tensor, shared_down: torch.Tensor) -> torch.Tensor:
    """x [T, M]; shared_up [Fs, M]; shared_down [M, Fs] -> down @ relu(up @ x)² [T, M] in fp32."""
    return torch.relu(x.float() @ shared_up.float().t()).square() @ shared_down.float().t()


def fused_moe_ref(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, shared_up: torch.Tensor | None = None,
                  shared_down: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, M]; w_up [E, F, M]; w_down [E, M, F]; topk_weights [T, k]; topk_ids [T, k] -> [T, M] in x's dtype.

    A loop over the experts that some token chose; each token's k contributions summed in fp32,
    plus ``shared_expert_ref`` when a shared expert is given (``fused_moe_gemv``'s shared_up / _down).
    """
    T, M = x.shape
    out = torch.zeros(T, M, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in topk_ids.unique().tolist():
        tok, j = torch.where(topk_ids == e)
        h = torch.relu(xf[tok] @ w_up[e].float().t()).square()
        out.index_add_(0, tok, (h @ w_down[e].float().t()) * topk_weights[tok, j].float()[:, None])
    if shared_up is not None:
        out += shared_expert_ref(x, shared_up, shared_down)
    return out.to(x.dtype)
