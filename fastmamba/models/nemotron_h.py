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

The model is ``fastmamba.models.lm.HybridLM`` over the config's pattern (``NemotronHLM`` by its
old name): ``forward(ids [B, L])`` full logits, ``prefill_varlen(ids, cu_seqlens, cache, slots)``
last-token logits, ``decode`` / ``step`` one token per request, ``new_cache(max_batch, ...)`` a
``HybridCache`` (Mamba slots + paged KV). This file holds the config, its reading, the presets and
the loading of a checkpoint.

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
from typing import Any

import torch

from fastmamba.layers.attention import StagedPrefill  # re-exported: its old home
from fastmamba.ops.attention import prefill_kv_values  # re-exported: its old home (the op's host metadata)
from fastmamba.layers.mamba2 import MambaLayerConfig
from fastmamba.layers.moe import MoEConfig
from fastmamba.models.checkpoint_config import (_as_float, _Fields, agreed_pattern, checkpoint_eos_token_ids,
                                                ssm_cache_dtype_of)
from fastmamba.models.defaults import checkpoint_dtype, default_device, random_init  # random_init: re-exported for the presets
from fastmamba.models.lm import HybridLM
from fastmamba.models.mtp import build_mtp, mtp_pattern_of, prepare_mtp_state_dict

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
class NemotronHConfig:
    """Sizes of a Nemotron-H / Nemotron-3 LM; each field says which config.json key it comes from."""

    paged_cache = True  # (not a field) its LM's cache: per-slot lengths and the attention layers' K/V pages

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
    mtp_pattern: str = ""                            # the MTP layer's kinds (num_nextn_predict_layers: 1 and
                                                     # mtp_hybrid_override_pattern): fastmamba.models.mtp; "": none
    mtp_absent: bool = False                         # config.json names an MTP layer, the checkpoint has no mtp.*
    ssm_cache_dtype: str | None = None               # mamba_ssm_cache_dtype as "fp32" / "bf16" / "fp16" (None: absent)

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
            d_model=self.d_model, d_inner=self.mamba_nheads * self.mamba_headdim,
            n_layer=max(1, len(self.layers_of("M"))), d_state=self.d_state, d_conv=self.d_conv,
            headdim=self.mamba_headdim, ngroups=self.n_groups, chunk_size=self.chunk_size, norm_eps=self.norm_eps,
            conv_bias=self.conv_bias, proj_bias=self.mamba_proj_bias, norm_before_gate=False,
            dt_limit=tuple(self.dt_limit),
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
            mtp_pattern=mtp_pattern_of(cfg),
            ssm_cache_dtype=ssm_cache_dtype_of(cfg),
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "NemotronHConfig":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "NemotronHConfig":
        """A checkpoint directory's config.json, with ``eos_token_ids`` read by the rule every model
        family shares (``fastmamba.models.checkpoint_config.checkpoint_eos_token_ids``: generation_config.json's
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
    pattern = agreed_pattern(cfg, "hybrid_override_pattern", ("layers_block_type", "layer_types"), _BLOCK_TYPE_TO_CHAR)
    if pattern is None:
        raise ValueError("NemotronHConfig: config.json has no layer pattern (`hybrid_override_pattern`, "
                         "`layers_block_type` or `layer_types`)")
    return pattern


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
_NEMOTRON_3_SUPER_PATTERN = "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME"
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
    # Nemotron-3 Super 120B-A12B as released (config.json of nvidia/NVIDIA-Nemotron-3-Super-120B-A12B: 88
    # layers, 40 M, 40 E, 8 *; LatentMoE; one MTP layer "*E"); random weights: 240 GB in bf16 fit no GPU, so
    # it runs as `load_model("nemotron-3-super", quantization="fp8")` (built block by block, ~125 GB: one H200)
    "nemotron-3-super": NemotronHConfig(
        d_model=4096, vocab_size=131072, pattern=_NEMOTRON_3_SUPER_PATTERN, n_heads=32, n_kv_heads=2, head_dim=128,
        intermediate_size=2688, mamba_nheads=128, mamba_headdim=64, n_groups=8, d_state=128, d_conv=4,
        chunk_size=128, n_routed_experts=512, num_experts_per_tok=22, moe_intermediate_size=2688,
        moe_shared_expert_intermediate_size=5376, moe_latent_size=1024, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=5.0, mtp_pattern="*E",
    ),
    # MTP: the tiny MoE hybrid plus one MTP layer ("*E"), for tests; Nano's layers plus one MTP layer of
    # attention + MoE (the Nano 3.5 Lightning shape: num_nextn_predict_layers 1, mtp_hybrid_override_pattern
    # "*E"), random weights, for the MTP benchmark (fastmamba.bench.mtp)
    "nemotron-3-tiny-mtp": NemotronHConfig(
        d_model=64, vocab_size=256, pattern="M*EM-E", n_heads=4, n_kv_heads=2, head_dim=16,
        intermediate_size=96, mamba_nheads=8, mamba_headdim=16, n_groups=2, d_state=16, chunk_size=16,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=64,
        routed_scaling_factor=2.5, mtp_pattern="*E",
    ),
    "nemotron-3-nano-mtp": NemotronHConfig(
        d_model=2688, vocab_size=131072, pattern=_NEMOTRON_3_NANO_PATTERN, n_heads=32, n_kv_heads=2, head_dim=128,
        intermediate_size=1856, mamba_nheads=64, mamba_headdim=64, n_groups=8, d_state=128, d_conv=4,
        chunk_size=128, n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, mtp_pattern="*E",
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
# the model: ``fastmamba.models.lm.HybridLM`` over this config's pattern


class NemotronHLM(HybridLM):
    """``HybridLM`` of a ``NemotronHConfig`` (the name this model had before the one LM; see
    ``fastmamba.models.lm``), with its MTP layer when the config names one (``self.mtp``)."""

    def __init__(self, cfg: NemotronHConfig, device=None, dtype=None):
        super().__init__(cfg, device=device, dtype=dtype)
        self.mtp = build_mtp(cfg, device=device, dtype=dtype)  # None without an MTP layer


# ---------------------------------------------------------------------------------------------
# loading


def load_nemotron_h(path_or_preset: str | os.PathLike, dtype: torch.dtype | None = None, device=None, *,
                    quantization: str | None = None) -> NemotronHLM:
    """A ready-to-run ``NemotronHLM`` from a checkpoint directory (``config.json`` with
    ``model_type: nemotron_h`` and safetensors, sharded or not, in transformers' names) or a preset
    name (random weights, seed 0). dtype: default the checkpoint's (bf16 on a GPU / fp32 on a CPU
    for presets). MoE experts load from NVIDIA's per-expert tensors or transformers' fused form;
    ``cfg.eos_token_ids`` as ``NemotronHConfig.from_dir`` reads them. Checkpoint problems (missing,
    unexpected, misshaped tensors; NaN or inf weights) raise one ValueError listing them all, before
    anything is copied (``fastmamba.models.weights``: check_finite, stack_experts, load_into)."""
    from fastmamba.models.building import build_planned, random_preset
    from fastmamba.models.quantization import check_quantization_arg, prepare_fp8_checkpoint, quantize_model

    device = default_device(device)
    key = str(path_or_preset)
    if key in PRESETS:
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        return random_preset(key, lambda dev: NemotronHLM(PRESETS[key], device=dev, dtype=dtype), device, dtype,
                             quantized=bool(check_quantization_arg(quantization)), where="load_nemotron_h")
    if not os.path.isdir(key):
        raise FileNotFoundError(f"load_nemotron_h: {key!r} is neither a directory nor a preset; presets: "
                                f"{', '.join(PRESETS)}")
    from fastmamba.models.weights import check_finite, load_into, read_checkpoint, stack_experts

    config_path = os.path.join(key, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"load_nemotron_h: no config.json in {key!r}")
    cfg = NemotronHConfig.from_dir(key)
    check_quantization_arg(quantization, "load_nemotron_h")
    state_dict = read_checkpoint(key)
    fp8_plan = prepare_fp8_checkpoint(key, state_dict, cfg)  # None unless the checkpoint is FP8 (models.quantization)
    check_finite(state_dict, where="load_nemotron_h")
    stack_experts(state_dict, cfg.layers_of("E"), cfg.n_routed_experts)
    cfg = prepare_mtp_state_dict(state_dict, cfg)  # mtp.* tensors (fastmamba.models.mtp); none: no MTP layer
    if dtype is None:
        dtype = checkpoint_dtype(state_dict)  # the embeddings' (the router is fp32 in every checkpoint)
    if fp8_plan is None:
        model = NemotronHLM(cfg, device=device, dtype=dtype)
    else:  # FP8 modules where the checkpoint stores FP8, block by block (no whole 16-bit model)
        model = build_planned(lambda dev: NemotronHLM(cfg, device=dev, dtype=dtype), fp8_plan, device)
    load_into(model, state_dict)
    return (quantize_model(model) if quantization and fp8_plan is None else model).eval()
