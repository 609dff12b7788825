"""Mamba-2 language model for inference: embeddings -> N x (RMSNorm -> mixer -> residual) -> norm -> lm_head.

Module names follow Hugging Face's ``Mamba2ForCausalLM`` (``backbone.embeddings``,
``backbone.layers.{i}.norm|mixer``, ``backbone.norm_f``, ``lm_head``).
"""
from __future__ import annotations

import torch
from torch import nn

from fastmamba.cache.state_cache import StateCache
from fastmamba.layers.mamba2 import DecodeTricks, Mamba2Mixer
from fastmamba.models.config import Mamba2Config
from fastmamba.ops import add_rmsnorm


class RMSNorm(nn.Module):
    """RMSNorm weights of a block boundary; the LM applies them with the fused ``add_rmsnorm``."""

    def __init__(self, d: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d, device=device, dtype=dtype))


class Mamba2Block(nn.Module):
    """norm + mixer; the residual add lives in the next boundary's fused add + RMSNorm."""

    def __init__(self, cfg: Mamba2Config, device=None, dtype=None):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, device=device, dtype=dtype)
        self.mixer = Mamba2Mixer(cfg, device=device, dtype=dtype)


class Mamba2Backbone(nn.Module):
    def __init__(self, cfg: Mamba2Config, device=None, dtype=None):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList(Mamba2Block(cfg, device=device, dtype=dtype) for _ in range(cfg.n_layer))
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps, device=device, dtype=dtype)


class Mamba2LM(nn.Module):
    """``forward(input_ids [B, L]) -> logits [B, L, V]`` (fp32); ``prefill`` / ``decode`` with a StateCache."""

    def __init__(self, cfg: Mamba2Config, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.backbone = Mamba2Backbone(cfg, device=device, dtype=dtype)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, device=device, dtype=dtype)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def _run(self, input_ids: torch.Tensor, mix, *, last_only: bool = False) -> torch.Tensor:
        """Embeddings -> blocks -> final norm -> fp32 logits (of the last position only, if asked);
        ``mix(i, mixer, normed)`` runs layer i's mixer.

        Each block boundary is one fused kernel: residual += previous output, then RMSNorm.
        """
        rdtype = torch.float32 if self.cfg.residual_in_fp32 else self.dtype
        out, residual = self.backbone.embeddings(input_ids), None
        for i, layer in enumerate(self.backbone.layers):
            normed, residual = add_rmsnorm(out, residual, layer.norm.weight, layer.norm.eps, residual_dtype=rdtype)
            out = mix(i, layer.mixer, normed)
        if last_only:
            out, residual = out[:, -1], residual[:, -1]
        norm_f = self.backbone.norm_f
        normed, _ = add_rmsnorm(out, residual, norm_f.weight, norm_f.eps, residual_dtype=rdtype)
        return self.lm_head(normed).float()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._run(input_ids, lambda i, mixer, h: mixer(h))

    def set_decode_tricks(self, **switches: bool) -> None:
        """Turn the mixers' decode optimisations on or off (see ``DecodeTricks``); for ablations."""
        for layer in self.backbone.layers:
            layer.mixer.tricks = DecodeTricks(**switches)

    def new_cache(self, num_slots: int, *, ssm_dtype: torch.dtype = torch.float32) -> StateCache:
        return StateCache(self.cfg, num_slots, device=self.lm_head.weight.device, conv_dtype=self.dtype,
                          ssm_dtype=ssm_dtype)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, cache: StateCache, slots: torch.Tensor) -> torch.Tensor:
        """Run prompts of equal length [B, L] from their slots' states; returns the last logits [B, V]."""
        return self._run(input_ids, lambda i, mixer, h: mixer(h, cache.conv[i], cache.ssm[i], slots), last_only=True)

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, cache: StateCache, slots: torch.Tensor) -> torch.Tensor:
        """One token per request [B] -> next-token logits [B, V]; the slots' states advance in place."""
        return self._run(token_ids, lambda i, mixer, h: mixer.step(h, cache.conv[i], cache.ssm[i], slots))
