"""Mamba-2 language model: ``fastmamba.models.lm.HybridLM`` over the pattern of n_layer x M.

Module names follow Hugging Face's ``Mamba2ForCausalLM`` (``backbone.embeddings``,
``backbone.layers.{i}.norm|mixer``, ``backbone.norm_f``, ``lm_head``); the config and its two
config.json formats are ``fastmamba.models.mamba2.Mamba2Config``. Its cache (``new_cache``) is the
Mamba slot pools alone (``StateCache``: no per-slot lengths, no attention part).

``Mamba2LM`` is the name this model had before the one LM: a ``HybridLM`` built from a
``Mamba2Config``, with every method of it (``forward``, ``prefill`` / ``prefill_varlen``, ``decode``
/ ``step``, ``verify`` / ``commit``, ``set_decode_tricks``, ``new_cache``).
"""
from __future__ import annotations

from fastmamba.models.blocks import RMSNorm
from fastmamba.models.mamba2 import Mamba2Config
from fastmamba.models.lm import HybridLM

__all__ = ["Mamba2LM", "RMSNorm"]


class Mamba2LM(HybridLM):
    """``HybridLM`` of a ``Mamba2Config`` (every layer a Mamba-2 block)."""

    def __init__(self, cfg: Mamba2Config, device=None, dtype=None):
        super().__init__(cfg, device=device, dtype=dtype)
