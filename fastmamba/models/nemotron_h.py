"""NVIDIA Nemotron-H and Nemotron-3 (hybrids of Mamba-2 ``M``, attention ``*``, MLP ``-`` and MoE ``E``
layers): config, model, presets.

Module and tensor names follow transformers' ``NemotronHForCausalLM`` as ``save_pretrained``
writes them (letters as in STYLE.md; M = d_model, V vocab, Hq / Hkv attention heads, Dh head dim,
F MLP width, D = H*P the Mamba width, E = D + 2 G N conv channels):

    backbone.embeddings.weight                  [V, M]
    backbone.layers.{i}.norm.weight             [M]          every block: RMSNorm -> mixer -> + residual
      M:  backbone.layers.{i}.mixer.in_proj / conv1d / dt_bias / A_log / D / norm / out_proj
          (fastmamba.layers.mamba2.Mamba2Mixer; its width is mamba_num_heads * mamba_head_dim,
          not expand * hidden_size)
      *:  backbone.layers.{i}.mixer.q_proj [Hq*Dh, M], k_proj / v_proj [Hkv*Dh, M], o_proj [M, Hq*Dh]
          (no bias, no rotary or other position embedding: transformers' NemotronHAttention)
      -:  backbone.layers.{i}.mixer.up_proj [F, M], down_proj [M, F]   relu(x)^2, not gated
      E:  backbone.layers.{i}.mixer.gate.weight [E, M] fp32, gate.e_score_correction_bias [E] fp32,
          experts.up_proj [E, F, M'] / experts.down_proj [E, M', F] (transformers' fused form; NVIDIA's
          per-expert experts.{e}.up_proj.weight [F, M'] / down_proj.weight [M', F] are stacked into it
          on load: ``fastmamba.models.weights.stack_experts``), shared_experts.up_proj / down_proj,
          and with ``moe_latent_size`` fc1_latent_proj [M', M] / fc2_latent_proj [M, M']
          (fastmamba.layers.moe.MoE; M' = moe_latent_size or M, F = moe_intermediate_size)
    backbone.norm_f.weight                      [M]
    lm_head.weight                              [V, M]       the embeddings themselves when tied

The model (``NemotronHLM``) mirrors ``Mamba2LM``: ``forward(ids [B, L])`` full logits,
``prefill_varlen(ids, cu_seqlens, cache, slots)`` last-token logits, ``decode`` / ``step`` one
token per request, ``new_cache(max_batch, ...)`` a ``HybridCache`` (Mamba slots + paged KV). It
loops over ``fastmamba.models.blocks`` without knowing their kinds.

transformers differences worth knowing:
  * its chunked (prefill) Mamba path clamps dt at ``time_step_min`` (1e-3) whatever
    ``time_step_limit`` says, its one-token path does not; we use ``time_step_limit`` (only
    (0, inf) is supported, as every public checkpoint has), so the two agree unless
    softplus(dt + dt_bias) < 1e-3 somewhere;
  * ``residual_in_fp32`` is read but not used by transformers' blocks (the residual stays in the
    model dtype); we keep it in fp32 when it is set. Identical in fp32.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from fastmamba.cache.hybrid_cache import HybridCache
from fastmamba.cache.prefix_cache import DeviceSnapshots, SnapshotPlan, device_layer_snapshots, layer_snapshots
from fastmamba.generation.rounding import check_rand_seed
from fastmamba.layers.attention import KVBatch
from fastmamba.models.blocks import Batch, RMSNorm, SpecBatch, build_blocks
from fastmamba.layers.moe import MoEConfig
from fastmamba.models.inputs import check_index_tensor, embed, host_metadata
from fastmamba.models.config import Mamba2Config, _as_float, _Fields, checkpoint_eos_token_ids
from fastmamba.models.loader import _checkpoint_dtype, _default_device, random_init  # random_init: re-exported for the presets
from fastmamba.ops import add_rmsnorm
from fastmamba.ops.attention import PrefillWork, prefill_block_tokens, prefill_work
from fastmamba.ops.runtime import check_host_copies, host_list, long_prefill_kernels, trusted_inputs

# pattern character -> transformers' ``layers_block_type`` name (and the legacy names it remaps)
PATTERN_CHARS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_BLOCK_TYPE_TO_CHAR = {
    "linear_attention": "M", "mamba": "M",
    "full_attention": "*", "attention": "*",
    "mlp": "-",
    "moe": "E",
}
SUPPORTED_KINDS = "M*-E"


def _float(v: Any, field: str) -> float:
    """A float from config.json (transformers writes infinity as {"__float__": "Infinity"})."""
    out = _as_float(v)
    if out is None:
        raise ValueError(f"NemotronHConfig: `{field}` expected a number, got {v!r} ({type(v).__name__})")
    return out


def _bool(v: Any, field: str) -> bool:
    """A JSON boolean; a string such as "false" is refused rather than read as True."""
    if not isinstance(v, bool):
        raise ValueError(f"NemotronHConfig: `{field}` expected true or false, got {v!r} ({type(v).__name__})")
    return v


@dataclasses.dataclass(frozen=True)
class MambaLayerConfig(Mamba2Config):
    """``Mamba2Config`` for a Nemotron-H Mamba layer: the mixer's width is ``mamba_num_heads *
    mamba_head_dim`` (Nemotron-H-4B: 112 x 64 = 7168, not 2 x 3072). ``n_layer`` counts the Mamba
    layers only (the ``StateCache`` pools)."""

    mamba_d_inner: int = 0

    @property
    def d_inner(self) -> int:
        return self.mamba_d_inner


@dataclasses.dataclass(frozen=True)
class NemotronHConfig:
    """Sizes of a Nemotron-H / Nemotron-3 LM; each field says which config.json key it comes from."""

    d_model: int                      # hidden_size
    vocab_size: int                   # vocab_size
    pattern: str                      # hybrid_override_pattern, or layers_block_type / layer_types as M * -
    n_heads: int = 32                 # num_attention_heads (Hq)
    n_kv_heads: int = 8               # num_key_value_heads (Hkv; GQA when < Hq)
    head_dim: int = 128               # head_dim (Dh)
    intermediate_size: int = 21504    # intermediate_size (F)
    mlp_act: str = "relu2"            # mlp_hidden_act
    mlp_bias: bool = False            # mlp_bias
    mamba_nheads: int = 128           # mamba_num_heads (H)
    mamba_headdim: int = 64           # mamba_head_dim (P)
    n_groups: int = 8                 # n_groups / mamba_n_groups (G)
    d_state: int = 128                # ssm_state_size (N)
    d_conv: int = 4                   # conv_kernel / mamba_d_conv (W)
    chunk_size: int = 128             # chunk_size / mamba_chunk_size
    conv_bias: bool = True            # use_conv_bias / mamba_conv_bias
    mamba_proj_bias: bool = False     # use_bias (the Mamba in_proj / out_proj, as transformers builds them)
    norm_eps: float = 1e-5            # layer_norm_epsilon
    residual_in_fp32: bool = False    # residual_in_fp32
    tie_embeddings: bool = False      # tie_word_embeddings
    dt_limit: tuple[float, float] = (0.0, math.inf)  # time_step_limit / mamba_dt_limit
    # MoE layers ("E"; transformers' NemotronHMoE), fields named as config.json names them
    n_routed_experts: int = 8                        # n_routed_experts / num_local_experts (E)
    num_experts_per_tok: int = 2                     # top-k
    moe_intermediate_size: int = 7688                # routed expert width (F)
    moe_shared_expert_intermediate_size: int = 7688  # the shared expert's width
    n_shared_experts: int = 1                        # (one shared MLP of the width above, as transformers builds it)
    moe_latent_size: int | None = None               # LatentMoE: routed experts run in this width
    n_group: int = 1                                 # grouped selection: E experts in n_group groups,
    topk_group: int = 1                              # the topk_group best groups kept
    norm_topk_prob: bool = True                      # renormalise the k weights to sum to 1
    routed_scaling_factor: float = 1.0               # then scale them
    eos_token_ids: tuple[int, ...] = ()              # eos_token_id (generation_config.json's wins: from_dir)
    max_position_embeddings: int | None = None       # max_position_embeddings (None when absent)

    def __post_init__(self) -> None:
        def bad(field: str, msg: str) -> ValueError:
            return ValueError(f"NemotronHConfig: `{field}` {msg}")

        for field, key in (("d_model", "hidden_size"), ("vocab_size", "vocab_size")):
            v = getattr(self, field)
            if not (isinstance(v, int) and v >= 1):
                raise bad(key, f"expected a positive integer, got {v!r}")
        if not self.pattern:
            raise bad("hybrid_override_pattern", "expected at least one layer, got an empty pattern")
        unknown = sorted({c for c in self.pattern if c not in PATTERN_CHARS})
        if unknown:
            raise bad("hybrid_override_pattern", f"expected characters from 'M' (Mamba-2), '*' (attention), "
                      f"'-' (MLP), 'E' (MoE), got {unknown} in {self.pattern!r}")
        ints: list[tuple[str, str]] = []
        if "*" in self.pattern:
            ints += [("n_heads", "num_attention_heads"), ("n_kv_heads", "num_key_value_heads"),
                     ("head_dim", "head_dim")]
        if "-" in self.pattern:
            ints += [("intermediate_size", "intermediate_size")]
        if "M" in self.pattern:
            ints += [("mamba_nheads", "mamba_num_heads"), ("mamba_headdim", "mamba_head_dim"),
                     ("n_groups", "n_groups"), ("d_state", "ssm_state_size"), ("d_conv", "conv_kernel"),
                     ("chunk_size", "chunk_size")]
        if "E" in self.pattern:
            ints += [(k, k) for k in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                                      "moe_shared_expert_intermediate_size", "n_shared_experts", "n_group",
                                      "topk_group")]
            if self.moe_latent_size is not None:
                ints += [("moe_latent_size", "moe_latent_size")]
        for field, key in ints:
            v = getattr(self, field)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise bad(key, f"expected a positive integer, got {v!r}")
        if "E" in self.pattern:
            self._check_moe(bad)
        if "*" in self.pattern and self.n_heads % self.n_kv_heads:
            raise bad("num_key_value_heads", f"={self.n_kv_heads} must divide num_attention_heads={self.n_heads}")
        if "M" in self.pattern:
            if self.mamba_nheads % self.n_groups:
                raise bad("n_groups", f"={self.n_groups} must divide mamba_num_heads={self.mamba_nheads}")
            if self.d_conv < 2:
                raise bad("conv_kernel", f"expected at least 2, got {self.d_conv}")
            if tuple(self.dt_limit) != (0.0, math.inf):
                raise bad("time_step_limit", f"only (0.0, inf) is supported, got {tuple(self.dt_limit)}")
        if ("-" in self.pattern or "E" in self.pattern) and self.mlp_act != "relu2":
            raise bad("mlp_hidden_act", f"only 'relu2' (Nemotron-H's squared ReLU) is supported, got {self.mlp_act!r}")
        if not (self.norm_eps > 0):
            raise bad("layer_norm_epsilon", f"expected > 0, got {self.norm_eps!r}")
        ids = self.eos_token_ids
        if not (isinstance(ids, tuple) and all(isinstance(i, int) and not isinstance(i, bool) and
                                               0 <= i < self.vocab_size for i in ids)):
            raise bad("eos_token_id", f"expected token ids in [0, vocab_size={self.vocab_size}), got {ids!r}")
        mpe = self.max_position_embeddings
        if mpe is not None and (isinstance(mpe, bool) or not isinstance(mpe, int) or mpe < 1):
            raise bad("max_position_embeddings", f"expected a positive integer or null, got {mpe!r}")

    def _check_moe(self, bad) -> None:
        """The MoE fields' relations (each already a positive integer)."""
        E, k = self.n_routed_experts, self.num_experts_per_tok
        if k > E:
            raise bad("num_experts_per_tok", f"={k} exceeds n_routed_experts={E}")
        if E % self.n_group:
            raise bad("n_group", f"={self.n_group} must divide n_routed_experts={E}")
        if self.topk_group > self.n_group:
            raise bad("topk_group", f"={self.topk_group} exceeds n_group={self.n_group}")
        kept = self.topk_group * (E // self.n_group)
        if k > kept:
            raise bad("num_experts_per_tok", f"={k} exceeds the {kept} experts that topk_group={self.topk_group} "
                      f"of n_group={self.n_group} groups keep")
        if not isinstance(self.norm_topk_prob, bool):
            raise bad("norm_topk_prob", f"expected true or false, got {self.norm_topk_prob!r}")
        r = self.routed_scaling_factor
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < math.inf:
            raise bad("routed_scaling_factor", f"expected a finite number > 0, got {r!r}")

    # -- derived ---------------------------------------------------------------------------------

    @property
    def n_layer(self) -> int:
        return len(self.pattern)

    def layers_of(self, kind: str) -> list[int]:
        """Indices of the layers of one kind ("M", "*", "-" or "E")."""
        return [i for i, c in enumerate(self.pattern) if c == kind]

    @property
    def moe(self) -> MoEConfig:
        """What each MoE layer (``fastmamba.layers.moe.MoE``) reads."""
        return MoEConfig(
            d_model=self.d_model, n_experts=self.n_routed_experts, top_k=self.num_experts_per_tok,
            expert_width=self.moe_intermediate_size, shared_width=self.moe_shared_expert_intermediate_size,
            latent=self.moe_latent_size, n_group=self.n_group, topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob, routed_scaling_factor=float(self.routed_scaling_factor),
            bias=self.mlp_bias,
        )

    @property
    def mamba(self) -> MambaLayerConfig:
        """What ``Mamba2Mixer`` and ``StateCache`` read; ``n_layer`` = the number of Mamba layers."""
        return MambaLayerConfig(
            d_model=self.d_model, n_layer=max(1, len(self.layers_of("M"))), vocab_size=self.vocab_size,
            d_state=self.d_state, d_conv=self.d_conv, expand=1, headdim=self.mamba_headdim,
            ngroups=self.n_groups, chunk_size=self.chunk_size, norm_eps=self.norm_eps,
            residual_in_fp32=self.residual_in_fp32, tie_embeddings=self.tie_embeddings,
            conv_bias=self.conv_bias, proj_bias=self.mamba_proj_bias, norm_before_gate=False,
            dt_limit=tuple(self.dt_limit), mamba_d_inner=self.mamba_nheads * self.mamba_headdim,
        )

    # -- reading config.json -----------------------------------------------------------------------

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "NemotronHConfig":
        """Read transformers' (or NVIDIA's original) ``config.json`` dict with ``model_type: nemotron_h``."""
        mt = cfg.get("model_type")
        if mt != "nemotron_h":
            raise ValueError(f"NemotronHConfig: `model_type` expected 'nemotron_h', got {mt!r}")
        for key in ("hidden_size", "vocab_size"):
            if key not in cfg:
                raise ValueError(f"NemotronHConfig: `{key}` is missing from config.json")
        pattern = _pattern_of(cfg)
        if "num_hidden_layers" in cfg and cfg["num_hidden_layers"] is not None \
                and int(cfg["num_hidden_layers"]) != len(pattern):
            raise ValueError(f"NemotronHConfig: `num_hidden_layers`={cfg['num_hidden_layers']} but the layer "
                             f"pattern has {len(pattern)} layers ({pattern!r})")
        if int(cfg.get("num_nextn_predict_layers") or 0) > 0:
            raise ValueError(f"NemotronHConfig: `num_nextn_predict_layers`={cfg['num_nextn_predict_layers']}: "
                             "multi-token-prediction heads are not supported")
        if cfg.get("attention_bias"):
            raise ValueError("NemotronHConfig: `attention_bias`=True is not supported (transformers' "
                             "NemotronHAttention has no biases)")
        if cfg.get("sliding_window") is not None:
            raise ValueError(f"NemotronHConfig: `sliding_window`={cfg['sliding_window']} is not supported "
                             "(full causal attention only)")
        if cfg.get("mamba_hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"NemotronHConfig: `mamba_hidden_act` expected 'silu', got {cfg['mamba_hidden_act']!r}")

        def first(*keys, default=None):
            for k in keys:
                if k in cfg and cfg[k] is not None:
                    return cfg[k]
            return default

        experts = {k: cfg[k] for k in ("n_routed_experts", "num_local_experts") if cfg.get(k) is not None}
        if len(set(map(repr, experts.values()))) > 1:
            raise ValueError(f"NemotronHConfig: `num_local_experts`={experts['num_local_experts']!r} disagrees with "
                             f"`n_routed_experts`={experts['n_routed_experts']!r} (the same field)")
        latent = cfg.get("moe_latent_size")
        mpe = cfg.get("max_position_embeddings")
        eos = _Fields(cfg, "config.json", who="NemotronHConfig").eos("eos_token_id") or ()
        hidden = first("hidden_size")
        n_heads = first("num_attention_heads", default=32)
        ints = isinstance(hidden, int) and isinstance(n_heads, int) and n_heads > 0
        head_dim = first("head_dim", "attention_head_dim", default=hidden // n_heads if ints else 0)
        return cls(
            d_model=_int(hidden, "hidden_size"), vocab_size=_int(cfg["vocab_size"], "vocab_size"), pattern=pattern,
            n_heads=_int(n_heads, "num_attention_heads"),
            n_kv_heads=_int(first("num_key_value_heads", default=n_heads), "num_key_value_heads"),
            head_dim=_int(head_dim, "head_dim"),
            intermediate_size=_int(first("intermediate_size", default=21504), "intermediate_size"),
            mlp_act=str(first("mlp_hidden_act", default="relu2")), mlp_bias=_bool(first("mlp_bias", default=False), "mlp_bias"),
            mamba_nheads=_int(first("mamba_num_heads", default=128), "mamba_num_heads"),
            mamba_headdim=_int(first("mamba_head_dim", default=64), "mamba_head_dim"),
            n_groups=_int(first("n_groups", "mamba_n_groups", default=8), "n_groups"),
            d_state=_int(first("ssm_state_size", default=128), "ssm_state_size"),
            d_conv=_int(first("conv_kernel", "mamba_d_conv", default=4), "conv_kernel"),
            chunk_size=_int(first("chunk_size", "mamba_chunk_size", default=128), "chunk_size"),
            conv_bias=_bool(first("use_conv_bias", "mamba_conv_bias", default=True), "use_conv_bias"),
            mamba_proj_bias=_bool(first("use_bias", default=False), "use_bias"),
            norm_eps=_float(first("layer_norm_epsilon", default=1e-5), "layer_norm_epsilon"),
            residual_in_fp32=_bool(first("residual_in_fp32", default=False), "residual_in_fp32"),
            tie_embeddings=_bool(first("tie_word_embeddings", default=False), "tie_word_embeddings"),
            dt_limit=tuple(_float(v, "time_step_limit") for v in first("time_step_limit", "mamba_dt_limit", default=(0.0, math.inf))),
            n_routed_experts=_int(first("n_routed_experts", "num_local_experts", default=8), "n_routed_experts"),
            num_experts_per_tok=_int(first("num_experts_per_tok", default=2), "num_experts_per_tok"),
            moe_intermediate_size=_int(first("moe_intermediate_size", default=7688), "moe_intermediate_size"),
            moe_shared_expert_intermediate_size=_int(first("moe_shared_expert_intermediate_size", default=7688),
                                                     "moe_shared_expert_intermediate_size"),
            n_shared_experts=_int(first("n_shared_experts", default=1), "n_shared_experts"),
            moe_latent_size=None if latent is None else _int(latent, "moe_latent_size"),
            n_group=_int(first("n_group", default=1), "n_group"),
            topk_group=_int(first("topk_group", default=1), "topk_group"),
            norm_topk_prob=_bool(first("norm_topk_prob", default=True), "norm_topk_prob"),
            routed_scaling_factor=_float(first("routed_scaling_factor", default=1.0), "routed_scaling_factor"),
            eos_token_ids=eos,
            max_position_embeddings=None if mpe is None else _int(mpe, "max_position_embeddings"),
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "NemotronHConfig":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "NemotronHConfig":
        """A checkpoint directory's config.json, with ``eos_token_ids`` read by the rule every model
        family shares (``fastmamba.models.config.checkpoint_eos_token_ids``: generation_config.json's
        ``eos_token_id`` overrides config.json's; the tokenizer files' ``eos_token`` when neither names one)."""
        root = os.fspath(path)
        config_path = os.path.join(root, "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"NemotronHConfig: no config.json in {root!r}")
        cfg = cls.from_file(config_path)
        eos = checkpoint_eos_token_ids(root, cfg.eos_token_ids, cfg.vocab_size, who="NemotronHConfig")
        return cfg if eos == cfg.eos_token_ids else dataclasses.replace(cfg, eos_token_ids=eos)


def _int(v: Any, key: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ValueError(f"NemotronHConfig: `{key}` expected an integer, got {v!r}")
    return int(v)


def _pattern_of(cfg: dict[str, Any]) -> str:
    """The layer pattern as M * - E characters from ``hybrid_override_pattern`` or the per-layer
    list (``layers_block_type`` / ``layer_types``); when several are present they must agree."""
    found: list[tuple[str, str]] = []
    pat = cfg.get("hybrid_override_pattern")
    if pat is not None:
        if not isinstance(pat, str):
            raise ValueError(f"NemotronHConfig: `hybrid_override_pattern` expected a string, got {type(pat).__name__}")
        found.append(("hybrid_override_pattern", pat))
    for key in ("layers_block_type", "layer_types"):
        types = cfg.get(key)
        if types is None:
            continue
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise ValueError(f"NemotronHConfig: `{key}` expected a list of layer-type strings, got {types!r}")
        unknown = sorted({t for t in types if t not in _BLOCK_TYPE_TO_CHAR})
        if unknown:
            raise ValueError(f"NemotronHConfig: `{key}` has unknown layer types {unknown}; expected "
                             f"{sorted(_BLOCK_TYPE_TO_CHAR)}")
        found.append((key, "".join(_BLOCK_TYPE_TO_CHAR[t] for t in types)))
    if not found:
        raise ValueError("NemotronHConfig: config.json has no layer pattern (`hybrid_override_pattern`, "
                         "`layers_block_type` or `layer_types`)")
    (k0, p0), *rest = found
    for k, p in rest:
        if p != p0:
            raise ValueError(f"NemotronHConfig: `{k}` ({p!r} as a pattern) disagrees with `{k0}` ({p0!r})")
    return p0


# Public shapes. Nemotron-H 8B and 4B (Base-8K): Megatron-Bridge's model page
# (https://docs.nvidia.com/nemo/megatron-bridge/latest/models/llm/nemotronh.html) gives 52 layers,
# pattern M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-, 32 query heads / 8 KV groups of 128,
# Mamba head dim 64, state 128, and hidden 4096 / FFN 21504 / 128 Mamba heads (8B), hidden 3072 /
# FFN 12288 / 112 Mamba heads (4B). The rest (vocab 131072, n_groups 8, conv 4, chunk 128, eps 1e-5,
# untied head) are transformers' NemotronHConfig defaults, which mirror nvidia/Nemotron-H-8B-Base-8K's
# config.json. Random weights with a fixed seed (``load_nemotron_h(name)``), for benchmarks.
_NEMOTRON_H_PATTERN_52 = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"

# Nemotron-3 (MoE hybrids). Nano 30B-A3B: nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16's config.json and
# Megatron-Bridge's Nemotron3NanoProvider agree on 52 layers (23 Mamba, 23 MoE, 6 attention), hidden
# 2688, 64 Mamba heads of 64 (state 128, 8 groups), 32 query / 2 KV heads of 128, 128 routed experts,
# top-6, expert width 1856, one shared expert of 3712, sigmoid router with n_group 1 / topk_group 1,
# routed scaling 2.5. Super 120B-A12B's layers (issue 50's table; 88 layers in the whole model): hidden
# 4096, 128 Mamba heads, 512 experts top-22 of width 2688 in a 1024-wide latent (LatentMoE), shared 5376,
# scaling 5.0; the slice keeps a few layers of each kind for per-layer speed (the whole model needs FP8
# or several GPUs).
_NEMOTRON_3_NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"

PRESETS: dict[str, NemotronHConfig] = {
    # tiny: every kind, GQA, G > 1, tests and demos
    "nemotron-h-tiny": NemotronHConfig(
        d_model=64, vocab_size=256, pattern="M*-M-*M", n_heads=4, n_kv_heads=2, head_dim=16,
        intermediate_size=96, mamba_nheads=8, mamba_headdim=16, n_groups=2, d_state=16, chunk_size=16,
    ),
    # tiny MoE hybrid: every kind incl. MoE (8 experts, top-2, shared expert), for tests and demos
    "nemotron-3-tiny": NemotronHConfig(
        d_model=64, vocab_size=256, pattern="M*EM-E", n_heads=4, n_kv_heads=2, head_dim=16,
        intermediate_size=96, mamba_nheads=8, mamba_headdim=16, n_groups=2, d_state=16, chunk_size=16,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=64,
        routed_scaling_factor=2.5,
    ),
    "nemotron-3-nano": NemotronHConfig(
        d_model=2688, vocab_size=131072, pattern=_NEMOTRON_3_NANO_PATTERN, n_heads=32, n_kv_heads=2, head_dim=128,
        intermediate_size=1856, mamba_nheads=64, mamba_headdim=64, n_groups=8, d_state=128, d_conv=4,
        chunk_size=128, n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
    "nemotron-3-super-slice": NemotronHConfig(
        d_model=4096, vocab_size=131072, pattern="MEMEM*E", n_heads=32, n_kv_heads=2, head_dim=128,
        intermediate_size=2688, mamba_nheads=128, mamba_headdim=64, n_groups=8, d_state=128, d_conv=4,
        chunk_size=128, n_routed_experts=512, num_experts_per_tok=22, moe_intermediate_size=2688,
        moe_shared_expert_intermediate_size=5376, moe_latent_size=1024, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=5.0,
    ),
    "nemotron-h-4b": NemotronHConfig(
        d_model=3072, vocab_size=131072, pattern=_NEMOTRON_H_PATTERN_52, n_heads=32, n_kv_heads=8, head_dim=128,
        intermediate_size=12288, mamba_nheads=112, mamba_headdim=64, n_groups=8, d_state=128,
    ),
    "nemotron-h-8b": NemotronHConfig(
        d_model=4096, vocab_size=131072, pattern=_NEMOTRON_H_PATTERN_52, n_heads=32, n_kv_heads=8, head_dim=128,
        intermediate_size=21504, mamba_nheads=128, mamba_headdim=64, n_groups=8, d_state=128,
    ),
}


# ---------------------------------------------------------------------------------------------
# the model


class StagedPrefill(NamedTuple):
    """A hybrid prefill's metadata on the device, for a cache the caller has grown already (what
    ``GraphedPrefill`` stages for a graph). Without attention layers the fields are not read (None).

    positions   [T] int64: each token's position in its request
    token_rows  [T] int64: each token's prompt (an index into slots)
    ctx_lens    [B] int64: tokens each request held before this call
    work        ``PrefillWork``: the attention kernel's work table (``prefill_work``)
    """

    positions: torch.Tensor | None
    token_rows: torch.Tensor | None
    ctx_lens: torch.Tensor | None
    work: PrefillWork | None


def prefill_kv_values(ctx: Sequence[int], layout: Sequence[int], cu: Sequence[int], block_m: int,
                      capacity: int | None = None) -> dict[str, list[int]]:
    """A packed prefill's attention metadata as host lists, what ``StagedPrefill`` holds.

    ctx       tokens each real request held before the call (the first len(ctx) requests)
    layout    every request's token count, real then padding requests (slot -1, if any)
    cu        layout's cumulative sums from 0 (the call's cu_seqlens)
    Returns positions (each real token's position, 0 for padding tokens), token_rows (each token's
    request), ctx (0 for padding requests) and work (``prefill_work(cu, block_m, capacity)``)."""
    real = sum(layout[:len(ctx)])
    return {"positions": [c + i for c, n in zip(ctx, layout) for i in range(n)] + [0] * (cu[-1] - real),
            "token_rows": [b for b, n in enumerate(layout) for _ in range(n)],
            "ctx": list(ctx) + [0] * (len(layout) - len(ctx)),
            "work": prefill_work(cu, block_m, capacity)}


class NemotronHBackbone(nn.Module):
    def __init__(self, cfg: NemotronHConfig, device=None, dtype=None):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model, device=device, dtype=dtype)
        self.layers = build_blocks(cfg, device=device, dtype=dtype)
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps, device=device, dtype=dtype)


class NemotronHLM(nn.Module):
    """``forward(input_ids [B, L]) -> logits [B, L, V]`` (fp32); ``prefill_varlen`` / ``decode`` with a
    ``HybridCache`` (``new_cache``). The same API as ``Mamba2LM``, speculative ``verify`` / ``commit`` included."""

    def __init__(self, cfg: NemotronHConfig, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.backbone = NemotronHBackbone(cfg, device=device, dtype=dtype)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, device=device, dtype=dtype)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def _run(self, input_ids: torch.Tensor, mix, *, rows: torch.Tensor | None = None,
             hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Embeddings -> blocks -> final norm -> fp32 logits (of the leading-dim ``rows`` only, if
        given); ``mix(block, normed)`` runs one block's mixer; ``hidden``: the embeddings when the
        caller looked them up already (before the cache grew). Each block boundary is one fused
        kernel: residual += previous output, then the next block's RMSNorm."""
        rdtype = torch.float32 if self.cfg.residual_in_fp32 else self.dtype
        out = embed(self.backbone.embeddings, input_ids, "NemotronHLM", "input_ids") if hidden is None else hidden
        residual = None
        for block in self.backbone.layers:
            normed, residual = add_rmsnorm(out, residual, block.norm.weight, block.norm.eps, residual_dtype=rdtype)
            out = mix(block, normed)
        if rows is not None:
            out, residual = out[rows], residual[rows]
        norm_f = self.backbone.norm_f
        normed, _ = add_rmsnorm(out, residual, norm_f.weight, norm_f.eps, residual_dtype=rdtype)
        return self.lm_head(normed).float()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, L] int64 -> logits [B, L, V] fp32; every row starts fresh, nothing is cached."""
        check_index_tensor("NemotronHLM.forward", "input_ids", input_ids, "token ids")
        if input_ids.dim() != 2:
            raise ValueError(f"NemotronHLM.forward: `input_ids` expected shape (B, L), got {tuple(input_ids.shape)}")
        return self._run(input_ids, lambda block, h: block(h))

    def new_cache(
        self,
        max_batch: int,
        *,
        max_seq_len: int = 4096,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_budget_bytes: int | None = None,
        ssm_dtype: torch.dtype = torch.float32,
        speculate: int = 0,
    ) -> HybridCache:
        """Mamba slot pools for ``max_batch`` requests and the attention layers' paged KV (pages of
        ``page_size`` tokens: ``num_pages`` of them, or as many as ``kv_budget_bytes`` holds, or by
        default enough for every request at ``max_seq_len``). ``speculate``: 0 only (speculative
        ``speculate=K``: what ``verify`` with T = K+1 needs (the Mamba pools' replay and legacy
        buffers; needs Mamba layers)."""
        c = self.cfg
        return HybridCache(
            max_batch, mamba_cfg=c.mamba if "M" in c.pattern else None, n_attn_layers=c.pattern.count("*"),
            n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, max_seq_len=max_seq_len, page_size=page_size,
            num_pages=num_pages, kv_budget_bytes=kv_budget_bytes, device=self.lm_head.weight.device,
            dtype=self.dtype, ssm_dtype=ssm_dtype, speculate=speculate,
        )

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, cache: HybridCache, slots: torch.Tensor) -> torch.Tensor:
        """B prompts of equal length [B, L]; returns the last logits [B, V] (``prefill_varlen``)."""
        check_index_tensor("NemotronHLM.prefill", "input_ids", input_ids, "token ids")
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"NemotronHLM.prefill: `input_ids` expected shape (B, L) with L >= 1, "
                             f"got {tuple(input_ids.shape)}")
        nreq, L = input_ids.shape
        cu_seqlens = torch.arange(0, nreq * L + 1, L, dtype=torch.int32, device=input_ids.device)
        return self.prefill_varlen(input_ids.reshape(-1), cu_seqlens, cache, slots)

    def prefill_block_tokens(self) -> int:
        """Query tokens per work item of the attention prefill kernel (``PrefillWork.block_m``) for
        this model's heads, dtype and device."""
        c = self.cfg
        return prefill_block_tokens(c.n_heads, c.n_kv_heads, c.head_dim, self.dtype, self.lm_head.weight.device)

    @torch.inference_mode()
    def prefill_varlen(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        cache: HybridCache,
        slots: torch.Tensor,
        has_initial_state: torch.Tensor | bool | None = None,
        *,
        rand_seed: torch.Tensor | None = None,
        cu_seqlens_host: Sequence[int] | None = None,
        slots_host: Sequence[int] | None = None,
        snapshots: SnapshotPlan | DeviceSnapshots | None = None,
        live_seqs: int | None = None,
        staged: StagedPrefill | None = None,
    ) -> torch.Tensor:
        """Run B prompts of any lengths packed into one call; returns each one's last-token logits [B, V] fp32.

        input_ids   [T] int64: the prompts back to back
        cu_seqlens  [B+1] int32/int64: prompt b is input_ids[cu_seqlens[b]:cu_seqlens[b+1]]; starts
                    at 0, ends at T, every prompt at least one token
        slots       [B] int32/int64: allocated slots (``cache.alloc``), distinct. Each prompt
                    continues its slot's request: a fresh slot starts from nothing; one that has
                    consumed tokens (an earlier prefill chunk or decode steps) continues from its
                    Mamba states and attends to its cached K/V (chunked prefill)
        has_initial_state  None (default): the cache decides (a slot that holds tokens continues,
                    a fresh one starts from zeros). Accepted for ``Mamba2LM``'s call: True, False
                    or a [B] bool tensor, checked against the cache's lengths where that costs no
                    device read (False while a slot holds tokens: ValueError); the cache's
                    lengths are what is used. With ``staged``: the [B] bool tensor that is used
        rand_seed   int64 [n_layer] device tensor or None: stochastic rounding of 16-bit SSM
                    states (the j-th Mamba layer uses element j)
        cu_seqlens_host, slots_host  the values of ``cu_seqlens`` and ``slots`` as the host holds
                    them (the engine does), or None: read from the tensors (one device read each)
        snapshots   a ``fastmamba.cache.prefix_cache.SnapshotPlan`` (its pools: one per Mamba layer)
                    or None: also copy the Mamba layers' states at the chunk ends it names into its
                    pools, as ``Mamba2LM.prefill_varlen`` does (the K/V of those positions stay in
                    the slots' pages, for the caller to copy); with ``staged``, a ``DeviceSnapshots``
                    whose indices the caller checked against this call
        live_seqs   prompts that are not padding (slot -1), or None: counted from the slots (a
                    graph capture passes its batch's count to its all-padding warm-up too)
        staged      None: the cache grows here (``HybridCache.grow``: KV pages for the new tokens)
                    and the attention metadata go down in one copy. Or a ``StagedPrefill``: the
                    caller has grown the cache for this call and holds the metadata on the device
                    (``GraphedPrefill``'s static inputs); nothing is grown, uploaded or read back
        Mamba states are mutated in place, the prompts' K/V written into their pages.
        """
        who = "NemotronHLM.prefill_varlen"
        check_index_tensor(who, "input_ids", input_ids, "token ids")
        check_index_tensor(who, "cu_seqlens", cu_seqlens, "prompt offsets")
        check_index_tensor(who, "slots", slots, "cache slots")
        if input_ids.dim() != 1:
            raise ValueError(f"NemotronHLM.prefill_varlen: `input_ids` expected shape (T,), "
                             f"got {tuple(input_ids.shape)}")
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"NemotronHLM.prefill_varlen: `cu_seqlens` expected shape (B+1,) with B >= 1, "
                             f"got {tuple(cu_seqlens.shape)}")
        nseq = cu_seqlens.shape[0] - 1
        if tuple(slots.shape) != (nseq,):
            raise ValueError(f"NemotronHLM.prefill_varlen: `slots` expected shape (B,)=({nseq},), "
                             f"got {tuple(slots.shape)}")
        check_host_copies("NemotronHLM.prefill_varlen", (("cu_seqlens_host", cu_seqlens_host, cu_seqlens),
                                                         ("slots_host", slots_host, slots)))
        check_rand_seed(rand_seed, self.cfg.n_layer, self.lm_head.weight.device, "NemotronHLM.prefill_varlen")
        reads = [t for t, host in ((cu_seqlens, cu_seqlens_host), (slots, slots_host)) if host is None]
        read = host_metadata(who, "input_ids", input_ids, self.cfg.vocab_size, reads) if reads else []
        # (the token ids' range rides in that one read; without one, they meet the embedding below first)
        cu = [int(v) for v in cu_seqlens_host] if cu_seqlens_host is not None else read.pop(0)
        if cu[0] != 0 or cu[-1] != input_ids.shape[0]:
            raise ValueError(f"NemotronHLM.prefill_varlen: `cu_seqlens` must start at 0 and end at T="
                             f"{input_ids.shape[0]}, got {cu[0]} .. {cu[-1]}")
        if any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"NemotronHLM.prefill_varlen: `cu_seqlens` must not decrease, got {cu[:16]}")
        empty = [b for b in range(nseq) if cu[b + 1] <= cu[b]]
        if empty:
            raise ValueError(f"NemotronHLM.prefill_varlen: every prompt needs at least one token; prompts "
                             f"{empty[:8]} have none")
        sl = [int(v) for v in slots_host] if slots_host is not None else read.pop(0)
        live = [s for s in sl if s != -1]
        if len(set(live)) != len(live) or (staged is None and len(live) != len(sl)):
            raise ValueError(f"NemotronHLM.prefill_varlen: `slots` must be distinct allocated slots, got {sl[:16]}")
        if live_seqs is not None and not (isinstance(live_seqs, int) and not isinstance(live_seqs, bool)
                                          and 0 <= live_seqs <= nseq):
            raise ValueError(f"NemotronHLM.prefill_varlen: `live_seqs` expected an int in [0, B={nseq}] or None, "
                             f"got {live_seqs!r}")
        lens = [cu[b + 1] - cu[b] for b in range(nseq)]
        dev = input_ids.device
        hidden = None
        if staged is not None:
            has_initial_state, kv, snap = self._staged_inputs(staged, has_initial_state, snapshots, cache, slots,
                                                              cu_seqlens, cu, sl, nseq, input_ids.shape[0])
        else:
            if has_initial_state is False and any(cache.length(s) for s in sl):
                held = [s for s in sl if cache.length(s)]
                raise ValueError(f"NemotronHLM.prefill_varlen: has_initial_state=False but slots {held[:8]} hold "
                                 "tokens already (their K/V are cached): free them, or let the prompt continue")
            snap = None
            if snapshots is not None:  # checked before the cache grows
                if cache.state is None:
                    raise ValueError("NemotronHLM.prefill_varlen: `snapshots` needs Mamba layers; this model has none")
                if not isinstance(snapshots, SnapshotPlan):
                    raise TypeError("NemotronHLM.prefill_varlen: `snapshots` expected a SnapshotPlan (a "
                                    f"DeviceSnapshots goes with `staged`), got {type(snapshots).__name__}")
                snap = layer_snapshots(snapshots, cu, cache.conv[0].shape[-1], self.cfg.mamba, dev,
                                       "NemotronHLM.prefill_varlen")
            hidden = embed(self.backbone.embeddings, input_ids, who, "input_ids")  # before the cache moves
            ctx = cache.grow(sl, lens)  # raises before anything is touched if a slot is not allocated
            has_initial_state, kv = self._upload_inputs(cache, slots, cu_seqlens, cu, sl, ctx, lens, dev)
        batch = Batch(slots, cu_seqlens, has_initial_state, kv, rand_seed, snapshot=snap, max_seqlen=max(lens),
                      live_seqs=len(live) if live_seqs is None else live_seqs)
        # validated above, from host values: the layers' ops read nothing back; a long prompt's scans
        # take the Hopper kernel (ops/ssd_scan/hopper.py), whose launch cost hides behind the queued layers
        with trusted_inputs(), long_prefill_kernels(input_ids.shape[0]):
            logits = self._run(input_ids, lambda block, h: block.prefill(h, cache, batch),
                               rows=cu_seqlens[1:].long() - 1, hidden=hidden)
            if cache.speculate:
                cache.mark_prefilled(slots)
        return logits

    def _upload_inputs(self, cache, slots, cu_seqlens, cu, sl, ctx, lens, dev):
        """(has_initial_state [B] bool, KVBatch or None) of an eager call: the flags and, with
        attention layers, each token's position and request, ctx_lens and the attention kernel's
        work table, from the host's lists in one host-to-device copy (from pinned memory on a GPU:
        nothing waits for the device)."""
        nseq, T = len(sl), cu[-1]
        values = [int(c > 0) for c in ctx]
        if cache.kv is not None:
            block_m = self.prefill_block_tokens()
            kv_values = prefill_kv_values(ctx, lens, cu, block_m)
            values += kv_values["positions"] + kv_values["token_rows"] + kv_values["ctx"] + kv_values["work"]
        packed = torch.tensor(values, dtype=torch.int64)
        packed = packed.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else packed.to(dev)
        if cache.kv is None:
            return packed[:nseq] != 0, None
        o = nseq + 2 * T + nseq
        positions, token_rows = packed[nseq:nseq + T], packed[nseq + T:nseq + 2 * T]
        kv = KVBatch(cache.kv.block_table, cache.kv.seq_lens, slots, positions, token_rows, cu_seqlens, ctx,
                     cu_host=cu, slots_host=sl, ctx_dev=packed[nseq + 2 * T:o],
                     work=PrefillWork(packed[o:].view(-1, 2), block_m))
        return packed[:nseq] != 0, kv

    def _staged_inputs(self, staged, flags, snapshots, cache, slots, cu_seqlens, cu, sl, nseq, T):
        """(has_initial_state, KVBatch or None, snapshot function or None) of a call whose metadata
        the caller staged on the device (``StagedPrefill``), checked for shape and kind."""
        who = "NemotronHLM.prefill_varlen"
        if not isinstance(staged, StagedPrefill):
            raise TypeError(f"{who}: `staged` expected a StagedPrefill or None, got {type(staged).__name__}")
        if not (isinstance(flags, torch.Tensor) and flags.dtype == torch.bool and tuple(flags.shape) == (nseq,)):
            raise ValueError(f"{who}: with `staged`, `has_initial_state` must be a [B]=[{nseq}] bool tensor")
        snap = None
        if snapshots is not None:
            if not isinstance(snapshots, DeviceSnapshots) or cache.state is None:
                raise TypeError(f"{who}: with `staged`, `snapshots` must be a DeviceSnapshots (and the model needs "
                                f"Mamba layers), got {type(snapshots).__name__}")
            snap = device_layer_snapshots(snapshots, self.cfg.mamba, cu_seqlens.device)
        if cache.kv is None:
            return flags, None, snap
        for name, t, n in (("positions", staged.positions, T), ("token_rows", staged.token_rows, T),
                           ("ctx_lens", staged.ctx_lens, nseq)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (n,):
                raise ValueError(f"{who}: `staged.{name}` expected a tensor of shape ({n},), got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if not isinstance(staged.work, PrefillWork) or staged.work.block_m != self.prefill_block_tokens():
            raise ValueError(f"{who}: `staged.work` expected a PrefillWork for blocks of {self.prefill_block_tokens()} "
                             "query tokens (prefill_block_tokens)")
        kv = KVBatch(cache.kv.block_table, cache.kv.seq_lens, slots, staged.positions, staged.token_rows, cu_seqlens,
                     None, cu_host=cu, slots_host=sl, ctx_dev=staged.ctx_lens, work=staged.work)
        return flags, kv, snap

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, cache: HybridCache, slots: torch.Tensor, *,
               rand_seed: torch.Tensor | None = None, grow: bool = True) -> torch.Tensor:
        """One token per request [B] -> next-token logits [B, V] fp32; states and KV advance in place.

        token_ids  [B] int32/int64 in [0, V); with ``grow`` checked in the slots' one host read, and
                always met by the embedding before the cache grows (fastmamba.models.inputs): a
                bad call raises before any length, page or state moves

        slots   [B] int32/int64; -1 marks a pad row (no state touched, its K/V go to the scratch page)
        grow    True: ``cache.grow(slots, [1] * B)`` first (reads slots on the host). False: the
                caller has grown the cache already (a CUDA-graph replay: everything below reads
                static device buffers only; the positions come from ``cache.kv.seq_lens``).
        rand_seed  int64 [n_layer] device tensor or None: stochastic rounding of 16-bit SSM states
        """
        who = "NemotronHLM.decode"
        check_index_tensor(who, "token_ids", token_ids, "token ids")
        check_index_tensor(who, "slots", slots, "cache slots")
        if token_ids.dim() != 1 or tuple(slots.shape) != tuple(token_ids.shape):
            raise ValueError(f"NemotronHLM.decode: `token_ids` and `slots` expected shape (B,), got "
                             f"{tuple(token_ids.shape)} and {tuple(slots.shape)}")
        check_rand_seed(rand_seed, self.cfg.n_layer, self.lm_head.weight.device, "NemotronHLM.decode")
        hidden = None
        if grow:  # the slots' read (the cache grows on the host) checks the token ids too
            (sl,) = host_metadata(who, "token_ids", token_ids, self.cfg.vocab_size, [slots])
            hidden = embed(self.backbone.embeddings, token_ids, who, "token_ids")
            cache.grow(sl, [1] * token_ids.shape[0])
        kv = None
        if cache.kv is not None:
            positions = cache.kv.seq_lens[slots.long().clamp(min=0)].long() - 1
            kv = KVBatch(cache.kv.block_table, cache.kv.seq_lens, slots, positions)
        batch = Batch(slots, kv=kv, rand_seed=rand_seed)
        return self._run(token_ids, lambda block, h: block.decode(h, cache, batch), hidden=hidden)

    step = decode

    @torch.inference_mode()
    def verify(self, token_ids: torch.Tensor, cache: HybridCache, slots: torch.Tensor, *, path: str = "replay",
               rand_seed: torch.Tensor | None = None, grow: bool = True) -> torch.Tensor:
        """Score T tokens per request (speculative decoding): token_ids [B, T] -> logits [B, T, V] fp32.

        As ``Mamba2LM.verify`` (row b: the last emitted token, then K drafts; T = K+1, or 1 on the
        "plain" path; ``path`` picks the Mamba layers' rollback scheme; slot -1 a pad row), plus
        the attention layers: the T tokens' K/V are written at positions ctx .. ctx+T-1 of the
        request and token t attends to its first ctx + t + 1 tokens (its cache and the tokens
        before it). grow: True: ``cache.grow(slots, [T] * B)`` first (reads slots on the host);
        False: the caller grew it (a CUDA-graph replay: no host read below). ``commit`` then keeps
        the accepted tokens and drops the rest of the K/V (``rollback``).
        """
        who = "NemotronHLM.verify"
        check_index_tensor(who, "token_ids", token_ids, "token ids")
        check_index_tensor(who, "slots", slots, "cache slots")
        if not cache.speculate:
            raise ValueError("NemotronHLM.verify: the cache was built without speculation; use new_cache(..., speculate=K)")
        if path not in ("replay", "legacy", "plain"):
            raise ValueError(f'NemotronHLM.verify: `path` expected "replay", "legacy" or "plain", got {path!r}')
        ntok_expected = 1 if path == "plain" else cache.tokens_per_step
        if token_ids.dim() != 2 or token_ids.shape[1] != ntok_expected:
            raise ValueError(f"NemotronHLM.verify: `token_ids` expected shape (B, {ntok_expected}) on the {path} path, "
                             f"got {tuple(token_ids.shape)}")
        nreq, ntok = token_ids.shape
        if tuple(slots.shape) != (nreq,):
            raise ValueError(f"NemotronHLM.verify: `slots` expected shape (B,)=({nreq},), got {tuple(slots.shape)}")
        check_rand_seed(rand_seed, self.cfg.n_layer, self.lm_head.weight.device, "NemotronHLM.verify")
        hidden = None
        if grow:  # the slots' read (the cache grows on the host) checks the token ids too
            (sl_host,) = host_metadata(who, "token_ids", token_ids, self.cfg.vocab_size, [slots])
            hidden = embed(self.backbone.embeddings, token_ids.reshape(-1), who, "token_ids")
            cache.grow(sl_host, [ntok] * nreq)
        sl = slots.long()
        n_mamba = len(self.cfg.layers_of("M"))
        inter = cache.legacy_intermediate(nreq) if path == "legacy" else [None] * n_mamba
        no_dst = cache.legacy_no_dst(nreq) if path == "legacy" else None
        kv = kv_read = None
        if cache.kv is not None:
            dev = token_ids.device
            base = cache.kv.seq_lens[sl.clamp(min=0)].long() - ntok  # each request's length before this step
            positions = (base[:, None] + torch.arange(ntok, device=dev)).reshape(-1)
            token_rows = torch.arange(nreq, device=dev).repeat_interleave(ntok)
            kv = KVBatch(cache.kv.block_table, cache.kv.seq_lens, slots, positions, token_rows)
            live = (sl >= 0).repeat_interleave(ntok)
            rows = torch.where(live, torch.arange(nreq * ntok, device=dev), -1).to(torch.int32)
            table = cache.kv.block_table[sl.clamp(min=0)].repeat_interleave(ntok, dim=0)
            kv_read = KVBatch(table, (positions + 1).to(torch.int32), rows, positions)
        spec = SpecBatch(ntok, path, cache.conv_accepted[sl], inter, no_dst, kv_read)
        batch = Batch(slots, kv=kv, rand_seed=rand_seed, spec=spec)
        return self._run(token_ids.reshape(-1), lambda block, h: block.verify(h, cache, batch),
                         hidden=hidden).view(nreq, ntok, -1)

    def commit(self, cache: HybridCache, slots: torch.Tensor, accepted: torch.Tensor, *, path: str = "replay",
               rollback: bool = True) -> None:
        """After ``verify`` on ``path``: request b keeps its first ``accepted[b]`` inputs (1..T).
        The Mamba layers as ``Mamba2LM.commit``; rollback: True: the rejected tokens' K/V are
        dropped (``cache.rollback``; reads slots and accepted on the host); False: the caller
        does it (after a CUDA-graph replay of the rest)."""
        cache.commit_path(slots, accepted, path, "NemotronHLM.commit")
        if rollback:
            ntok = 1 if path == "plain" else cache.tokens_per_step
            live = [(s, ntok - a) for s, a in zip(host_list(slots), host_list(accepted)) if s != -1]
            cache.rollback([s for s, _ in live], [d for _, d in live])


# ---------------------------------------------------------------------------------------------
# loading


def load_nemotron_h(path_or_preset: str | os.PathLike, dtype: torch.dtype | None = None, device=None) -> NemotronHLM:
    """A ready-to-run ``NemotronHLM`` from a checkpoint directory (``config.json`` with
    ``model_type: nemotron_h`` and safetensors, sharded or not, in transformers' names) or a preset
    name (random weights, seed 0). dtype: default the checkpoint's (bf16 on a GPU / fp32 on a CPU
    for presets). MoE experts load from NVIDIA's per-expert tensors or transformers' fused form;
    ``cfg.eos_token_ids`` as ``NemotronHConfig.from_dir`` reads them. Checkpoint problems (missing,
    unexpected, misshaped tensors; NaN or inf weights) raise one ValueError listing them all, before
    anything is copied (``fastmamba.models.weights``: check_finite, stack_experts, load_into)."""
    device = _default_device(device)
    key = str(path_or_preset)
    if key in PRESETS:
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        return random_init(NemotronHLM(PRESETS[key], device=device, dtype=dtype)).eval()
    if not os.path.isdir(key):
        raise FileNotFoundError(f"load_nemotron_h: {key!r} is neither a directory nor a preset; presets: "
                                f"{', '.join(PRESETS)}")
    from fastmamba.models.weights import check_finite, load_into, read_checkpoint, stack_experts

    config_path = os.path.join(key, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"load_nemotron_h: no config.json in {key!r}")
    cfg = NemotronHConfig.from_dir(key)
    state_dict = read_checkpoint(key)
    check_finite(state_dict, where="load_nemotron_h")
    stack_experts(state_dict, cfg.layers_of("E"), cfg.n_routed_experts)
    if dtype is None:
        dtype = _checkpoint_dtype(state_dict)  # the embeddings' (the router is fp32 in every checkpoint)
    model = NemotronHLM(cfg, device=device, dtype=dtype)
    load_into(model, state_dict)
    return model.eval()
