"""Decode and speculative verify steps replayed from CUDA graphs, one graph per batch bucket
(1, 2, 4, ... max_batch): ``GraphedDecoder`` (plain decoding) and ``GraphedVerifier`` (speculative
decoding: one graph per (verify path, bucket) for the verify and one for the commit).

A graph is captured the first time its bucket is used: static token and slot buffers are filled
with ``copy_``, warm-up runs on a side stream, and every bucket shares one memory pool. Rows past
the live batch are padding: their slot is ``-1`` (the kernels' pad slot: no state read or write),
their token 0. Nothing in a replay synchronises with the host.

Weights are read at every replay, never captured as values: the kernels compute -exp(A_log) from
``A_log`` themselves, so an in-place weight change (``load_state_dict``, ``A_log.sub_()``) is seen by
the next replay. A graph does keep the weights' addresses: a change that rebinds storage
(``param.data = t``, ``load_state_dict(..., assign=True)``, ``model.to(...)``) needs ``invalidate()``
(the graphs are captured again at their next use). ``rand_seed`` (int64 [n_layer], ``fastmamba.generation.rounding``) is captured by
address: advance it in place before a replay and the replay's 16-bit state stores use the new seeds.
"""
from __future__ import annotations

import contextlib
import time

import torch

from fastmamba.cache.hybrid_cache import HybridCache
from fastmamba.cache.state_cache import StateCache
from fastmamba.models.lm import HybridLM
from fastmamba.ops.runtime import graph_capture, pdl_supported, programmatic_dependent_launch

PAD_SLOT = -1


class CaptureClock:
    """How many CUDA graphs an owner captured and the host seconds that took (warm-up runs
    included): a capture in the middle of serving stalls every running request for that long."""

    def __init__(self) -> None:
        self.count, self.seconds = 0, 0.0

    @contextlib.contextmanager
    def timing(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.count += 1
            self.seconds += time.perf_counter() - t0


def buckets_up_to(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to and including max_batch (which need not be a power of two)."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def _bucket_for(buckets: list[int], n: int, who: str) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{who}: batch {n} exceeds the largest bucket {buckets[-1]}")


def warm_up_padded(run, slots: torch.Tensor) -> None:
    """Run ``run()`` twice on a side stream with ``slots`` set to padding (no state read or
    written), as capture requires (Triton compiles, lazy allocations); ``slots`` is restored."""
    saved = slots.clone()
    slots.fill_(PAD_SLOT)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    slots.copy_(saved)


class GraphedDecoder:
    """``decode(tokens [B] int64, slots [B] int32) -> logits [B, V]`` fp32, B <= max_batch.

    Hybrid models (``NemotronHLM`` with a ``HybridCache``): the caller grows the cache first
    (``cache.grow(slots, [1] * B)``: KV pages and lengths, host bookkeeping plus one small copy
    into the static block table and lengths); the graph runs ``decode(..., grow=False)``, whose
    positions and attention lengths come from those static buffers. Pad rows (slot -1) write
    their K/V to the scratch page and attend to nothing.

    The returned logits are a view of a static buffer: valid until the next call.
    pdl: programmatic dependent launch inside the graphs (``fastmamba.ops._common.pdl``); None
    (default): on where the GPU has it (sm_90+). A decode step keeps its contract (no kernel
    writes the weights, slot indices or state rows that the next one reads before its wait), and
    it is what lets the step's projections (``gemv``) start streaming their weights early.
    rand_seed: int64 [n_layer] device tensor or None: the graphs' stochastic-rounding seeds
    (``StochasticRounding.seeds``), read at every replay; the caller advances them.
    """

    def __init__(self, model: HybridLM, cache: HybridCache | StateCache, max_batch: int, *,
                 pdl: bool | None = None, rand_seed: torch.Tensor | None = None):
        if not torch.cuda.is_available() or model.lm_head.weight.device.type != "cuda":
            raise RuntimeError("GraphedDecoder needs the model on a CUDA device")
        if pdl is None:
            pdl = pdl_supported(model.lm_head.weight)
        self.model, self.cache, self.max_batch, self.pdl = model, cache, max_batch, pdl
        self.rand_seed = rand_seed
        dev = model.lm_head.weight.device
        self.buckets = buckets_up_to(max_batch)
        self.tokens = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.slots = torch.full((max_batch,), PAD_SLOT, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.captured = CaptureClock()

    def _bucket(self, n: int) -> int:
        return _bucket_for(self.buckets, n, "GraphedDecoder")

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        pdl = programmatic_dependent_launch() if self.pdl else contextlib.nullcontext()
        tokens, slots = self.tokens[:b], self.slots[:b]
        # the caller grows a paged KV cache (and checks the slots) before each replay: the graph
        # reads its block table and lengths as static buffers

        def run() -> torch.Tensor:
            return self.model.decode(tokens, self.cache, slots, rand_seed=self.rand_seed, grow=False)

        with pdl:
            warm_up_padded(run, slots)
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph, pool=self.pool):
                logits = run()
        return graph, logits

    def invalidate(self) -> None:
        """Drop every captured graph (after the weights moved to new storage); recaptured on next use,
        into a fresh memory pool (the old one goes with its graphs: capturing into a pool whose graphs
        were all freed trips the caching allocator's use-count assert)."""
        self.graphs.clear()
        self.pool = torch.cuda.graph_pool_handle()

    def decode(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[0]
        b = self._bucket(n)
        self.tokens[:n].copy_(tokens, non_blocking=True)
        self.slots[:n].copy_(slots, non_blocking=True)
        if b > n:
            self.tokens[n:b].zero_()
            self.slots[n:b].fill_(PAD_SLOT)
        if b not in self.graphs:
            with self.captured.timing():
                self.graphs[b] = self._capture(b)
        graph, logits = self.graphs[b]
        graph.replay()
        return logits[:n]


class GraphedVerifier:
    """Speculative decoding's verify steps from CUDA graphs, one per (path, batch bucket).

    verify(tokens [B, T'] int64, slots [B] int32, path) -> logits [B, T', V] fp32
        ``Mamba2LM.verify`` on ``path`` ("replay", "legacy": T' = T = K+1; "plain": T' = 1), a
        view of a static buffer valid until the next call. B <= max_batch (legacy: B <=
        ``cache.legacy_max_batch``, its buckets stop there).
    commit(slots [B] int32, accepted [B] int32, path)
        ``Mamba2LM.commit`` for the verify just run on the same slots, from a second graph per
        (path, bucket) (legacy: a copy per layer; replay and plain: a few small kernels). Its
        first call runs eagerly (the warm-up, with the host-side range checks) and is captured
        afterwards; replays check nothing (the caller's counts must lie in 1..T).

    The slots' replay histories must be empty before a legacy or plain step (``cache.flush``,
    eagerly, by the caller). The pad rows of a bucket have slot -1: the verify kernels skip them,
    the legacy commit repeats its first live row's copy for them. ``rand_seed`` as in
    ``GraphedDecoder``.
    """

    PATHS = ("replay", "legacy", "plain")

    def __init__(self, model: HybridLM, cache: HybridCache | StateCache, max_batch: int, *, pdl: bool | None = None,
                 rand_seed: torch.Tensor | None = None):
        if not torch.cuda.is_available() or model.lm_head.weight.device.type != "cuda":
            raise RuntimeError("GraphedVerifier needs the model on a CUDA device")
        if pdl is None:  # as GraphedDecoder (the same launch configs: a verify step's rounding
            pdl = pdl_supported(model.lm_head.weight)  # then matches a plain step's)
        if not cache.speculate:
            raise ValueError("GraphedVerifier: the cache was built without speculation (speculate=0)")
        self.model, self.cache, self.max_batch, self.pdl = model, cache, max_batch, pdl
        self.rand_seed = rand_seed
        # a paged KV cache (hybrid models): the caller grows it by T before verify and shrinks it to
        # the accepted tokens after commit (``HybridCache.grow`` / ``rollback``), outside the graphs
        self.paged = cache.paged
        dev = model.lm_head.weight.device
        self.tokens = {"replay": torch.zeros(max_batch, cache.tokens_per_step, dtype=torch.int64, device=dev),
                       "plain": torch.zeros(max_batch, 1, dtype=torch.int64, device=dev)}
        self.tokens["legacy"] = self.tokens["replay"]
        self.slots = torch.full((max_batch,), PAD_SLOT, dtype=torch.int32, device=dev)
        self.accepted = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.commit_graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.captured = CaptureClock()

    def invalidate(self) -> None:
        """Drop every captured graph (after the weights moved to new storage); recaptured on next use,
        into a fresh memory pool (as ``GraphedDecoder.invalidate``)."""
        self.graphs.clear()
        self.commit_graphs.clear()
        self.pool = torch.cuda.graph_pool_handle()

    def buckets(self, path: str) -> list[int]:
        """The batch buckets of ``path`` (legacy: up to ``cache.legacy_max_batch``)."""
        if path not in self.PATHS:
            raise ValueError(f"GraphedVerifier: `path` expected one of {self.PATHS}, got {path!r}")
        return buckets_up_to(min(self.max_batch, self.cache.legacy_max_batch) if path == "legacy" else self.max_batch)

    def _fill(self, path: str, tokens: torch.Tensor | None, slots: torch.Tensor) -> tuple[int, int]:
        """Copy the live rows into the static buffers and pad up to the bucket; returns (n, bucket)."""
        n = slots.shape[0]
        b = _bucket_for(self.buckets(path), n, f"GraphedVerifier ({path} path)")
        self.slots[:n].copy_(slots, non_blocking=True)
        self.slots[n:b].fill_(PAD_SLOT)
        if tokens is not None:
            buf = self.tokens[path]
            buf[:n].copy_(tokens, non_blocking=True)
            buf[n:b].zero_()
        return n, b

    def _capture(self, path: str, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        pdl = programmatic_dependent_launch() if self.pdl else contextlib.nullcontext()
        tokens, slots = self.tokens[path][:b], self.slots[:b]

        def run() -> torch.Tensor:  # grown (slots checked) by the caller, as for decode
            return self.model.verify(tokens, self.cache, slots, path=path, rand_seed=self.rand_seed, grow=False)

        with pdl:
            warm_up_padded(run, slots)
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph, pool=self.pool):
                logits = run()
        return graph, logits

    def verify(self, tokens: torch.Tensor, slots: torch.Tensor, path: str) -> torch.Tensor:
        ntok = 1 if path == "plain" else self.cache.tokens_per_step
        if tokens.dim() != 2 or tokens.shape[1] != ntok or tuple(slots.shape) != (tokens.shape[0],):
            raise ValueError(f"GraphedVerifier.verify ({path} path): expected tokens (B, {ntok}) and slots (B,), "
                             f"got {tuple(tokens.shape)} and {tuple(slots.shape)}")
        n, b = self._fill(path, tokens, slots)
        if (path, b) not in self.graphs:
            with self.captured.timing():
                self.graphs[(path, b)] = self._capture(path, b)
        graph, logits = self.graphs[(path, b)]
        graph.replay()
        return logits[:n]

    def commit(self, slots: torch.Tensor, accepted: torch.Tensor, path: str) -> None:
        n, b = self._fill(path, None, slots)
        self.accepted[:n].copy_(accepted, non_blocking=True)
        self.accepted[n:b].fill_(1)
        graph = self.commit_graphs.get((path, b))
        if graph is not None:
            graph.replay()
            return
        slots_b, accepted_b = self.slots[:b], self.accepted[:b]

        rollback = {"rollback": False} if self.paged else {}

        def run() -> None:
            self.model.commit(self.cache, slots_b, accepted_b, path=path, **rollback)

        # the first commit of a (path, bucket) runs eagerly, checks included: that is its warm-up;
        # capturing then records the same kernels without running them again
        run()
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph, pool=self.pool):
            run()
        self.commit_graphs[(path, b)] = graph
