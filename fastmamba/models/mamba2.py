"""Mamba-2 language models: the config, read from either checkpoint format's config.json, and the presets.

Two formats exist in the wild:
  * state-spaces (mamba_ssm's MambaLMHeadModel): ``d_model``, ``n_layer``, ``vocab_size``,
    ``ssm_cfg`` {``layer``: "Mamba2", ``d_state``, ``d_conv``, ``expand``, ``headdim``, ``ngroups``,
    ...}, ``rms_norm``, ``residual_in_fp32``, ``pad_vocab_size_multiple``, ``tie_embeddings``;
  * Hugging Face ``Mamba2Config``: ``hidden_size``, ``num_hidden_layers``, ``num_heads``,
    ``head_dim``, ``state_size``, ``n_groups``, ``conv_kernel``, ``expand``, ``use_bias``,
    ``use_conv_bias``, ``layer_norm_epsilon``, ``tie_word_embeddings``, ``time_step_limit`` ...
Both map onto one dataclass; derived sizes are properties.

Every field read from a file is checked: present where required, of its JSON type (integers are
JSON integers, booleans are ``true`` / ``false``, not strings), in range (sizes >= 1, epsilon > 0),
and the sizes consistent (heads divide, groups divide heads). A bad file raises ``ValueError``
naming the file and the field, e.g.
``Mamba2Config: ckpt/config.json: 'head_dim' expected an integer >= 1, got 0``.

End of sequence: ``eos_token_ids`` holds the checkpoint's ``eos_token_id`` (an int or a list of
ints in config.json, overridden by generation_config.json's when that file sets it; ``from_dir``
reads both, and falls back to the tokenizer files' ``eos_token``); empty when the checkpoint names none.
``checkpoint_eos_token_ids`` is that rule, shared with ``NemotronHConfig.from_dir``.
``max_position_embeddings``: config.json's, or None when absent (the server sizes its K/V from it).
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from fastmamba.layers.mamba2 import MambaLayerConfig, MambaSizes
from fastmamba.models.checkpoint_config import _check_eos, _describe, _Fields, _read_json, checkpoint_eos_token_ids


@dataclasses.dataclass(frozen=True)
class Mamba2Config(MambaSizes):
    """Sizes of a Mamba-2 LM. Letters as in STYLE.md: H heads, P head dim, N state, G groups, W conv width."""

    paged_cache = False  # (not a field) its LM's cache: Mamba slot pools only, no per-slot lengths

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
    eos_token_ids: tuple[int, ...] = ()  # end-of-sequence token ids; () when the checkpoint names none
    max_position_embeddings: int | None = None  # the checkpoint's context length, if it names one

    def __post_init__(self) -> None:
        sizes = ("d_model", "n_layer", "vocab_size", "d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size")
        for f in sizes:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Mamba2Config: {f} expected an integer >= 1, got {_describe(v)}")
        for f in ("residual_in_fp32", "tie_embeddings", "conv_bias", "proj_bias", "norm_before_gate"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"Mamba2Config: {f} expected a bool, got {_describe(getattr(self, f))}")
        eps = self.norm_eps
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < math.inf:
            raise ValueError(f"Mamba2Config: norm_eps expected a finite number > 0, got {_describe(self.norm_eps)}")
        ids = self.eos_token_ids
        if not isinstance(ids, tuple) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"Mamba2Config: eos_token_ids expected a tuple of ints, got {_describe(ids)}")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"Mamba2Config: eos_token_ids {bad} are outside the vocabulary [0, {self.vocab_size})")
        mpe = self.max_position_embeddings
        if mpe is not None and (isinstance(mpe, bool) or not isinstance(mpe, int) or mpe < 1):
            raise ValueError(f"Mamba2Config: max_position_embeddings expected an integer >= 1 or None, "
                             f"got {_describe(mpe)}")
        if self.d_inner % self.headdim:
            raise ValueError(f"Mamba2Config: d_inner={self.d_inner} (expand * d_model) is not a multiple of headdim={self.headdim}")
        if self.nheads % self.ngroups:
            raise ValueError(f"Mamba2Config: ngroups={self.ngroups} must divide the number of heads {self.nheads}")

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def pattern(self) -> str:
        """The layer pattern of ``fastmamba.models.lm.HybridLM``: a Mamba-2 LM is n_layer x 'M'."""
        return "M" * self.n_layer

    def layers_of(self, kind: str) -> list[int]:
        """Indices of the layers of one kind ("M": every layer)."""
        return [i for i, c in enumerate(self.pattern) if c == kind]

    @property
    def mamba(self) -> MambaLayerConfig:
        """What each ``Mamba2Mixer`` and the cache's pools read (sizes as this config gives them:
        a tensor-parallel rank's config gives its own ``d_inner`` and ``ngroups``)."""
        return MambaLayerConfig(
            d_model=self.d_model, d_inner=self.d_inner, n_layer=self.n_layer, d_state=self.d_state,
            d_conv=self.d_conv, headdim=self.headdim, ngroups=self.ngroups, chunk_size=self.chunk_size,
            norm_eps=self.norm_eps, conv_bias=self.conv_bias, proj_bias=self.proj_bias,
            norm_before_gate=self.norm_before_gate, dt_limit=tuple(self.dt_limit),
        )

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], *, source: str = "config.json") -> "Mamba2Config":
        """Read a state-spaces or Hugging Face ``config.json`` dict.

        source  how errors name the dict (the file's path when it came from one)
        Raises ValueError naming ``source`` and the field for a missing required field, a value of the
        wrong JSON type or out of range, inconsistent sizes, or an unsupported architecture.
        """
        c = _Fields(cfg, source)
        if c.has("d_model"):
            return cls._from_state_spaces(c)
        if c.has("hidden_size"):
            return cls._from_hugging_face(c)
        raise ValueError(
            f"Mamba2Config: {source} has neither 'd_model' (state-spaces) nor 'hidden_size' (Hugging Face)"
        )

    @classmethod
    def _from_state_spaces(cls, c: _Fields) -> "Mamba2Config":
        src = c.source
        ssm = _Fields(c.raw("ssm_cfg", {}), src, "ssm_cfg.")
        layer = ssm.raw("layer", None)
        if layer != "Mamba2":
            got = "missing (mamba_ssm then builds 'Mamba1')" if layer is None else f"{layer!r}"
            raise ValueError(f"Mamba2Config: {src}: 'ssm_cfg.layer' is {got}; only 'Mamba2' checkpoints are supported")
        if c.raw("attn_layer_idx", None):
            raise ValueError(f"Mamba2Config: {src}: hybrid checkpoints with attention layers "
                             "('attn_layer_idx') are not supported")
        if c.int("d_intermediate", 0, minimum=0):
            raise ValueError(f"Mamba2Config: {src}: 'd_intermediate' > 0 (MLP blocks) is not supported")
        if not c.bool("rms_norm", True):
            raise ValueError(f"Mamba2Config: {src}: 'rms_norm' false (LayerNorm blocks) is not supported")
        if not ssm.bool("rmsnorm", True):
            raise ValueError(f"Mamba2Config: {src}: 'ssm_cfg.rmsnorm' false (no gated norm) is not supported")
        if ssm.bool("D_has_hdim", False):
            raise ValueError(f"Mamba2Config: {src}: 'ssm_cfg.D_has_hdim' true (D per channel) is not supported")
        d_model = c.int("d_model")
        expand = ssm.int("expand", 2)
        headdim = ssm.int("headdim", 64)
        ngroups = ssm.int("ngroups", 1)
        d_ssm = ssm.raw("d_ssm", None)
        if d_ssm is not None and d_ssm != expand * d_model:
            raise ValueError(f"Mamba2Config: {src}: 'ssm_cfg.d_ssm'={d_ssm!r} differs from expand * d_model = "
                             f"{expand * d_model}; only the full-width SSM is supported")
        _check_heads(src, expand * d_model, "'ssm_cfg.expand' * 'd_model'", headdim, "'ssm_cfg.headdim'",
                     ngroups, "'ssm_cfg.ngroups'")
        multiple = c.int("pad_vocab_size_multiple", 8)
        vocab = c.int("vocab_size")
        vocab += (-vocab) % multiple
        return cls._build(
            c, "vocab_size (padded to 'pad_vocab_size_multiple')",
            d_model=d_model, n_layer=c.int("n_layer"), vocab_size=vocab,
            d_state=ssm.int("d_state", 128), d_conv=ssm.int("d_conv", 4),
            expand=expand, headdim=headdim, ngroups=ngroups, chunk_size=ssm.int("chunk_size", 256),
            norm_eps=c.float("norm_epsilon", 1e-5, positive=True),
            residual_in_fp32=c.bool("residual_in_fp32", True),
            tie_embeddings=c.bool("tie_embeddings", True),
            conv_bias=ssm.bool("conv_bias", True), proj_bias=ssm.bool("bias", False),
            norm_before_gate=ssm.bool("norm_before_gate", False),
            dt_limit=ssm.float_pair("dt_limit", (0.0, math.inf)),
        )

    @classmethod
    def _from_hugging_face(cls, c: _Fields) -> "Mamba2Config":
        src = c.source
        model_type = c.raw("model_type", "mamba2")
        if model_type != "mamba2":
            raise ValueError(f"Mamba2Config: {src}: 'model_type' is {model_type!r}; only 'mamba2' checkpoints "
                             "are supported")
        act = c.raw("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"Mamba2Config: {src}: 'hidden_act' is {act!r}; Mamba-2 layers use 'silu'")
        d_model = c.int("hidden_size")
        expand = c.int("expand", 2)
        headdim = c.int("head_dim", 64)
        ngroups = c.int("n_groups", 1)
        nheads = _check_heads(src, expand * d_model, "'expand' * 'hidden_size'", headdim, "'head_dim'",
                              ngroups, "'n_groups'")
        if c.has("num_heads") and c.int("num_heads") != nheads:
            raise ValueError(
                f"Mamba2Config: {src}: num_heads={c.raw('num_heads')} but expand * hidden_size / head_dim = {nheads}"
            )
        return cls._build(
            c, "vocab_size",
            d_model=d_model, n_layer=c.int("num_hidden_layers"), vocab_size=c.int("vocab_size"),
            d_state=c.int("state_size", 128), d_conv=c.int("conv_kernel", 4),
            expand=expand, headdim=headdim, ngroups=ngroups,
            chunk_size=c.int("chunk_size", 256), norm_eps=c.float("layer_norm_epsilon", 1e-5, positive=True),
            residual_in_fp32=c.bool("residual_in_fp32", True),
            tie_embeddings=c.bool("tie_word_embeddings", False),
            conv_bias=c.bool("use_conv_bias", True), proj_bias=c.bool("use_bias", False),
            norm_before_gate=False,
            dt_limit=c.float_pair("time_step_limit", (0.0, math.inf)),
        )

    @classmethod
    def _build(cls, c: _Fields, vocab_name: str, **fields: Any) -> "Mamba2Config":
        eos = c.eos("eos_token_id") or ()
        _check_eos(c.source, "eos_token_id", eos, fields["vocab_size"], vocab_name)
        return cls(eos_token_ids=eos, max_position_embeddings=c.opt_int("max_position_embeddings"), **fields)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Mamba2Config":
        """Read one ``config.json`` (see ``from_dict``); ValueError naming the file when it is not JSON."""
        return cls.from_dict(_read_json(path), source=os.fspath(path))

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Mamba2Config":
        """Read a checkpoint directory's ``config.json`` and its end-of-sequence ids.

        ``eos_token_ids``, first found wins: generation_config.json's ``eos_token_id`` (int, list, or
        null for none), config.json's, else the ``eos_token`` that tokenizer_config.json or
        special_tokens_map.json name, looked up in tokenizer.json (state-spaces checkpoints carry no
        ``eos_token_id``; their GPT-NeoX tokenizer files name ``<|endoftext|>``).

        Raises FileNotFoundError naming the path when the directory or its config.json is missing,
        ValueError (see ``from_dict``) naming the file and field for a bad file.
        """
        root = os.fspath(path)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"Mamba2Config: checkpoint directory {root!r} does not exist")
        config_path = os.path.join(root, "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"Mamba2Config: no config.json in {root!r}")
        cfg = cls.from_file(config_path)
        eos = checkpoint_eos_token_ids(root, cfg.eos_token_ids, cfg.vocab_size)
        return cfg if eos == cfg.eos_token_ids else dataclasses.replace(cfg, eos_token_ids=eos)


def _check_heads(src: str, d_inner: int, inner_name: str, headdim: int, headdim_name: str,
                 ngroups: int, groups_name: str) -> int:
    """The head count H = d_inner / P, after checking that P divides d_inner and G divides H."""
    if d_inner % headdim:
        raise ValueError(f"Mamba2Config: {src}: {inner_name} = {d_inner} is not a multiple of "
                         f"{headdim_name} = {headdim}")
    nheads = d_inner // headdim
    if nheads % ngroups:
        raise ValueError(f"Mamba2Config: {src}: {groups_name} = {ngroups} does not divide the number of heads "
                         f"{nheads} ({inner_name} / {headdim_name})")
    return nheads


PRESETS: dict[str, Mamba2Config] = {
    "mamba2-tiny": Mamba2Config(d_model=64, n_layer=2, vocab_size=256, d_state=16, headdim=16, ngroups=1, chunk_size=16),
    "mamba2-130m": Mamba2Config(d_model=768, n_layer=24, vocab_size=50288),
    "mamba2-370m": Mamba2Config(d_model=1024, n_layer=48, vocab_size=50288),
    "mamba2-780m": Mamba2Config(d_model=1536, n_layer=48, vocab_size=50288),
    "mamba2-1.3b": Mamba2Config(d_model=2048, n_layer=48, vocab_size=50288),
    "mamba2-2.7b": Mamba2Config(d_model=2560, n_layer=64, vocab_size=50288),
}
