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
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

import torch

from fastmamba.cache.state_cache import StateCache

MAX_ENTRIES_FROM_BUDGET = 4096


def as_tokens(tokens: Sequence[int]) -> tuple[int, ...]:
    """``tokens`` as a tuple of Python ints (the cache's key): a list of ints converts and is
    checked in C (``set(map(type, ...))``: no Python-level loop over a long prompt)."""
    t = tuple(tokens)
    return t if set(map(type, t)) <= {int} else tuple(int(v) for v in t)


def copy_rows(dst: Sequence[torch.Tensor], dst_row: int, src: Sequence[torch.Tensor], src_row: int) -> None:
    """``dst[k][:, dst_row] = src[k][:, src_row]`` for each stacked pool pair k ([n_layer, rows, ...]):
    all layers' states of one row in one strided copy per pool (a copy per layer costs ~10 us of
    Python each: 1 ms for a 64-layer model's 128 pools, for 0.1 ms of copying)."""
    for d, s in zip(dst, src):
        d[:, dst_row].copy_(s[:, src_row])


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


@dataclasses.dataclass
class PrefixEntry:
    index: int  # row of the pool
    tokens: tuple[int, ...]

    @property
    def length(self) -> int:
        return len(self.tokens)


class PrefixCache:
    """A bounded LRU pool of state snapshots for ``StateCache`` slots of one model.

    cache         the engine's StateCache: the snapshot rows mirror its per-layer conv and SSM pools
                  (same shapes and dtypes)
    max_entries   snapshots kept; or ``budget_bytes``: as many as fit (at least one, at most
                  MAX_ENTRIES_FROM_BUDGET: a small model's snapshots are tiny)
    min_length    prefixes shorter than this are not worth a snapshot (``save`` skips them)
    """

    def __init__(self, cache: StateCache, *, max_entries: int | None = None, budget_bytes: int | None = None,
                 min_length: int = 1):
        per_entry = sum(c[0].numel() * c.element_size() for c in cache.conv) + \
            sum(s[0].numel() * s.element_size() for s in cache.ssm)
        if max_entries is None:
            if budget_bytes is None:
                raise ValueError("PrefixCache: give max_entries or budget_bytes")
            max_entries = min(budget_bytes // per_entry, MAX_ENTRIES_FROM_BUDGET)
        if not (isinstance(max_entries, int) and max_entries >= 1):
            raise ValueError(f"PrefixCache: room for at least one snapshot of {per_entry} bytes is needed, got "
                             f"max_entries={max_entries} (budget_bytes={budget_bytes})")
        self.bytes_per_entry = per_entry
        self.max_entries = max_entries
        self.min_length = max(1, int(min_length))
        # stacked like the StateCache's pools ([n_layer, entries, ...]): a snapshot is one strided row
        c0, s0 = cache.conv_stack, cache.ssm_stack
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
        self.stats = dict.fromkeys(self.stats, 0)

    def _forget(self, index: int) -> None:
        key = self._lru.pop(index)
        del self._by_key[key]
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

    def save(self, tokens: Sequence[int], cache: StateCache, slot: int) -> PrefixEntry | None:
        """Snapshot slot ``slot``'s states as the states after ``tokens``. An existing snapshot of
        the same prefix is refreshed in the LRU order instead. Returns the entry (None if skipped)."""
        if not 0 <= slot < cache.num_slots:
            raise ValueError(f"PrefixCache.save: slot {slot} outside [0, {cache.num_slots})")
        tokens = as_tokens(tokens)
        existing = self.lookup(tokens)
        if existing is not None:
            return existing
        entry = self.claim(tokens)
        if entry is None:
            return None
        i = entry.index
        copy_rows((self.conv_stack, self.ssm_stack), i, (cache.conv_stack, cache.ssm_stack), slot)
        return entry

    def match(self, prompt: Sequence[int]) -> PrefixEntry | None:
        """The longest cached prefix of ``prompt`` shorter than the prompt, or None. Counts the lookup."""
        self.stats["lookups"] += 1
        self.stats["prompt_tokens"] += len(prompt)
        best = None
        if self._lengths:
            prompt = as_tokens(prompt)
            for length in sorted(self._lengths, reverse=True):
                if length >= len(prompt):
                    continue
                entry = self._by_key.get(prompt[:length])
                if entry is not None:
                    best = entry
                    break
        if best is not None:
            self._lru.move_to_end(best.index)
            self.stats["hits"] += 1
            self.stats["hit_tokens"] += best.length
        return best

    def restore(self, entry: PrefixEntry, cache: StateCache, slot: int) -> None:
        """Copy ``entry``'s states into slot ``slot`` of ``cache`` (every layer)."""
        if self._by_key.get(entry.tokens) is not entry:
            raise ValueError("PrefixCache.restore: the entry was evicted; call match() again")
        i = entry.index
        copy_rows((cache.conv_stack, cache.ssm_stack), slot, (self.conv_stack, self.ssm_stack), i)
