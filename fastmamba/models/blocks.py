"""Blocks of a hybrid model: norm + mixer + residual, whatever the mixer's kind.

A pattern string picks the kinds, one character per layer (Nemotron-H's ``hybrid_override_pattern``):

    M  Mamba-2 mixer     fastmamba.layers.mamba2.Mamba2Mixer   its conv / SSM rows in HybridCache.conv / .ssm
    *  attention (GQA)   fastmamba.layers.attention.Attention  its K / V pages in HybridCache.kv.k / .v
    -  MLP (relu2)       fastmamba.layers.mlp.MLP              no per-request state
    E  MoE (relu2)       fastmamba.layers.moe.MoE              no per-request state

Every block has the same three entries, so the model's loop never asks a block its kind:

    forward(h)                  [B, L, M] -> [B, L, M]   no cache (full logits)
    prefill(h, cache, batch, norm_sumsq=None)  [T, M] -> [T, M]   packed prompts (``Batch.cu_seqlens``)
    decode(h, cache, batch)     [B, M] -> [B, M]         one token per request
    verify(h, cache, batch)     [B*T, M] -> [B*T, M]     T tokens per request (speculative decoding)

``h`` is the block's normed input; the residual add and the next norm are one fused
``add_rmsnorm`` in the model. A block that ``defers_norm(tokens)`` in a prefill gets ``norm_sumsq``
and leaves its output's last norm to that kernel (the Mamba mixer's gated norm). A block finds its slice of the cache by ``cache_index``, its ordinal
among the blocks of its kind. A new kind is a layer file, a Block subclass here and one entry in
``BLOCK_KINDS``.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import nn

from fastmamba.layers.attention import Attention, KVBatch
from fastmamba.layers.mamba2 import Mamba2Mixer
from fastmamba.layers.mlp import MLP
from fastmamba.layers.moe import MoE


class RMSNorm(nn.Module):
    """A block's input-norm weights; the model applies them with the fused ``add_rmsnorm``."""

    def __init__(self, d: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d, device=device, dtype=dtype))


class Batch(NamedTuple):
    """What one prefill or decode call tells every block (built once per call by the model).

    slots              [B] int32/int64: each request's cache slot; -1 marks a pad request
    cu_seqlens         [B+1] (prefill) or None (decode: one token per request)
    has_initial_state  [B] bool (prefill): request b continues from its slot's states
    kv                 KVBatch or None (a model without attention)
    rand_seed          int64 [n >= Mamba layers] device tensor or None: stochastic rounding of
                       16-bit SSM states; the j-th Mamba layer rounds with element j
    snapshot           (prefill) None, or j -> the j-th Mamba layer's ``LayerSnapshot`` (prefix
                       caching: states copied out at chunk ends while the prompts run)
    max_seqlen, live_seqs  (prefill) the longest prompt and the count of prompts that are not
                       padding, from the host's values, or None: the Mamba scan's path and tiles
                       (a graph's warm-up and capture then pick the same kernels)
    """

    slots: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    has_initial_state: torch.Tensor | None = None
    kv: KVBatch | None = None
    rand_seed: torch.Tensor | None = None
    spec: "SpecBatch | None" = None
    snapshot: "Callable[[int], object] | None" = None
    max_seqlen: int | None = None
    live_seqs: int | None = None


class SpecBatch(NamedTuple):
    """What a speculative verify call adds (built once per call by the model).

    ntok          T tokens per request (1 on the plain path)
    path          "replay", "legacy" or "plain" (the Mamba layers' rollback scheme)
    conv_accepted [B] int32: each request's accepted count of its previous step (the conv history)
    intermediate  per Mamba layer: legacy per-position states [B, T, H, P, N], or None
    no_dst        [B] int32 of -1 (legacy) or None
    kv_read       KVBatch over B*T query rows: row (b, t) attends to its request's first
                  ctx_b + t + 1 tokens (its own block-table row repeated, lengths per row)
    """

    ntok: int
    path: str
    conv_accepted: torch.Tensor | None
    intermediate: list
    no_dst: torch.Tensor | None
    kv_read: KVBatch | None


class Block(nn.Module):
    kind = "?"

    def __init__(self, cfg, cache_index: int, device=None, dtype=None):
        super().__init__()
        self.cache_index = cache_index
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, device=device, dtype=dtype)
        self.mixer = self.make_mixer(cfg, device=device, dtype=dtype)

    def make_mixer(self, cfg, *, device, dtype) -> nn.Module:
        raise NotImplementedError

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.mixer(h)

    def defers_norm(self, tokens: int) -> bool:
        return False

    def prefill(self, h: torch.Tensor, cache, batch: Batch, norm_sumsq: torch.Tensor | None = None) -> torch.Tensor:
        return self.mixer(h)

    def decode(self, h: torch.Tensor, cache, batch: Batch) -> torch.Tensor:
        return self.mixer(h)

    def verify(self, h: torch.Tensor, cache, batch: Batch) -> torch.Tensor:
        return self.mixer(h)


class MambaBlock(Block):
    kind = "M"

    def make_mixer(self, cfg, *, device, dtype) -> nn.Module:
        return Mamba2Mixer(cfg.mamba, device=device, dtype=dtype)

    def _seed(self, batch):
        j = self.cache_index
        return None if batch.rand_seed is None else batch.rand_seed[j:j + 1]

    def defers_norm(self, tokens: int) -> bool:
        return self.mixer.defers_norm(tokens)

    def prefill(self, h, cache, batch, norm_sumsq=None):
        j = self.cache_index
        return self.mixer.forward_varlen(h, batch.cu_seqlens, cache.conv[j], cache.ssm[j], batch.slots,
                                         batch.has_initial_state, rand_seed=self._seed(batch),
                                         snapshot=None if batch.snapshot is None else batch.snapshot(j),
                                         max_seqlen=batch.max_seqlen, live_seqs=batch.live_seqs,
                                         norm_sumsq=norm_sumsq)

    def decode(self, h, cache, batch):
        j = self.cache_index
        return self.mixer.step(h, cache.conv[j], cache.ssm[j], batch.slots, rand_seed=self._seed(batch))

    def verify(self, h, cache, batch):
        j, sp = self.cache_index, batch.spec
        nreq = batch.slots.shape[0]
        out = self.mixer.verify(h.view(nreq, sp.ntok, -1), cache.conv[j], cache.replay[j], batch.slots,
                                sp.conv_accepted, path=sp.path, intermediate_states=sp.intermediate[j],
                                no_dst=sp.no_dst, rand_seed=self._seed(batch))
        return out.view(nreq * sp.ntok, -1)


class AttentionBlock(Block):
    kind = "*"

    def make_mixer(self, cfg, *, device, dtype) -> nn.Module:
        return Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, device=device, dtype=dtype)

    def prefill(self, h, cache, batch, norm_sumsq=None):
        j = self.cache_index
        return self.mixer.forward_varlen(h, cache.kv.k[j], cache.kv.v[j], batch.kv)

    def decode(self, h, cache, batch):
        j = self.cache_index
        return self.mixer.step(h, cache.kv.k[j], cache.kv.v[j], batch.kv)

    def verify(self, h, cache, batch):
        j = self.cache_index
        return self.mixer.verify(h, cache.kv.k[j], cache.kv.v[j], batch.kv, batch.spec.kv_read)


class MLPBlock(Block):
    kind = "-"

    def make_mixer(self, cfg, *, device, dtype) -> nn.Module:
        return MLP(cfg.d_model, cfg.intermediate_size, bias=cfg.mlp_bias, device=device, dtype=dtype)


class MoEBlock(Block):
    """Routed experts + shared expert; like the MLP a per-token map (prefill, decode and verify
    are ``forward`` on their rows)."""

    kind = "E"

    def make_mixer(self, cfg, *, device, dtype) -> nn.Module:
        return MoE(cfg.moe, device=device, dtype=dtype)


BLOCK_KINDS: dict[str, type[Block]] = {"M": MambaBlock, "*": AttentionBlock, "-": MLPBlock, "E": MoEBlock}


# finish(block, name) runs on each block as soon as it is built (``finishing_blocks``)
_FINISH_BLOCK: contextvars.ContextVar[Callable[[nn.Module, str], None] | None] = contextvars.ContextVar(
    "finish_block", default=None)


@contextlib.contextmanager
def finishing_blocks(finish: Callable[[nn.Module, str], None]) -> Iterator[None]:
    """Within the block, ``build_blocks`` calls ``finish(block, name)`` on each block right after
    building it (name: its qualified name in the model, e.g. ``backbone.layers.3``). The loaders use
    it to turn a block's 16-bit matrices into FP8 before the next block is built, so that a model
    whose 16-bit form does not fit the GPU (Nemotron-3 Super: 240 GB in bf16) never exists whole."""
    token = _FINISH_BLOCK.set(finish)
    try:
        yield
    finally:
        _FINISH_BLOCK.reset(token)


def build_blocks(cfg, device=None, dtype=None, *, name: str = "backbone.layers") -> nn.ModuleList:
    """One block per character of ``cfg.pattern``; ``cache_index`` counts each kind separately.
    ``name``: the ModuleList's qualified name in the model (for ``finishing_blocks``)."""
    seen: dict[str, int] = {}
    blocks = []
    finish = _FINISH_BLOCK.get()
    for i, c in enumerate(cfg.pattern):
        if c not in BLOCK_KINDS:
            raise ValueError(f"build_blocks: layer kind {c!r} is not supported (kinds: {''.join(BLOCK_KINDS)})")
        block = BLOCK_KINDS[c](cfg, seen.get(c, 0), device=device, dtype=dtype)
        if finish is not None:
            finish(block, f"{name}.{i}")
        blocks.append(block)
        seen[c] = seen.get(c, 0) + 1
    return nn.ModuleList(blocks)
