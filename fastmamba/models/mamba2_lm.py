"""Mamba-2 language model for inference: embeddings -> N x (RMSNorm -> mixer -> residual) -> norm -> lm_head.

Module names follow Hugging Face's ``Mamba2ForCausalLM`` (``backbone.embeddings``,
``backbone.layers.{i}.norm|mixer``, ``backbone.norm_f``, ``lm_head``).
"""
from __future__ import annotations

import torch
from torch import nn

from fastmamba.cache.state_cache import StateCache
from fastmamba.layers.mamba2 import Mamba2Mixer
from fastmamba.models.config import Mamba2Config
from fastmamba.ops import rmsnorm_fn


class RMSNorm(nn.Module):
    """Plain RMSNorm (one group, no gate), through the gated-norm kernel's z=None path."""

    def __init__(self, d: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm_fn(x.to(self.weight.dtype), self.weight, None, eps=self.eps)


class Mamba2Block(nn.Module):
    def __init__(self, cfg: Mamba2Config, device=None, dtype=None):
        super().__init__()
        self.residual_in_fp32 = cfg.residual_in_fp32
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, device=device, dtype=dtype)
        self.mixer = Mamba2Mixer(cfg, device=device, dtype=dtype)

    def _residual(self, h: torch.Tensor) -> torch.Tensor:
        return h.float() if self.residual_in_fp32 else h

    def forward(self, h, conv_state=None, ssm_state=None, slots=None):
        return self._residual(h) + self.mixer(self.norm(h), conv_state, ssm_state, slots)

    def step(self, h, conv_state, ssm_state, slots):
        return self._residual(h) + self.mixer.step(self.norm(h), conv_state, ssm_state, slots)


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

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.backbone.norm_f(h).to(self.dtype)).float()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.backbone.embeddings(input_ids)
        for layer in self.backbone.layers:
            h = layer(h)
        return self._logits(h)

    def new_cache(self, num_slots: int, *, ssm_dtype: torch.dtype = torch.float32) -> StateCache:
        return StateCache(self.cfg, num_slots, device=self.lm_head.weight.device, conv_dtype=self.dtype,
                          ssm_dtype=ssm_dtype)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, cache: StateCache, slots: torch.Tensor) -> torch.Tensor:
        """Run prompts of equal length [B, L] from their slots' states; returns the last logits [B, V]."""
        h = self.backbone.embeddings(input_ids)
        for i, layer in enumerate(self.backbone.layers):
            h = layer(h, cache.conv[i], cache.ssm[i], slots)
        return self._logits(h[:, -1])

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, cache: StateCache, slots: torch.Tensor) -> torch.Tensor:
        """One token per request [B] -> next-token logits [B, V]; the slots' states advance in place."""
        h = self.backbone.embeddings(token_ids)
        for i, layer in enumerate(self.backbone.layers):
            h = layer.step(h, cache.conv[i], cache.ssm[i], slots)
        return self._logits(h)
