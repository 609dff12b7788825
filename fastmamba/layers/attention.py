"""Grouped-query attention layer over a paged KV cache (Nemotron-H's: no rotary or other position
embedding, no biases, scale 1/sqrt(Dh)).

Parameter names follow transformers' ``NemotronHAttention``: ``q_proj`` [Hq*Dh, M], ``k_proj`` /
``v_proj`` [Hkv*Dh, M], ``o_proj`` [M, Hq*Dh]. Its slice of the cache is one K and one V page pool
(``KVPages.k[j]``, ``.v[j]``); where its tokens go is the same for every attention layer of a step,
so the model computes it once (``KVBatch``) and hands it to each layer.

    forward        [B, L, M] without a cache: causal SDPA over the batch (the full-logits path)
    forward_varlen packed prompts: K/V written to their pages, then causal attention over each
                   request's cached context plus the prompt (``varlen_prefill_attention``: one
                   Triton kernel for the batch on a GPU)
    step           one token per request: K/V written, then ``paged_decode_attention`` (Triton)
    verify         T tokens per request (speculative decoding): K/V of all T written, then each
                   token attends to its request's cache and the tokens before it: the same
                   ``paged_decode_attention`` over B*T query rows, each with its own length

float8 K/V pages: the layer holds per-tensor ``k_scale`` / ``v_scale`` (fp32 buffers, 1.0 unless
a checkpoint's are copied in: ``fastmamba.models.quantization``) and ``kv_dtype``, the page dtype
the model asks its caches for (None: the activations' dtype; ``kv_cache_dtype_of``). The cached
paths pass the scales to the ops whenever the pools they are handed are float8; ``forward``
(nothing cached) rounds K and V through e4m3 with the same scales when ``kv_dtype`` is float8, so
it stays the definition of what the cached paths compute.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from fastmamba.ops.attention import (PrefillWork, paged_decode_attention, paged_kv_write, quantize_kv_ref,
                                     varlen_prefill_attention)
from fastmamba.ops.gemv import gemv, gemv_covers

FP8_KV = torch.float8_e4m3fn


def _plain(layer: nn.Module) -> bool:
    """An ``nn.Linear`` itself (not a quantised or tensor-parallel subclass) with no hooks on it."""
    return type(layer) is nn.Linear and not layer._forward_hooks and not layer._forward_pre_hooks


def project(u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(u, weight, bias)``; a decode or verify step's few rows through the Triton ``gemv``
    where it covers them (``gemv_covers``: the H100 profile of a Nano decode step, 2026-12-06, read
    the attention projections in cuBLAS at 65-75% of the copy rate)."""
    return gemv(u, weight, bias) if gemv_covers(u, weight) else F.linear(u, weight, bias)


class KVBatch(NamedTuple):
    """Where a step's tokens live in the paged KV cache (shared by all attention layers).

    block_table  [S, Pmax] int32   the cache's page table (static buffer)
    seq_lens     [S] int32         tokens cached per request row, this step's included
    slots        [B] int32/int64   request rows; -1 marks a pad request
    positions    [T] int64         each token's position in its request
    token_rows   [T] int64 or None token t belongs to request token_rows[t] (None: T == B)
    cu_seqlens   [B+1] or None     prefill only: the packed prompts
    ctx_lens     list[int] or None prefill only: tokens each request had before this call (host)
    cu_host, slots_host  list[int] or None: prefill only, the values of cu_seqlens and slots as the
                 host holds them (then the attention prefill reads nothing back from the device)
    ctx_dev      [B] int tensor or None: prefill only, ctx_lens on the device (the kernel's input)
    work         ``PrefillWork`` or None: prefill only, the attention kernel's work table on the
                 device (with ctx_dev: nothing is built or uploaded per layer; graph safe)
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    token_rows: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    ctx_lens: list[int] | None = None
    cu_host: list[int] | None = None
    slots_host: list[int] | None = None
    ctx_dev: torch.Tensor | None = None
    work: PrefillWork | None = None


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


def kv_cache_dtype_of(model: nn.Module) -> torch.dtype | None:
    """The K/V page dtype ``model``'s attention layers ask for (their ``kv_dtype``; the first one
    that sets one), or None: the caller's default (the model's dtype). An LM's backbone layers
    only (an MTP drafter's attention keeps pages of its own)."""
    layers = getattr(getattr(model, "backbone", None), "layers", None)
    mods = [getattr(b, "mixer", None) for b in layers] if layers is not None else model.modules()
    for m in mods:
        if isinstance(m, Attention) and m.kv_dtype is not None:
            return m.kv_dtype
    return None


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, *, device=None, dtype=None):
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"Attention: n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        kw = dict(bias=False, device=device, dtype=dtype)
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, **kw)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, **kw)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, **kw)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, **kw)
        self._alias_qkv()
        # float8 K/V pages: the per-tensor scales (stored value = K / k_scale), not in state_dict
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32, device=device), persistent=False)
        self.kv_dtype: torch.dtype | None = None  # the page dtype caches should use (None: the activations')

    @torch.no_grad()
    def reset_runtime_buffers(self) -> None:
        """The non-persistent buffers' built values (``fastmamba.layers.buffers``): scales of 1."""
        self.k_scale.fill_(1.0)
        self.v_scale.fill_(1.0)

    def _scales(self, k_pages: torch.Tensor) -> dict:
        """The ops' scale arguments for these pools: the layer's scales for float8 pools, none else."""
        return {"k_scale": self.k_scale, "v_scale": self.v_scale} if k_pages.dtype == FP8_KV else {}

    @torch.no_grad()
    def _alias_qkv(self) -> None:
        """Put q_proj's, k_proj's and v_proj's weights one after the other in one storage (each
        weight a view of it, names and shapes unchanged), so that ``_qkv`` reads all three in one
        GEMM. Weights loaded later are copied into the views, which keeps them there."""
        ws = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        qkv = torch.cat([w.detach() for w in ws])
        o = 0
        for lin, w in zip((self.q_proj, self.k_proj, self.v_proj), ws):
            lin.weight = nn.Parameter(qkv[o:o + w.shape[0]], requires_grad=w.requires_grad)
            o += w.shape[0]

    def qkv_weight(self) -> torch.Tensor | None:
        """[(Hq + 2 Hkv) * Dh, M]: q_proj's, k_proj's and v_proj's weights as one matrix (a view,
        no copy) while they still lie back to back in one storage, plain ``nn.Linear`` without
        biases and no forward hooks on them; else None. (``module.to(...)``, a quantised or sharded
        projection, or weights assigned anew end the aliasing; a hook asks for the projection's own
        call: ``_qkv`` then runs the three projections.)"""
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        if not (_plain(q) and _plain(k) and _plain(v)) or q.bias is not None or k.bias is not None or v.bias is not None:
            return None
        wq, wk, wv = q.weight, k.weight, v.weight
        if not (wq.dtype == wk.dtype == wv.dtype and wq.is_contiguous() and wk.is_contiguous() and wv.is_contiguous()):
            return None
        size = wq.element_size()
        if (wk.data_ptr() != wq.data_ptr() + wq.numel() * size or wv.data_ptr() != wk.data_ptr() + wk.numel() * size
                or wq.untyped_storage().data_ptr() != wv.untyped_storage().data_ptr()):
            return None
        return wq.as_strided((wq.shape[0] + wk.shape[0] + wv.shape[0], wq.shape[1]), (wq.shape[1], 1))

    def _qkv(self, u: torch.Tensor):
        """u [..., M] -> q [..., Hq, Dh], k and v [..., Hkv, Dh] (views of one GEMM's output where
        ``qkv_weight`` holds, so k and v are strided along their first dims)."""
        lead = u.shape[:-1]
        w = self.qkv_weight()
        if w is None:
            q = self.q_proj(u).view(*lead, self.n_heads, self.head_dim)
            k = self.k_proj(u).view(*lead, self.n_kv_heads, self.head_dim)
            v = self.v_proj(u).view(*lead, self.n_kv_heads, self.head_dim)
            return q, k, v
        nq, nk = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        out = project(u, w)
        q = out[..., :nq].view(*lead, self.n_heads, self.head_dim)
        k = out[..., nq:nq + nk].view(*lead, self.n_kv_heads, self.head_dim)
        v = out[..., nq + nk:].view(*lead, self.n_kv_heads, self.head_dim)
        return q, k, v

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        """o_proj of the attention output o [T, Hq*Dh] (``project`` where o_proj is a plain Linear)."""
        return project(o, self.o_proj.weight, self.o_proj.bias) if _plain(self.o_proj) else self.o_proj(o)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """u [B, L, M] -> [B, L, M]: causal attention within each row, nothing cached."""
        nreq, L, _ = u.shape
        q, k, v = self._qkv(u)
        if self.kv_dtype == FP8_KV:  # what the cached paths read back from float8 pages
            k = (quantize_kv_ref(k, self.k_scale).float() * self.k_scale.float()).to(q.dtype)
            v = (quantize_kv_ref(v, self.v_scale).float() * self.v_scale.float()).to(q.dtype)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, L, Dh]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                           enable_gqa=self.n_heads != self.n_kv_heads)
        return self.o_proj(o.transpose(1, 2).reshape(nreq, L, -1))

    def forward_varlen(self, u: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                       kv: KVBatch) -> torch.Tensor:
        """Packed prompts u [T, M] -> [T, M]; their K/V are written into the pages first (mutated)."""
        q, k, v = self._qkv(u)
        scales = self._scales(k_pages)
        paged_kv_write(k, v, k_pages, v_pages, kv.block_table, kv.slots, kv.positions, kv.token_rows, **scales)
        ctx = kv.ctx_dev if kv.ctx_dev is not None else kv.ctx_lens
        o = varlen_prefill_attention(q, k_pages, v_pages, kv.block_table, kv.slots, kv.cu_seqlens, ctx,
                                     k_new=k, v_new=v, scale=self.scale, cu_seqlens_host=kv.cu_host,
                                     slots_host=kv.slots_host, work=kv.work, **scales)
        return self._out(o.reshape(u.shape[0], -1))

    def step(self, u: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, kv: KVBatch) -> torch.Tensor:
        """One token per request u [B, M] -> [B, M]; its K/V land at ``kv.positions`` (mutated)."""
        q, k, v = self._qkv(u)
        scales = self._scales(k_pages)
        paged_kv_write(k, v, k_pages, v_pages, kv.block_table, kv.slots, kv.positions, **scales)
        o = paged_decode_attention(q, k_pages, v_pages, kv.block_table, kv.seq_lens, kv.slots, scale=self.scale,
                                   **scales)
        return self._out(o.reshape(u.shape[0], -1))

    def verify(self, u: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, kv: KVBatch,
               kv_read: KVBatch) -> torch.Tensor:
        """T tokens per request, u [B*T, M] -> [B*T, M]: their K/V land at ``kv.positions`` (rows
        ``kv.token_rows``, mutated), then query row i attends over ``kv_read``'s row i (its
        request's pages, ``kv_read.seq_lens[i]`` tokens: causal within the T). No host read."""
        q, k, v = self._qkv(u)
        scales = self._scales(k_pages)
        paged_kv_write(k, v, k_pages, v_pages, kv.block_table, kv.slots, kv.positions, kv.token_rows, **scales)
        o = paged_decode_attention(q, k_pages, v_pages, kv_read.block_table, kv_read.seq_lens, kv_read.slots,
                                   scale=self.scale, **scales)
        return self._out(o.reshape(u.shape[0], -1))
