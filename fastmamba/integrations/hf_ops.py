"""fastmamba's ops behind transformers' Mamba-2 hooks: one adapter per hook, with the hook's signature.

transformers runs the Mamba-2 mixer of ``Mamba2ForCausalLM`` and ``NemotronHForCausalLM`` through
named hooks (``models/{mamba2,nemotron_h}/modeling_*.py``; the whole ops from 5.25, the functions
from 5.17):

  whole ops    ``causal_conv1d_forward(conv1d, hidden_states, cache, layer_idx, ...)``: the conv
               and its cache bookkeeping; ``mamba2_scan_forward(module, hidden_states, B, C, dt,
               cache)``: the SSD scan (prefill) or the state update (decode) and the cache
  functions    ``causal_conv1d_fn``, ``causal_conv1d_update``, ``selective_state_update``,
               ``mamba_chunk_scan_combined``: what the whole ops call
  modules      the gated RMSNorm (``mixer.norm``), the MoE router (``moe.gate``) and the experts
               (``ExpertsInterface``: ``experts_forward``)

The ``*_hook`` functions are methods of transformers' private per-mixer wrappers (``self`` is the
wrapper; its class's own ``forward`` is transformers' implementation, the fallback), so they serve
both ``fastmamba.integrations.transformers.use`` and the ``kernels`` build (kernels_build/). The
whole-op ``*_forward`` functions take that fallback as their first argument.

The ops are looked up on ``fastmamba.ops`` / ``fastmamba.ops.moe`` at call time, so a test can
count the calls by wrapping them there.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

import fastmamba.ops as _ops
import fastmamba.ops.moe as _moe


# --- functions: the hooks transformers' whole ops call (and mamba_ssm / causal_conv1d provide) ---

def causal_conv1d_fn(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     activation: str | None = None, **kwargs) -> torch.Tensor:
    """transformers' ``causal_conv1d_fn``: hidden_states [B, E, L] (any strides), weight [E, W],
    bias [E] or None; ``seq_idx`` [B, L] in kwargs keeps packed sequences apart. Returns [B, E, L]
    in hidden_states' dtype (fastmamba.ops.causal_conv1d_fn)."""
    if kwargs.get("cu_seqlens") is not None and kwargs.get("seq_idx") is None:
        raise ValueError("causal_conv1d_fn: packed sequences need `seq_idx` [B, L]; `cu_seqlens` alone is not "
                         "supported by this hook")
    return _ops.causal_conv1d_fn(hidden_states, weight, bias, kwargs.get("seq_idx"), activation=activation)


def causal_conv1d_update(hidden_states: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """transformers' ``causal_conv1d_update``: hidden_states [B, E, L] with L new tokens, conv_state
    [B, E, W] mutated in place (its last W inputs), weight [E, W]. Returns [B, E, L]."""
    return _ops.causal_conv1d_update(hidden_states, conv_state, weight, bias, activation)


def selective_state_update(state: torch.Tensor, hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None,
                           dt_bias: torch.Tensor | None = None, dt_softplus: bool = False,
                           z: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """transformers' ``mamba2_selective_state_update`` (its argument order: D, dt_bias, dt_softplus, z):
    state [B, H, P, N] mutated in place, hidden_states [B, H, P], dt [B, H, P], A [H, P, N], B and C
    [B, G, N]. Returns y [B, H, P] (fastmamba.ops.selective_state_update)."""
    return _ops.selective_state_update(state, hidden_states, dt, A, B, C, D, z, dt_bias, dt_softplus,
                                       kwargs.get("state_batch_indices"))


def chunk_scan(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               chunk_size: int, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
               initial_states: torch.Tensor | None = None, dt_softplus: bool = False,
               dt_limit: tuple[float, float] = (0.0, math.inf), return_final_states: bool = False, **kwargs):
    """transformers' ``mamba2_chunk_scan``: hidden_states [B, L, H, P], dt [B, L, H], A [H], B and C
    [B, L, G, N], initial_states [B, H, P, N] or None. Returns y [B, L, H, P], and the final state
    [B, H, P, N] fp32 with ``return_final_states`` (fastmamba.ops.mamba_chunk_scan_combined)."""
    nb, L, H, P = hidden_states.shape
    if L == 0:  # transformers asks for zero tokens when every token is kept as an intermediate state
        y = hidden_states.new_empty(nb, 0, H, P)
        if not return_final_states:
            return y
        N = B.shape[-1]
        final = (initial_states.float() if initial_states is not None
                 else torch.zeros(nb, H, P, N, dtype=torch.float32, device=hidden_states.device))
        return y, final
    return _ops.mamba_chunk_scan_combined(
        hidden_states, dt, A, B, C, chunk_size, D=D, z=kwargs.get("z"), dt_bias=dt_bias,
        initial_states=initial_states, seq_idx=kwargs.get("seq_idx"), cu_seqlens=kwargs.get("cu_seqlens"),
        dt_softplus=dt_softplus, dt_limit=tuple(dt_limit), return_final_states=return_final_states)


# --- whole ops: the conv and the scan with transformers' own cache objects ---

def conv_forward(fallback: Callable, conv1d: torch.nn.Conv1d, hidden_states: torch.Tensor, cache, layer_idx: int,
                 activation: str | None = None, state_idx: int = 0, **kwargs) -> torch.Tensor:
    """transformers' ``causal_conv1d_forward`` on fastmamba's conv ops.

    hidden_states [B, E, L] (the channel-last view of in_proj's output); cache: transformers' Cache
    (its conv state [B, E, W] for ``layer_idx``) or None. One cached token: ``causal_conv1d_update``
    in place on the cache's conv state; otherwise the cache is updated as transformers does
    (``cache.update_conv_state``, which also counts the tokens) and ``causal_conv1d_fn`` runs over
    the previous state and the new tokens. A cache that records past states (assisted decoding)
    goes to ``fallback`` (transformers' implementation, which calls the function hooks).
    Returns [B, E, L] in hidden_states' dtype.
    """
    if cache is not None and cache.is_recording_past(layer_idx):
        return fallback(conv1d, hidden_states, cache, layer_idx, activation=activation, state_idx=state_idx,
                        **kwargs)
    L = hidden_states.shape[-1]
    weight = conv1d.weight.squeeze(1)  # [E, W], a view
    bias = conv1d.bias
    conv_state = cache.get_conv_state(layer_idx, state_idx=state_idx) if cache is not None else None
    if conv_state is not None and L == 1:
        cache.increase_count(layer_idx, state_idx)
        return _ops.causal_conv1d_update(hidden_states, conv_state, weight, bias, activation)
    if cache is None:
        return causal_conv1d_fn(hidden_states, weight, bias, activation=activation, **kwargs)
    full = cache.update_conv_state(hidden_states, layer_idx, state_idx=state_idx,
                                   conv_kernel_size=conv1d.kernel_size[0])  # [B, E, W + L] or [B, E, max(L, W)]
    return _ops.causal_conv1d_fn(full, weight, bias, activation=activation)[:, :, -L:]


def scan_forward(fallback: Callable, module: torch.nn.Module, hidden_states: torch.Tensor, B: torch.Tensor,
                 C: torch.Tensor, dt: torch.Tensor, cache, **kwargs) -> torch.Tensor:
    """transformers' ``mamba2_scan_forward`` on fastmamba's scan ops.

    module: the mixer (A_log, D, dt_bias, time_step_limit, chunk_size, layer_idx, heads H, head dim
    P, groups G, state size N); hidden_states [B, L, H*P], B and C [B, L, G*N], dt [B, L, H] (before
    dt_bias and softplus); cache: transformers' Cache or None. One cached token:
    ``selective_state_update`` writes the cache's recurrent state in place (transformers clones it
    and copies it back); otherwise ``mamba_chunk_scan_combined`` from the cached state (or zeros) and
    its final state goes to ``cache.update_recurrent_state``. A cache that records past states goes
    to ``fallback``. Returns [B, L, H*P], the D skip included.
    """
    layer_idx = module.layer_idx
    if cache is not None and cache.is_recording_past(layer_idx):
        return fallback(module, hidden_states, B, C, dt, cache, **kwargs)
    nb, L, _ = hidden_states.shape
    H, P, G, N = module.num_heads, module.head_dim, module.n_groups, module.ssm_state_size
    state = cache.get_recurrent_state(layer_idx, state_idx=0) if cache is not None else None
    if state is not None and L == 1:
        y = _ops.selective_state_update(
            state, hidden_states.view(nb, H, P), dt.view(nb, H), module.A_log, B.view(nb, G, N), C.view(nb, G, N),
            module.D, None, module.dt_bias, True, A_is_log=True)
        return y.view(nb, 1, H * P)
    A = -torch.exp(module.A_log.float())
    out = _ops.mamba_chunk_scan_combined(
        hidden_states.view(nb, L, H, P), dt, A, B.view(nb, L, G, N), C.view(nb, L, G, N), module.chunk_size,
        D=module.D, dt_bias=module.dt_bias, initial_states=state, seq_idx=kwargs.get("seq_idx"),
        cu_seqlens=kwargs.get("cu_seqlens"), dt_softplus=True, dt_limit=tuple(module.time_step_limit),
        return_final_states=cache is not None)
    if cache is not None:
        out, final = out
        cache.update_recurrent_state(final, layer_idx)
    return out.reshape(nb, L, H * P)


# --- hooks: methods of transformers' per-mixer wrappers (kernels' ``Func`` modules) ---

def _own(self) -> Callable:
    """The wrapper's own implementation: transformers' code for this hook."""
    return type(self).forward.__get__(self)


def causal_conv1d_forward_hook(self, conv1d, hidden_states, cache, layer_idx, activation=None, state_idx=0,
                               **kwargs):
    return conv_forward(_own(self), conv1d, hidden_states, cache, layer_idx, activation, state_idx, **kwargs)


def mamba2_scan_forward_hook(self, module, hidden_states, B, C, dt, cache, **kwargs):
    return scan_forward(_own(self), module, hidden_states, B, C, dt, cache, **kwargs)


def causal_conv1d_fn_hook(self, hidden_states, weight, bias=None, activation=None, **kwargs):
    return causal_conv1d_fn(hidden_states, weight, bias, activation, **kwargs)


def causal_conv1d_update_hook(self, hidden_states, conv_state, weight, bias=None, activation=None):
    return causal_conv1d_update(hidden_states, conv_state, weight, bias, activation)


def selective_state_update_hook(self, state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False,
                                z=None, **kwargs):
    return selective_state_update(state, hidden_states, dt, A, B, C, D, dt_bias, dt_softplus, z, **kwargs)


def chunk_scan_hook(self, hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                    dt_softplus=False, dt_limit=(0.0, math.inf), return_final_states=False, **kwargs):
    return chunk_scan(hidden_states, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_softplus, dt_limit,
                      return_final_states, **kwargs)


# The hooks by the name transformers registers them under (a mixer's ``_kernel_funcs`` keys, the
# ``kernel_layer_name`` a KernelConfig maps).
HOOKS: dict[str, Callable] = {
    "causal_conv1d_forward": causal_conv1d_forward_hook,
    "mamba2_scan_forward": mamba2_scan_forward_hook,
    "causal_conv1d_fn": causal_conv1d_fn_hook,
    "causal_conv1d_update": causal_conv1d_update_hook,
    "selective_state_update": selective_state_update_hook,
    "mamba_chunk_scan_combined": chunk_scan_hook,
}


# --- modules: gated norm, router, experts ---

def gated_rmsnorm_forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """The gated RMSNorm's forward (``Mamba2RMSNormGated``, ``NemotronHRMSNormGated``; 5.17's
    ``Zamba2RMSNormGated`` and ``MambaRMSNormGated``): weight * rmsnorm(x * silu(gate)), hidden_states
    and gate [..., H*P]; per group of ``group_size`` columns where the module has one, else over all
    columns (5.17's Mamba-2 norm ignores n_groups). On fastmamba.ops.rmsnorm_fn."""
    return _ops.rmsnorm_fn(hidden_states, self.weight, None, z=gate, eps=float(self.variance_epsilon),
                           group_size=getattr(self, "group_size", None), norm_before_gate=False)


def router_forward(self, hidden_states: torch.Tensor):
    """``NemotronHTopkRouter.forward`` on fastmamba.ops.moe.moe_route: returns (router_logits [T, E]
    fp32, topk_weights [T, k] fp32, topk_indices [T, k] int64)."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    logits = F.linear(hidden_states.float(), self.weight.float())
    r = _moe.moe_route(logits, self.e_score_correction_bias.float(), top_k=self.top_k, n_group=self.num_group,
                       topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob,
                       routed_scaling_factor=self.routed_scaling_factor)
    return logits, r.weights, r.ids.long()


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """An ``ExpertsInterface`` implementation for Nemotron-H's relu² experts (no gate, no bias):
    hidden_states [T, M], top_k_index [T, k], top_k_weights [T, k]; up_proj [E, F, M], down_proj
    [E, M, F]. Returns [T, M] (fastmamba.ops.moe.fused_moe)."""
    if self.has_gate or self.has_bias or getattr(self, "has_post_expert_norm", False):
        raise ValueError(f"fastmamba experts: {type(self).__name__} has a gate, a bias or a post-expert norm; "
                         "fused_moe runs non-gated relu² experts only")
    return _moe.fused_moe(hidden_states, self.up_proj, self.down_proj, top_k_weights.float(), top_k_index)
