"""Decode steps replayed from CUDA graphs, one graph per batch bucket (1, 2, 4, ... max_batch).

A graph is captured the first time its bucket is used: static token and slot buffers are filled
with ``copy_``, warm-up runs on a side stream, and every bucket shares one memory pool. Rows past
the live batch are padding: their slot is ``-1`` (the kernels' pad slot: no state read or write),
their token 0. Nothing in a replay synchronises with the host.
"""
from __future__ import annotations

import contextlib

import torch

from fastmamba.cache.state_cache import StateCache
from fastmamba.models.mamba2_lm import Mamba2LM
from fastmamba.ops._common.pdl import programmatic_dependent_launch

PAD_SLOT = -1


def buckets_up_to(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to and including max_batch (which need not be a power of two)."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class GraphedDecoder:
    """``decode(tokens [B] int64, slots [B] int32) -> logits [B, V]`` fp32, B <= max_batch.

    The returned logits are a view of a static buffer: valid until the next call.
    """

    def __init__(self, model: Mamba2LM, cache: StateCache, max_batch: int, *, pdl: bool = False):
        if not torch.cuda.is_available() or model.lm_head.weight.device.type != "cuda":
            raise RuntimeError("GraphedDecoder needs the model on a CUDA device")
        self.model, self.cache, self.max_batch, self.pdl = model, cache, max_batch, pdl
        dev = model.lm_head.weight.device
        self.buckets = buckets_up_to(max_batch)
        self.tokens = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.slots = torch.full((max_batch,), PAD_SLOT, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"GraphedDecoder: batch {n} exceeds max_batch={self.max_batch}")

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        pdl = programmatic_dependent_launch() if self.pdl else contextlib.nullcontext()
        tokens, slots = self.tokens[:b], self.slots[:b]
        with pdl:
            # warm-up on a side stream on padding rows only (no state touched), as capture requires
            saved = self.slots[:b].clone()
            self.slots[:b].fill_(PAD_SLOT)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.model.decode(tokens, self.cache, slots)
            torch.cuda.current_stream().wait_stream(side)
            self.slots[:b].copy_(saved)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.model.decode(tokens, self.cache, slots)
        return graph, logits

    def decode(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[0]
        b = self._bucket(n)
        self.tokens[:n].copy_(tokens, non_blocking=True)
        self.slots[:n].copy_(slots, non_blocking=True)
        if b > n:
            self.tokens[n:b].zero_()
            self.slots[n:b].fill_(PAD_SLOT)
        if b not in self.graphs:
            self.graphs[b] = self._capture(b)
        graph, logits = self.graphs[b]
        graph.replay()
        return logits[:n]
