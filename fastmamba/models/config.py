"""Mamba-2 language-model configuration, read from either checkpoint format's config.json.

Two formats exist in the wild:
  * state-spaces (mamba_ssm's MambaLMHeadModel): ``d_model``, ``n_layer``, ``vocab_size``,
    ``ssm_cfg`` {``layer``: "Mamba2", ``d_state``, ``d_conv``, ``expand``, ``headdim``, ``ngroups``,
    ...}, ``rms_norm``, ``residual_in_fp32``, ``pad_vocab_size_multiple``, ``tie_embeddings``;
  * Hugging Face ``Mamba2Config``: ``hidden_size``, ``num_hidden_layers``, ``num_heads``,
    ``head_dim``, ``state_size``, ``n_groups``, ``conv_kernel``, ``expand``, ``use_bias``,
    ``use_conv_bias``, ``layer_norm_epsilon``, ``tie_word_embeddings``, ``time_step_limit`` ...
Both map onto one dataclass; derived sizes are properties.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any


def _float(v: Any) -> float:
    """A float from config.json; transformers writes infinity as {"__float__": "Infinity"}."""
    if isinstance(v, dict) and "__float__" in v:
        v = v["__float__"]
    return float(v)


@dataclasses.dataclass(frozen=True)
class Mamba2Config:
    """Sizes of a Mamba-2 LM. Letters as in STYLE.md: H heads, P head dim, N state, G groups, W conv width."""

    d_model: int
    n_layer: int
    vocab_size: int  # embedding rows, already padded
    d_state: int = 128  # N
    d_conv: int = 4  # W
    expand: int = 2
    headdim: int = 64  # P
    ngroups: int = 1  # G
    chunk_size: int = 256
    norm_eps: float = 1e-5
    residual_in_fp32: bool = True
    tie_embeddings: bool = True
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj / out_proj bias
    norm_before_gate: bool = False  # Mamba-2's gated norm gates first: norm(y * silu(z))
    dt_limit: tuple[float, float] = (0.0, math.inf)

    def __post_init__(self) -> None:
        if self.d_inner % self.headdim:
            raise ValueError(f"Mamba2Config: d_inner={self.d_inner} (expand * d_model) is not a multiple of headdim={self.headdim}")
        if self.nheads % self.ngroups:
            raise ValueError(f"Mamba2Config: ngroups={self.ngroups} must divide the number of heads {self.nheads}")

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def nheads(self) -> int:  # H
        return self.d_inner // self.headdim

    @property
    def conv_dim(self) -> int:  # E = d_inner + 2 G N: the channels the conv sees (x, B, C)
        return self.d_inner + 2 * self.ngroups * self.d_state

    @property
    def d_in_proj(self) -> int:  # z, xBC, dt
        return self.d_inner + self.conv_dim + self.nheads

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "Mamba2Config":
        """Read a state-spaces or Hugging Face ``config.json`` dict."""
        if "d_model" in cfg:  # state-spaces
            ssm = dict(cfg.get("ssm_cfg") or {})
            layer = ssm.pop("layer", "Mamba2")
            if layer != "Mamba2":
                raise ValueError(f"Mamba2Config: ssm_cfg.layer is {layer!r}; only 'Mamba2' checkpoints are supported")
            if cfg.get("attn_layer_idx"):
                raise ValueError("Mamba2Config: hybrid checkpoints with attention layers (attn_layer_idx) are not supported")
            if not cfg.get("rms_norm", True):
                raise ValueError("Mamba2Config: rms_norm=False (LayerNorm blocks) is not supported")
            multiple = int(cfg.get("pad_vocab_size_multiple", 8))
            vocab = int(cfg["vocab_size"])
            vocab += (-vocab) % multiple
            d_model = int(cfg["d_model"])
            return cls(
                d_model=d_model, n_layer=int(cfg["n_layer"]), vocab_size=vocab,
                d_state=int(ssm.get("d_state", 128)), d_conv=int(ssm.get("d_conv", 4)),
                expand=int(ssm.get("expand", 2)), headdim=int(ssm.get("headdim", 64)),
                ngroups=int(ssm.get("ngroups", 1)), chunk_size=int(ssm.get("chunk_size", 256)),
                norm_eps=float(cfg.get("norm_epsilon", 1e-5)),
                residual_in_fp32=bool(cfg.get("residual_in_fp32", True)),
                tie_embeddings=bool(cfg.get("tie_embeddings", True)),
                conv_bias=bool(ssm.get("conv_bias", True)), proj_bias=bool(ssm.get("bias", False)),
                norm_before_gate=bool(ssm.get("norm_before_gate", False)),
                dt_limit=tuple(_float(v) for v in ssm.get("dt_limit", (0.0, math.inf))),
            )
        if "hidden_size" in cfg:  # Hugging Face Mamba2Config
            d_model = int(cfg["hidden_size"])
            expand = int(cfg.get("expand", 2))
            headdim = int(cfg.get("head_dim", 64))
            out = cls(
                d_model=d_model, n_layer=int(cfg["num_hidden_layers"]), vocab_size=int(cfg["vocab_size"]),
                d_state=int(cfg.get("state_size", 128)), d_conv=int(cfg.get("conv_kernel", 4)),
                expand=expand, headdim=headdim, ngroups=int(cfg.get("n_groups", 1)),
                chunk_size=int(cfg.get("chunk_size", 256)), norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
                residual_in_fp32=bool(cfg.get("residual_in_fp32", True)),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                conv_bias=bool(cfg.get("use_conv_bias", True)), proj_bias=bool(cfg.get("use_bias", False)),
                norm_before_gate=False,
                dt_limit=tuple(_float(v) for v in cfg.get("time_step_limit", (0.0, math.inf))),
            )
            if "num_heads" in cfg and int(cfg["num_heads"]) != out.nheads:
                raise ValueError(
                    f"Mamba2Config: num_heads={cfg['num_heads']} but expand * hidden_size / head_dim = {out.nheads}"
                )
            return out
        raise ValueError("Mamba2Config: config.json has neither 'd_model' (state-spaces) nor 'hidden_size' (Hugging Face)")

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Mamba2Config":
        with open(path) as f:
            return cls.from_dict(json.load(f))


# Public mamba2-* shapes (state-spaces configs); vocab 50277 padded to a multiple of 16.
PRESETS: dict[str, Mamba2Config] = {
    "mamba2-tiny": Mamba2Config(d_model=64, n_layer=2, vocab_size=256, d_state=16, headdim=16, ngroups=1, chunk_size=16),
    "mamba2-130m": Mamba2Config(d_model=768, n_layer=24, vocab_size=50288),
    "mamba2-370m": Mamba2Config(d_model=1024, n_layer=48, vocab_size=50288),
    "mamba2-780m": Mamba2Config(d_model=1536, n_layer=48, vocab_size=50288),
    "mamba2-1.3b": Mamba2Config(d_model=2048, n_layer=48, vocab_size=50288),
    "mamba2-2.7b": Mamba2Config(d_model=2560, n_layer=64, vocab_size=50288),
}
