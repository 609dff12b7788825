"""Public MoE ops: ``moe_route`` (the router's selection) and ``fused_moe`` (routed relu² experts).

The signatures are the contract the layer (``fastmamba.layers.moe``) and the transformers provider
call; the Triton kernels live in ``kernel.py`` (until then both run the references).
"""
from __future__ import annotations

import torch

from fastmamba.ops.moe.ref import Routing, fused_moe_ref, moe_route_ref


def moe_route(router_logits: torch.Tensor, correction_bias: torch.Tensor | None = None, *, top_k: int,
              n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
              routed_scaling_factor: float = 1.0) -> Routing:
    """Pick each token's ``top_k`` experts from its router logits (Nemotron-3's sigmoid router).

    router_logits    [T, E] fp32 (the router's fp32 linear)
    correction_bias  [E] fp32 or None: added to the scores for selection only
    Returns Routing(weights [T, k] fp32, ids [T, k] int32). Reference: ``ref.moe_route_ref``.
    """
    return moe_route_ref(router_logits, correction_bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                         norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor)


def fused_moe(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Routed non-gated relu² experts: out[t] = sum_j w[t,j] * w_down[e] @ relu(w_up[e] @ x[t])², e = ids[t,j].

    x             [T, M] bf16 / fp16 / fp32 (M: model or latent width)
    w_up          [E, F, M] same dtype as x (transformers' fused ``experts.up_proj``)
    w_down        [E, M, F] same dtype as x (``experts.down_proj``)
    topk_weights  [T, k] fp32;  topk_ids [T, k] int32/int64 in [0, E)
    out           [T, M] x's dtype, optional (written)
    Returns [T, M] in x's dtype. Reference: ``ref.fused_moe_ref``.
    """
    y = fused_moe_ref(x, w_up, w_down, topk_weights, topk_ids)
    if out is None:
        return y
    out.copy_(y)
    return out
