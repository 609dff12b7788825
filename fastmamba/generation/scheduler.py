"""Which requests run in a step, and how many of their tokens: the engine's scheduler.

A ``Scheduler`` owns the three queues of an engine's requests and decides, from host-side counts
only (slots, K/V pages, prefix-cache keys; it reads no tensor):
  * admission: how many waiting requests take a slot now (``admissible``), which slot, and how much
    of each prompt a prefix-cache hit restores (``admit``);
  * the chunk plan of chunked prefill (``plan_chunk``): the partly fed prompts first, then new
    requests, within the ``prefill_chunk`` token budget, the batch and the free pages;
  * the prefix-cache snapshots a prefill call takes (``plan_snapshots``).

Paged K/V (hybrid models: ``HybridCache``; every page helper is a no-op for a pure Mamba-2 model):
  * ``check_fits`` refuses a request whose prompt plus ``max_new_tokens`` can never fit one
    request's KV (``max_seq_len``, or the whole pool if smaller);
  * a request is admitted (and a prefill chunk sized) only while free pages hold its tokens,
    keeping one free page per running request in reserve;
  * ``decode_ready``: a decode step grows each request's KV by its tokens on the host before the
    model (or its CUDA graph) runs; a request whose next tokens need a page when none is free waits
    (state and pages untouched) while the others advance. If no request can advance at all, the
    engine fails ``eviction()``'s request (the newest holding pages: finish_reason "error", a
    RuntimeError naming the exhausted pool, no StepOutput) to free its pages.
A verify step grows each request's KV by its T inputs, the commit shortens it to the accepted ones
(``HybridCache.rollback``, in ``speculative``). A graphed prefill grows the pages on the host before
its replay (``GraphedPrefill``), as the eager one does in the model.

The engine runs what the scheduler planned and tells it what came of it (``start_running``,
``release`` a finished request's slot, ``drop_finished``, ``remove``); it never edits the queues itself.
"""
from __future__ import annotations

import itertools
from collections import deque

from fastmamba.cache.prefix_cache import PrefixCache, SnapshotPlan
from fastmamba.generation.engine_config import EngineConfig
from fastmamba.generation.requests import Request
from fastmamba.generation.sampling import SamplingParams


class Scheduler:
    """The queues of one engine's requests and the plans over them (see the module docstring).

    waiting     requests not yet holding a slot, oldest first
    prefilling  requests holding a slot whose prompt is partly fed (chunked prefill)
    running     requests decoding: their whole prompt is in their slot's state
    prefix      the ``PrefixCache`` (None: prefix caching is off); ``prefix_block`` its snapshot interval
    """

    def __init__(self, cache, config: EngineConfig, chunk_size: int):
        self.cache = cache
        self.paged = cache.paged
        self.max_batch, self.prefill_chunk = config.max_batch, config.prefill_chunk
        self.speculate = config.speculate or 0
        self.chunk_size = chunk_size
        block = config.prefix_block
        self.prefix_block = max(chunk_size, round(512 / chunk_size) * chunk_size) if block is None else block
        self.prefix: PrefixCache | None = None
        budget, entries = config.prefix_cache_bytes, config.prefix_cache_entries
        if budget or entries:
            state_len = cache.conv[0].shape[-1]
            if chunk_size < state_len:
                raise ValueError(f"Engine: prefix caching needs the model's chunk_size ({chunk_size}) to be at least "
                                 f"the conv state's length ({state_len} columns)")
            self.prefix = PrefixCache(cache, max_entries=entries or None, budget_bytes=budget or None)
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []

    # ------------------------------------------------------------------ the queues

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def add(self, r: Request) -> None:
        """Queue a checked request (``Engine.add_validated_request``)."""
        self.waiting.append(r)

    def start_running(self, reqs: list[Request]) -> None:
        """``reqs`` have their whole prompt in: they decode from the next step on."""
        if self.prefilling:
            self.prefilling = [r for r in self.prefilling if r.prefilled < len(r.prompt)]
        self.running.extend(reqs)

    def drop_finished(self, prefilling: bool = False) -> None:
        """Forget the running (and with ``prefilling``, the partly fed) requests that finished."""
        self.running = [r for r in self.running if not r.finished]
        if prefilling:
            self.prefilling = [r for r in self.prefilling if not r.finished]

    def find(self, rid: int) -> Request | None:
        """The unfinished request with id ``rid`` (waiting, prefilling or running), or None."""
        return next((r for r in itertools.chain(self.waiting, self.prefilling, self.running) if r.rid == rid), None)

    def release(self, r: Request) -> None:
        """``r`` just finished: free its slot (``r.slot`` becomes -1). One that ended by itself
        (eos / stop / length) with its whole prompt in first leaves its state in the prefix cache,
        under its prompt and output but the last token (not yet fed), so that the next turn of a
        conversation continues from it (not with speculation: a verified slot's conv history is
        not in prefill's layout)."""
        if r.slot < 0:
            return
        if (self.prefix is not None and r.finish_reason in ("eos", "stop", "length") and not self.speculate
                and r.prefilled == len(r.prompt) and r.output):
            self.prefix.save(r.prompt + r.output[:-1], self.cache, r.slot)
        slot, r.slot = r.slot, -1
        self.cache.free([slot])

    def remove(self, r: Request) -> None:
        """Take ``r`` out of whichever queue holds it."""
        self.waiting = deque(w for w in self.waiting if w is not r)
        self.prefilling = [x for x in self.prefilling if x is not r]
        self.running = [x for x in self.running if x is not r]

    # ------------------------------------------------------------------ admission

    def admissible(self) -> int:
        """How many waiting requests a step without ``prefill_chunk`` admits (whole prompts): as
        many as the batch, the free slots and the free pages hold, a page per running request
        kept in reserve."""
        if not self.waiting:  # a decode step: nothing more to count
            return 0
        room = min(self.max_batch - len(self.running), self.cache.free_slots)
        if room <= 0:
            return 0
        n = min(len(self.waiting), room)
        pages = self._reserve(self._free_pages())
        if pages is None:
            return n
        k = 0
        for r in itertools.islice(self.waiting, n):
            need = self.cache.pages_for(None, len(r.prompt))
            if need > pages:
                break
            pages -= need
            k += 1
        return k

    def admit(self, n: int) -> list[Request]:
        """Move ``n`` waiting requests to fresh slots (one take: one zeroing pass, no host read);
        with a prefix cache each starts from the longest cached prefix of its prompt."""
        admitted = [self.waiting.popleft() for _ in range(n)]
        if self.prefix is None:
            slots = self.cache.take(n)
        else:  # prefill only the rest (a restored slot needs no zeroing)
            entries = [self.prefix.match(req.prompt) for req in admitted]
            slots = self.cache.take(n, zero=[e is None for e in entries])
            for req, slot, entry in zip(admitted, slots, entries):
                if entry is not None:
                    self.prefix.restore(entry, self.cache, slot)
                    req.prefilled = req.cached_tokens = entry.length
        for req, slot in zip(admitted, slots):
            req.slot = slot
        return admitted

    def plan_chunk(self) -> tuple[list[Request], list[list[int]]]:
        """This step's prefill chunk: the partly fed prompts first, then new requests (each admitted
        to a fresh slot, and so ``prefilling``) while the ``prefill_chunk`` token budget, the
        batch's room and the free pages last. Returns the requests and each one's tokens to feed."""
        budget = self.prefill_chunk
        pages = self._free_pages()
        reqs, chunks = [], []
        for r in self.prefilling:
            if budget <= 0:
                break
            take, pages = self._take(r.slot, min(len(r.prompt) - r.prefilled, budget), pages)
            if not take:
                continue
            reqs.append(r)
            chunks.append(r.prompt[r.prefilled:r.prefilled + take])
            budget -= take
        room = min(self.max_batch - len(self.running) - len(self.prefilling), self.cache.free_slots)
        pages = self._reserve(pages)  # new requests leave a page per running request free
        while budget > 0 and room > 0 and self.waiting:
            prompt = self.waiting[0].prompt
            # a hybrid's prefix-cache hit restores its prefix's K/V into pages of its own: count them
            hit = self.prefix.peek(prompt) if self.paged and self.prefix is not None else 0
            total, pages = self._take(None, hit + min(len(prompt) - hit, budget), pages)
            take = total - hit
            if take <= 0:
                break
            r = self.admit(1)[0]
            take = min(take, len(r.prompt) - r.prefilled)  # a prefix-cache hit leaves fewer to feed
            self.prefilling.append(r)
            reqs.append(r)
            chunks.append(r.prompt[r.prefilled:r.prefilled + take])
            budget -= take
            room -= 1
        return reqs, chunks

    # ------------------------------------------------------------------ paged K/V (hybrid models)

    @property
    def max_request_tokens(self) -> int | None:
        """The most KV positions one request may use (a model with attention layers): its prompt
        plus max_new_tokens - 1 must not exceed it (verify steps hold the drafts too). None: no
        limit (a pure Mamba-2 model keeps a fixed-size state per request)."""
        limit = self.cache.max_len if self.paged else None
        return None if limit is None else limit - self.speculate

    def check_fits(self, ids: list[int], params: SamplingParams, who: str) -> None:
        """ValueError when the request can never fit one request's KV (its last token is never fed)."""
        limit = self.cache.max_len if self.paged else None
        need = len(ids) + params.max_new_tokens - 1 + self.speculate  # a verify step holds K drafts more
        if limit is not None and need > limit:
            kv = self.cache.kv
            raise ValueError(f"{who}the prompt ({len(ids)} tokens) with max_new_tokens={params.max_new_tokens} needs "
                             f"{need} KV positions, more than one request can hold: {limit} (max_seq_len="
                             f"{kv.max_len}, a pool of {kv.num_pages} pages of {kv.page_size} tokens); shorten the "
                             "prompt, lower max_new_tokens, or build the engine with a larger max_seq_len / KV pool")

    def _free_pages(self) -> int | None:
        return self.cache.free_pages if self.paged else None

    def _reserve(self, pages: int | None) -> int | None:
        """``pages`` less one per running request (their next decode steps' pages)."""
        return None if pages is None else pages - len(self.running)

    def _take(self, slot: int | None, n: int, pages: int | None) -> tuple[int, int | None]:
        """How many of ``n`` new tokens ``slot`` (None: a request not yet admitted) can take with
        ``pages`` free pages, and the pages left after them."""
        if pages is None:
            return n, None
        n = min(n, self.cache.room(slot, max(pages, 0)))
        return n, pages - self.cache.pages_for(slot, n)

    def decode_ready(self, ntok: int = 1, grow: bool = True) -> list[Request]:
        """The running requests that advance this step (``grow``: each one's KV already grown by
        ``ntok`` tokens; a verify step reserves K+1). One whose tokens need a page when none is free
        waits; [] while requests run means none can: the engine then fails ``eviction()``'s."""
        if not self.paged:
            return list(self.running)
        pages = self.cache.free_pages
        ready = []
        for r in self.running:
            need = self.cache.pages_for(r.slot, ntok)
            if need <= pages:
                ready.append(r)
                pages -= need
        if ready and grow:
            self.cache.grow([r.slot for r in ready], [ntok] * len(ready))
        return ready

    def eviction(self) -> tuple[Request, RuntimeError]:
        """The request to fail when the K/V pool is out of pages and none can advance (the newest
        holding a slot), and the error it finishes with."""
        victim = max(self.running + self.prefilling, key=lambda r: r.rid)
        kv = self.cache.kv
        return victim, RuntimeError(
            f"Engine: the KV cache is out of pages ({kv.num_pages} pages of {kv.page_size} tokens) and no request can "
            f"advance; request {victim.rid}, the newest, is finished with finish_reason 'error' to free its "
            f"{len(kv.pages_of(victim.slot))} pages. Give the engine more pages (kv_num_pages / kv_budget_bytes) "
            "or a smaller max_batch")

    # ------------------------------------------------------------------ prefix-cache snapshots

    def plan_snapshots(self, reqs: list[Request], chunks: list[list[int]]) -> tuple[SnapshotPlan | None, list]:
        """The prefix-cache snapshots this prefill call takes: for each request, the absolute
        positions that are multiples of ``prefix_block`` inside its chunk and before the prompt's
        end (the state after the whole prompt is kept when the request finishes, with its output),
        on the scan's chunk grid of this call, not cached yet (each claims a pool row; rows claimed
        in this call are never evicted by a later claim of the same call). Returns the plan (None:
        no snapshot) and the claimed entries, in the plan's order."""
        if self.prefix is None:
            return None, []
        chunk, block = self.chunk_size, self.prefix_block
        seq, ends, rows, entries = [], [], [], []
        for b, (r, c) in enumerate(zip(reqs, chunks)):
            start = r.prefilled
            for q in range((start // block + 1) * block, min(start + len(c), len(r.prompt) - 1) + 1, block):
                if (q - start) % chunk:
                    continue  # off this call's chunk grid: no per-chunk state there
                protect = {e.index for e in entries}
                entry = self.prefix.claim(r.prompt[:q], protect=protect)
                if entry is not None and self.paged and not self.prefix.claim_pages(entry, protect):
                    self.prefix.drop(entry)  # a hybrid's snapshot keeps its K/V too: no pages, no snapshot
                    entry = None
                if entry is not None:
                    seq.append(b)
                    ends.append(q - start)
                    rows.append(entry.index)
                    entries.append(entry)
        if not entries:
            return None, []
        return SnapshotPlan(tuple(seq), tuple(ends), tuple(rows), self.prefix.conv, self.prefix.ssm), entries
