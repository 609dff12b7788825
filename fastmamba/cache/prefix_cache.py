"""Prefix caching of Mamba states: the conv and SSM states after a token prefix, kept for reuse.

An attention engine reuses the KV pages of a shared prefix; a Mamba layer keeps its whole past in
one fixed-size state, so reusing a prefix means keeping the state *at the end of* that prefix.
``PrefixCache`` holds such snapshots (every layer's conv and SSM rows of one slot) in its own
preallocated pool, keyed by the exact token prefix:

- ``save(tokens, cache, slot)`` copies the slot's states (which must be the states after exactly
  ``tokens``) into a free entry, evicting the least recently used one when the pool is full;
- ``match(prompt)`` returns the longest cached prefix of ``prompt`` that leaves at least one token
  to prefill (the last token must still run, for its logits), or None;
- ``restore(entry, cache, slot)`` copies the entry's states into a slot: the request then prefills
  only ``prompt[entry.length:]``, continuing from them.

Snapshots are keyed by their token tuple itself (a dict: Python hashes and compares the tuple in C,
so a hash collision can never hand out a wrong state); a lookup tries the cached lengths, longest
first, each one a slice and a dict probe of the prompt. Restoring copies exactly the stored bits: the output
with a hit equals the output without one whenever the states are (fp32: bit-equal logits, given
the same split of the prefill at the cached length).

The pool's size is set by ``max_entries`` or by a byte budget (``budget_bytes``); ``stats`` counts
lookups, hits and the prompt tokens served from the cache.

Hybrid models (``HybridCache``: Mamba slots and paged attention K/V) keep, with each snapshot, the
K/V of its tokens: ``kv_pages`` pages of the cache's page size in a pool of the prefix cache's own
(per attention layer, like ``KVPages``). ``save`` copies the slot's first pages into free ones of
that pool (evicting the least recently used snapshots until enough are free); ``restore`` grows the
fresh slot by the snapshot's length (``HybridCache.grow``: the slot's own pages) and copies the K/V
back, so the request's attention layers see the prefix as if they had prefilled it.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from fastmamba.cache.state_cache import StateCache
from fastmamba.ops.row_copy import copy_rows

MAX_ENTRIES_FROM_BUDGET = 4096


def as_tokens(tokens: Sequence[int]) -> tuple[int, ...]:
    """``tokens`` as a tuple of Python ints (the cache's key): a list of ints converts and is
    checked in C (``set(map(type, ...))``: no Python-level loop over a long prompt)."""
    t = tuple(tokens)
    return t if set(map(type, t)) <= {int} else tuple(int(v) for v in t)


@dataclasses.dataclass(frozen=True)
class SnapshotPlan:
    """States to copy out of a packed prefill while it runs (no second pass over the tokens).

    Snapshot i is the conv and SSM state of the call's sequence ``seq[i]`` after its first
    ``ends[i]`` tokens of this call; ``ends[i]`` must be a multiple of the model's chunk size (the
    chunked scan's per-chunk states are taken as they are) and at least the conv state's length.
    It goes to row ``rows[i]`` of every layer's ``conv[l]`` [R, E, state_len] and ``ssm[l]``
    [R, H, P, N] (a ``PrefixCache``'s pools, the shapes of the slot pools).
    """

    seq: tuple[int, ...]
    ends: tuple[int, ...]
    rows: tuple[int, ...]
    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]


@dataclasses.dataclass(frozen=True)
class LayerSnapshot:
    """One layer's share of a ``SnapshotPlan``, as device index tensors (built once per call).

    chunk_states [n_chunks, H, P, N] fp32 scratch for the scan's per-chunk states (shared by layers)
    chunk_rows   [n] int64: row of chunk_states holding snapshot i's SSM state
    conv_tokens  [n, state_len] int64: packed token rows whose conv inputs form snapshot i's conv state
    rows         [n] int64: destination rows of ``conv`` / ``ssm``
    """

    chunk_states: torch.Tensor
    chunk_rows: torch.Tensor
    conv_tokens: torch.Tensor
    rows: torch.Tensor
    conv: torch.Tensor
    ssm: torch.Tensor


@dataclasses.dataclass(frozen=True)
class SnapshotIndices:
    """A ``SnapshotPlan`` checked against one prefill call and turned into packed-row indices (host lists).

    conv_tokens  n * state_len packed token rows: snapshot i's conv state is the conv inputs of rows
                 conv_tokens[i * state_len : (i + 1) * state_len]
    chunk_rows   n rows of the scan's per-chunk states (``chunk_states_out``) holding the SSM states
    rows         n destination rows of the plan's pools
    n_chunks     the call's chunk count (rows of the chunk-state scratch)
    """

    conv_tokens: list[int]
    chunk_rows: list[int]
    rows: list[int]
    n_chunks: int


def snapshot_indices(plan: SnapshotPlan, cu: Sequence[int], state_len: int, cfg, who: str) -> SnapshotIndices:
    """Checks ``plan`` against a prefill call (``cu``: its cu_seqlens on the host; ``state_len``: the
    conv state's columns; ``cfg``: the Mamba layers' config, ``n_layer`` of them) and returns its
    indices. ValueError (starting with ``who``) when the plan does not fit the call."""
    chunk = cfg.chunk_size
    n, nseq = len(plan.seq), len(cu) - 1
    if not (len(plan.ends) == len(plan.rows) == n) or len(plan.conv) != cfg.n_layer or len(plan.ssm) != cfg.n_layer:
        raise ValueError(f"{who}: `snapshots` needs as many ends and rows as seq ({n}) and one conv and one ssm "
                         f"pool per Mamba layer ({cfg.n_layer}); got {len(plan.ends)} ends, {len(plan.rows)} rows, "
                         f"{len(plan.conv)} conv and {len(plan.ssm)} ssm pools")
    R = plan.ssm[0].shape[0]
    offsets, first = [], 0  # each sequence's first chunk row: chunks never cross a sequence
    for b in range(nseq):
        offsets.append(first)
        first += -(-(cu[b + 1] - cu[b]) // chunk)
    for b, end, row in zip(plan.seq, plan.ends, plan.rows):
        if not 0 <= b < nseq or not 0 <= row < R:
            raise ValueError(f"{who}: snapshot of sequence {b} into row {row}: sequences lie in [0, {nseq}), "
                             f"rows in [0, {R})")
        if end % chunk or not state_len <= end <= cu[b + 1] - cu[b]:
            raise ValueError(f"{who}: a snapshot of sequence {b} after {end} tokens: the end must be a multiple "
                             f"of the chunk size {chunk}, at least the conv state's {state_len} columns and at "
                             f"most the sequence's {cu[b + 1] - cu[b]} tokens")
    conv_tokens = [cu[b] + end - state_len + j for b, end in zip(plan.seq, plan.ends) for j in range(state_len)]
    chunk_rows = [offsets[b] + end // chunk - 1 for b, end in zip(plan.seq, plan.ends)]
    return SnapshotIndices(conv_tokens, chunk_rows, list(plan.rows), first)


@dataclasses.dataclass(frozen=True)
class DeviceSnapshots:
    """A prefill's snapshots with their indices already on the device: what a CUDA graph captures
    (``GraphedPrefill`` fills these buffers from ``snapshot_indices`` before each replay).

    conv_tokens [n, state_len], chunk_rows [n], rows [n]: int64 device tensors (``SnapshotIndices``'s
    lists; a graph pads them to its snapshot count, a power of two, by repeating an entry: the same
    row written twice with the same values)
    conv, ssm   the pools, one per Mamba layer (``SnapshotPlan``'s)
    n_chunks    rows of the fp32 chunk-state scratch: at least the call's chunk count
    """

    conv_tokens: torch.Tensor
    chunk_rows: torch.Tensor
    rows: torch.Tensor
    conv: Sequence[torch.Tensor]
    ssm: Sequence[torch.Tensor]
    n_chunks: int


def device_layer_snapshots(snaps: DeviceSnapshots, cfg, device: torch.device) -> Callable[[int], LayerSnapshot]:
    """Mamba layer i's ``LayerSnapshot`` as a function of i; one fp32 chunk-state scratch serves every layer."""
    scratch = torch.empty(snaps.n_chunks, cfg.nheads, cfg.headdim, cfg.d_state, dtype=torch.float32, device=device)
    return lambda i: LayerSnapshot(scratch, snaps.chunk_rows, snaps.conv_tokens, snaps.rows, snaps.conv[i],
                                   snaps.ssm[i])


def layer_snapshots(plan: SnapshotPlan, cu: list[int], state_len: int, cfg, device: torch.device,
                    who: str) -> Callable[[int], LayerSnapshot | None]:
    """Checks ``plan`` against a prefill call (``snapshot_indices``) and returns Mamba layer i's
    ``LayerSnapshot`` as a function of i (None without snapshots): the index tensors go to the device
    in one copy, one fp32 scratch for the chunk states serves every layer. ValueError (starting with
    ``who``) before anything runs when the plan does not fit the call."""
    ix = snapshot_indices(plan, cu, state_len, cfg, who)
    n = len(ix.rows)
    if n == 0:
        return lambda i: None
    idx = torch.tensor(ix.conv_tokens + ix.chunk_rows + ix.rows, dtype=torch.int64).to(device)
    k = n * state_len
    snaps = DeviceSnapshots(idx[:k].view(n, state_len), idx[k:k + n], idx[k + n:], plan.conv, plan.ssm, ix.n_chunks)
    return device_layer_snapshots(snaps, cfg, device)


@dataclasses.dataclass
class PrefixEntry:
    index: int  # row of the pool
    tokens: tuple[int, ...]
    pages: list[int] = dataclasses.field(default_factory=list)  # K/V pages of the prefix pool (hybrids)

    @property
    def length(self) -> int:
        return len(self.tokens)


def _mamba_part(cache) -> StateCache:
    """The ``StateCache`` of a ``StateCache`` or of a ``HybridCache`` (its Mamba slots)."""
    return cache if isinstance(cache, StateCache) else cache.state


class PrefixCache:
    """A bounded LRU pool of state snapshots for the slots of one model's cache.

    cache         the engine's StateCache, or its HybridCache (Mamba slots and paged K/V): the
                  snapshot rows mirror the per-layer conv and SSM pools (same shapes and dtypes)
    max_entries   snapshots kept; or ``budget_bytes``: as many as fit (at least one, at most
                  MAX_ENTRIES_FROM_BUDGET: a small model's snapshots are tiny). With K/V, half the
                  budget goes to the snapshots' states and the rest to K/V pages
    kv_pages      with K/V: pages of the K/V pool (default from the budget, else room for every
                  snapshot at the cache's longest request)
    min_length    prefixes shorter than this are not worth a snapshot (``save`` skips them)
    """

    def __init__(self, cache, *, max_entries: int | None = None, budget_bytes: int | None = None,
                 min_length: int = 1, kv_pages: int | None = None):
        kv = cache.kv
        state = _mamba_part(cache)
        if state is None:
            raise ValueError("PrefixCache: the cache has no Mamba slots (an attention-only model keeps no states)")
        per_entry = sum(c[0].numel() * c.element_size() for c in state.conv) + \
            sum(s[0].numel() * s.element_size() for s in state.ssm)
        if max_entries is None:
            if budget_bytes is None:
                raise ValueError("PrefixCache: give max_entries or budget_bytes")
            max_entries = min((budget_bytes // 2 if kv is not None else budget_bytes) // per_entry,
                              MAX_ENTRIES_FROM_BUDGET)
        if not (isinstance(max_entries, int) and max_entries >= 1):
            raise ValueError(f"PrefixCache: room for at least one snapshot of {per_entry} bytes is needed, got "
                             f"max_entries={max_entries} (budget_bytes={budget_bytes})")
        self.kv = kv
        self.kv_k: list[torch.Tensor] = []
        self.kv_v: list[torch.Tensor] = []
        self._kv_free: list[int] = []
        if kv is not None:
            k0 = kv.k[0]
            page_bytes = 2 * len(kv.k) * k0[0].numel() * k0.element_size()
            if kv_pages is None:
                kv_pages = ((budget_bytes - max_entries * per_entry) // page_bytes if budget_bytes is not None
                            else max_entries * kv.max_pages_per_row)
            if not (isinstance(kv_pages, int) and kv_pages >= 1):
                raise ValueError(f"PrefixCache: room for at least one K/V page of {page_bytes} bytes is needed, got "
                                 f"kv_pages={kv_pages} (budget_bytes={budget_bytes})")
            self.kv_k = [torch.empty((kv_pages, *k.shape[1:]), dtype=k.dtype, device=k.device) for k in kv.k]
            self.kv_v = [torch.empty((kv_pages, *v.shape[1:]), dtype=v.dtype, device=v.device) for v in kv.v]
            self._kv_free = list(range(kv_pages - 1, -1, -1))
        self.kv_pages = kv_pages if kv is not None else 0
        self.bytes_per_entry = per_entry
        self.max_entries = max_entries
        self.min_length = max(1, int(min_length))
        # stacked like the StateCache's pools ([n_layer, entries, ...]): a snapshot is one strided row
        c0, s0 = state.conv_stack, state.ssm_stack
        self.conv_stack = torch.empty((c0.shape[0], max_entries, *c0.shape[2:]), dtype=c0.dtype, device=c0.device)
        self.ssm_stack = torch.empty((s0.shape[0], max_entries, *s0.shape[2:]), dtype=s0.dtype, device=s0.device)
        self.conv = list(self.conv_stack.unbind(0))
        self.ssm = list(self.ssm_stack.unbind(0))
        self._by_key: dict[tuple[int, ...], PrefixEntry] = {}  # tokens -> entry
        self._lru: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # pool row -> key, oldest first
        self._free = list(range(max_entries - 1, -1, -1))
        self._lengths: dict[int, int] = {}  # length -> snapshots of that length
        self.stats = {"lookups": 0, "hits": 0, "prompt_tokens": 0, "hit_tokens": 0, "saves": 0, "evictions": 0}

    def __len__(self) -> int:
        return len(self._lru)

    def _evict_one(self, protect: frozenset[int] | set[int] = frozenset()) -> int | None:
        """Drop the least recently used snapshot outside ``protect`` (pool rows); its row, or None."""
        for index in self._lru:
            if index not in protect:
                break
        else:
            return None
        self._forget(index)
        self.stats["evictions"] += 1
        return index

    def clear(self) -> None:
        """Forget every snapshot and zero the counters."""
        self._by_key.clear()
        self._lru.clear()
        self._lengths.clear()
        self._free = list(range(self.max_entries - 1, -1, -1))
        self._kv_free = list(range(self.kv_pages - 1, -1, -1))
        self.stats = dict.fromkeys(self.stats, 0)

    def _forget(self, index: int) -> None:
        key = self._lru.pop(index)
        self._kv_free.extend(reversed(self._by_key.pop(key).pages))
        self._lengths[len(key)] -= 1
        if not self._lengths[len(key)]:
            del self._lengths[len(key)]

    def lookup(self, tokens: Sequence[int]) -> PrefixEntry | None:
        """The snapshot of exactly ``tokens`` (refreshed in the LRU order), or None. No stats counted."""
        entry = self._by_key.get(as_tokens(tokens))
        if entry is None:
            return None
        self._lru.move_to_end(entry.index)
        return entry

    def claim(self, tokens: Sequence[int], protect: frozenset[int] | set[int] = frozenset()) -> PrefixEntry | None:
        """Register a snapshot of ``tokens`` whose states the caller is about to write into row
        ``entry.index`` of ``conv`` / ``ssm`` (e.g. from inside a prefill). Returns None when there
        is nothing to write: the prefix is shorter than ``min_length``, already cached (then only
        refreshed), or every row is taken by ``protect`` (rows claimed earlier in the same step, whose
        writes are still pending). If the write does not happen, ``drop`` the entry."""
        tokens = as_tokens(tokens)
        if len(tokens) < self.min_length or self.lookup(tokens) is not None:
            return None
        key = tokens
        index = self._free.pop() if self._free else self._evict_one(protect)
        if index is None:
            return None
        entry = PrefixEntry(index, tokens)
        self._by_key[key] = entry
        self._lru[index] = key
        self._lengths[len(key)] = self._lengths.get(len(key), 0) + 1
        self.stats["saves"] += 1
        return entry

    def drop(self, entry: PrefixEntry) -> None:
        """Forget a claimed entry whose states were never written (its row becomes free)."""
        if self._by_key.get(entry.tokens) is entry:
            self._forget(entry.index)
            self._free.append(entry.index)
            self.stats["saves"] -= 1

    def save(self, tokens: Sequence[int], cache, slot: int) -> PrefixEntry | None:
        """Snapshot slot ``slot``'s states as the states after ``tokens`` (with K/V: the K/V of its
        first ``len(tokens)`` positions too, which the slot must hold). An existing snapshot of the
        same prefix is refreshed in the LRU order instead. Returns the entry (None if skipped)."""
        state = _mamba_part(cache)
        if not 0 <= slot < state.num_slots:
            raise ValueError(f"PrefixCache.save: slot {slot} outside [0, {state.num_slots})")
        tokens = as_tokens(tokens)
        if self.kv is not None and cache.length(slot) < len(tokens):
            raise ValueError(f"PrefixCache.save: slot {slot} holds the K/V of {cache.length(slot)} tokens, fewer than "
                             f"the snapshot's {len(tokens)}")
        existing = self.lookup(tokens)
        if existing is not None:
            return existing
        entry = self.claim(tokens)
        if entry is None:
            return None
        if self.kv is not None and not self.claim_pages(entry):
            self.drop(entry)
            return None
        i = entry.index
        copy_rows((self.conv_stack, self.ssm_stack), i, (state.conv_stack, state.ssm_stack), slot)
        if entry.pages:
            self.copy_kv_in(entry, cache, slot)
        return entry

    def claim_pages(self, entry: PrefixEntry, protect: frozenset[int] | set[int] = frozenset()) -> bool:
        """Give a claimed ``entry`` the K/V pages its length needs (hybrids), evicting snapshots
        other than it and ``protect`` (rows) while too few are free; False (nothing taken) when the
        pool cannot hold them. Their contents come from ``copy_kv_in``."""
        need = -(-entry.length // self.kv.page_size)
        if need > self.kv_pages:
            return False
        while len(self._kv_free) < need:
            row = self._evict_one(protect={entry.index, *protect})
            if row is None:
                return False
            self._free.append(row)  # its pages went back with it (``_forget``), and so does its row
        entry.pages = [self._kv_free.pop() for _ in range(need)]
        return True

    def copy_kv_in(self, entry: PrefixEntry, cache, slot: int) -> None:
        """Copy the K/V of slot ``slot``'s first ``entry.length`` positions (every attention layer)
        into ``entry``'s pages."""
        if cache.length(slot) < entry.length:
            raise ValueError(f"PrefixCache.copy_kv_in: slot {slot} holds the K/V of {cache.length(slot)} tokens, "
                             f"fewer than the snapshot's {entry.length}")
        src = self.kv.pages_of(slot)[:len(entry.pages)]
        self._copy_pages(self.kv_k, self.kv_v, entry.pages, self.kv.k, self.kv.v, src)

    @staticmethod
    def _copy_pages(dst_k, dst_v, dst_pages, src_k, src_v, src_pages) -> None:
        """Pages ``src_pages`` of every layer's K and V pools into pages ``dst_pages`` of ``dst_*``."""
        dev = dst_k[0].device
        d = torch.tensor(dst_pages, dtype=torch.int64).to(dev, non_blocking=True)
        s = torch.tensor(src_pages, dtype=torch.int64).to(dev, non_blocking=True)
        for dk, dv, sk, sv in zip(dst_k, dst_v, src_k, src_v):
            if dk.element_size() == 1:  # float8 pages: copied as bytes (index_copy_ has no float8 kernel)
                dk, dv, sk, sv = (t.view(torch.uint8) for t in (dk, dv, sk, sv))
            dk.index_copy_(0, d, sk.index_select(0, s))
            dv.index_copy_(0, d, sv.index_select(0, s))

    def _longest(self, prompt: Sequence[int]) -> PrefixEntry | None:
        if not self._lengths:
            return None
        # a probe needs no conversion of its elements: an int-like token hashes and compares as the
        # int it stands for, anything else can only miss (the engine's 2k-token prompt: ~40 us less
        # than as_tokens' type check on an H200 host)
        prompt = prompt if type(prompt) is tuple else tuple(prompt)
        for length in sorted(self._lengths, reverse=True):
            if length < len(prompt):
                entry = self._by_key.get(prompt[:length])
                if entry is not None:
                    return entry
        return None

    def peek(self, prompt: Sequence[int]) -> int:
        """The length ``match`` would restore for ``prompt`` (0: none), counting and touching nothing."""
        entry = self._longest(prompt)
        return 0 if entry is None else entry.length

    def match(self, prompt: Sequence[int]) -> PrefixEntry | None:
        """The longest cached prefix of ``prompt`` shorter than the prompt, or None. Counts the lookup."""
        self.stats["lookups"] += 1
        self.stats["prompt_tokens"] += len(prompt)
        best = self._longest(prompt)
        if best is not None:
            self._lru.move_to_end(best.index)
            self.stats["hits"] += 1
            self.stats["hit_tokens"] += best.length
        return best

    def restore(self, entry: PrefixEntry, cache, slot: int) -> None:
        """Copy ``entry``'s states into slot ``slot`` of ``cache`` (every layer). With K/V the slot
        must be fresh (no tokens yet): it grows by the snapshot's length (its own new pages), which
        then receive the snapshot's K/V."""
        if self._lru.get(entry.index) is not entry.tokens:  # its row holds another key (or none): no hashing
            raise ValueError("PrefixCache.restore: the entry was evicted; call match() again")
        if self.kv is not None:
            if cache.length(slot):
                raise ValueError(f"PrefixCache.restore: slot {slot} holds {cache.length(slot)} tokens already; a "
                                 "snapshot restores into a fresh slot")
            cache.grow([slot], [entry.length])  # raises before anything is copied when pages run out
            dst = self.kv.pages_of(slot)[:len(entry.pages)]
            self._copy_pages(self.kv.k, self.kv.v, dst, self.kv_k, self.kv_v, entry.pages)
        state = _mamba_part(cache)
        i = entry.index
        copy_rows((state.conv_stack, state.ssm_stack), slot, (self.conv_stack, self.ssm_stack), i)
