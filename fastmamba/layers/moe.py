"""Nemotron-3's mixture-of-experts layer (transformers' ``NemotronHMoE``): a sigmoid router picks
``top_k`` of E routed relu² experts per token; a shared relu² expert sees every token.

Letters: T tokens, M model width, M' the routed experts' width (M, or ``latent`` for a LatentMoE),
E routed experts, k experts per token, F expert width, Fs the shared expert's width.

    gate.weight                    [E, M]   fp32 (the router runs in fp32 whatever the model dtype)
    gate.e_score_correction_bias   [E]      fp32 buffer: added to the scores for selection only
    experts.up_proj                [E, F, M']   transformers' fused 3-D form (the loader stacks the
    experts.down_proj              [E, M', F]   per-expert ``experts.{e}.up_proj.weight`` into it)
    fc1_latent_proj                [latent, M]  (+ bias when mlp_bias)  only with ``latent``
    fc2_latent_proj                [M, latent]  (+ bias when mlp_bias)  only with ``latent``
    shared_experts.up_proj         [Fs, M],  shared_experts.down_proj [M, Fs]  (fastmamba.layers.mlp.MLP)

    forward(u [..., M]) = fc2(fused_moe(fc1(u), up, down, route(gate(u)))) + shared(u)

``route`` is ``fastmamba.ops.moe.moe_route`` (scores = sigmoid(logits), the bias selects, grouped
top-k over ``n_group`` groups keeping ``topk_group``, renormalised when ``norm_topk_prob``, times
``routed_scaling_factor``); the experts are ``fastmamba.ops.moe.fused_moe``. The layer keeps no
per-request state: prefill, decode and verify are the same per-token map.

Decode path (T <= ``GEMV_MAX_TOKENS`` tokens in a call: decode steps, small verify steps): the few
launches of a batch-1 step are most of its time, so the same map runs in three kernels:
``moe_gate`` (the router's fp32 GEMV reading u in its dtype, and the routing, in one launch),
then ``fused_moe_gemv``'s up and down GEMVs over the chosen experts, whose k-sum is done by the
down kernel's last program per output block. ``shared_fused`` (an int, read-only):

    shared_fused = S = Fs / F   the shared expert runs in those same two GEMVs as S more experts
                                of weight 1.0 (relu² acts per feature and down_proj sums over the
                                features, so an expert of width S*F is exactly S experts of width
                                F); its weights stay where they are (``shared_experts`` is read
                                in place: no copy, state_dict and checkpoints unchanged). Only where
                                it sees the routed experts' input and weights' kind: no latent
                                projection, no biases, Fs a multiple of F, 16-bit or fp32
                                ``Experts`` and ``nn.Linear`` shared weights of their dtype (not
                                FP8), no tensor-parallel ``reduce`` (Nano: S = 3712 / 1856 = 2).
    shared_fused = 0            the shared expert is its own MLP, added after the routed experts
                                (every layer with T > GEMV_MAX_TOKENS tokens in a call, too).

``decode_arrivals`` (a non-persistent int32 buffer of zeros, ``fastmamba.ops.moe.decode_workspace``)
holds those kernels' arrival counters; the kernels leave it zero. ``route(x)`` is the one place the
layer picks experts (``Routing`` of the routed experts only; benchmarks wrap it to count them).

Tensor parallelism (for ``fastmamba.distributed``): every term after the router is linear in the
expert and shared widths, so rank r of w can hold columns [r*F/w, (r+1)*F/w) of every routed
expert (``up_proj`` rows, ``down_proj`` columns) and of the shared expert, the router and latent
projections whole, the output biases on rank 0 only; each rank's output is then a partial sum
(``fc2`` is linear, so it applies to each rank's partial latent sum) and ``reduce`` (an
all-reduce) adds them once per layer. ``reduce`` is None (identity) on one device.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from fastmamba.layers.mlp import MLP
from fastmamba.ops.moe import GEMV_MAX_TOKENS, Routing, decode_workspace, fused_moe, fused_moe_gemv, moe_gate, moe_route


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """One MoE layer's sizes (``NemotronHConfig.moe`` builds it; the config checks the values)."""

    d_model: int                   # M
    n_experts: int                 # E
    top_k: int                     # k
    expert_width: int              # F
    shared_width: int              # Fs
    latent: int | None = None      # M' when not None (LatentMoE)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    bias: bool = False             # mlp_bias: the shared expert's and latent projections' biases

    @property
    def expert_in(self) -> int:    # M'
        return self.latent if self.latent is not None else self.d_model


class Router(nn.Module):
    """``weight`` [E, M] and ``e_score_correction_bias`` [E], both fp32 (transformers keeps them in
    fp32 in every model dtype); ``forward(u [T, M]) -> logits [T, E]`` fp32."""

    def __init__(self, d_model: int, n_experts: int, *, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_experts, d_model, device=device, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(n_experts, device=device, dtype=torch.float32))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return F.linear(u.float(), self.weight.float())


class Experts(nn.Module):
    """The routed experts' weights in the fused 3-D form: ``up_proj`` [E, F, M'], ``down_proj`` [E, M', F]."""

    def __init__(self, n_experts: int, width: int, d_in: int, *, device=None, dtype=None):
        super().__init__()
        self.up_proj = nn.Parameter(torch.zeros(n_experts, width, d_in, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.zeros(n_experts, d_in, width, device=device, dtype=dtype))


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig, *, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg.d_model, cfg.n_experts, device=device)
        self.experts = Experts(cfg.n_experts, cfg.expert_width, cfg.expert_in, device=device, dtype=dtype)
        self.shared_experts = MLP(cfg.d_model, cfg.shared_width, bias=cfg.bias, device=device, dtype=dtype)
        if cfg.latent is not None:
            self.fc1_latent_proj = nn.Linear(cfg.d_model, cfg.latent, bias=cfg.bias, device=device, dtype=dtype)
            self.fc2_latent_proj = nn.Linear(cfg.latent, cfg.d_model, bias=cfg.bias, device=device, dtype=dtype)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None
        self.reduce = None  # tensor parallelism: the sum of the ranks' partial outputs (see the module doc)
        # the decode kernels' arrival counters (zeros, left zero by them; not a weight: not saved)
        self.register_buffer("decode_arrivals", decode_workspace(cfg.expert_in, device=device), persistent=False)

    @torch.no_grad()
    def reset_runtime_buffers(self) -> None:
        """The non-persistent buffers' built values (``fastmamba.layers.buffers``): zero counters."""
        self.decode_arrivals.zero_()

    @property
    def shared_fused(self) -> int:
        """S, the slices of width F the decode path runs the shared expert as inside the routed
        experts' kernels, or 0 where it runs as its own MLP (see the module docstring)."""
        c, sh = self.cfg, self.shared_experts
        if (self.fc1_latent_proj is not None or c.bias or self.reduce is not None or c.expert_width < 1
                or c.shared_width % c.expert_width or type(self.experts) is not Experts
                or type(sh) is not MLP or type(sh.up_proj) is not nn.Linear or type(sh.down_proj) is not nn.Linear):
            return 0
        up, down = self.experts.up_proj, self.experts.down_proj
        su, sd = sh.up_proj.weight, sh.down_proj.weight
        if su.dtype != up.dtype or sd.dtype != up.dtype or su.stride(1) != up.stride(2) or sd.stride(1) != down.stride(2):
            return 0
        return c.shared_width // c.expert_width

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """Random weights for presets and demos: N(0, std) router and experts, zero selection bias
        (the Linear layers are initialised with the model's other matrices)."""
        self.gate.weight.normal_(0.0, std, generator=generator)
        self.gate.e_score_correction_bias.zero_()
        self.experts.up_proj.normal_(0.0, std, generator=generator)
        self.experts.down_proj.normal_(0.0, std, generator=generator)

    def route(self, x: torch.Tensor) -> Routing:
        """x [T, M] -> the routed experts of each token (``Routing``: weights [T, k] fp32, ids [T, k]).
        A few tokens: ``moe_gate`` (one launch); more: the fp32 router GEMM then ``moe_route``."""
        c = self.cfg
        if x.shape[0] <= GEMV_MAX_TOKENS:
            return moe_gate(x, self.gate.weight, self.gate.e_score_correction_bias, top_k=c.top_k, n_group=c.n_group,
                            topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
                            routed_scaling_factor=c.routed_scaling_factor, arrivals=self.decode_arrivals[:1])
        return moe_route(self.gate(x), self.gate.e_score_correction_bias, top_k=c.top_k, n_group=c.n_group,
                         topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
                         routed_scaling_factor=c.routed_scaling_factor)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """u [..., M] in the model dtype -> [..., M] in the same dtype."""
        x = u.reshape(-1, u.shape[-1])                                                 # [T, M]
        decode = x.shape[0] <= GEMV_MAX_TOKENS
        routing = self.route(x)
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)             # [T, M']
        run = getattr(self.experts, "run", None)  # FP8 experts (fastmamba.layers.fp8_linear.FP8Experts)
        S = self.shared_fused if decode and run is None else 0
        up, down = self.experts.up_proj, self.experts.down_proj
        if run is not None:
            y = run(h, routing)
        elif decode:  # the GEMV path; its k-sum in the down kernel; the shared expert inside when S
            shared = (self.shared_experts.up_proj.weight, self.shared_experts.down_proj.weight) if S else (None, None)
            y = fused_moe_gemv(h, up, down, routing.weights, routing.ids, shared_up=shared[0], shared_down=shared[1],
                               arrivals=self.decode_arrivals[1:])
        else:
            y = fused_moe(h, up, down, routing.weights, routing.ids)
        if self.fc2_latent_proj is not None:
            y = self.fc2_latent_proj(y)
        if not S:
            y = self.shared_experts(x, add=y)  # y + shared(x) (an FP8 shared expert adds in its down GEMV)
        return (y if self.reduce is None else self.reduce(y)).view(u.shape)
