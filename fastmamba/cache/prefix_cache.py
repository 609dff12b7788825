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

Lookup hashes every prefix of the prompt once (a rolling 64-bit polynomial hash, O(L)) and checks the
candidate lengths against a dict; a hit is confirmed by comparing the stored tokens, so a hash
collision can never hand out a wrong state. Restoring copies exactly the stored bits: the output
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

_MOD = (1 << 61) - 1
_BASE = 1_000_003


def prefix_hashes(tokens: Sequence[int]) -> list[int]:
    """h[k] = hash of tokens[:k] for k = 0..len(tokens) (rolling polynomial hash mod 2^61 - 1)."""
    out = [0]
    h = 0
    for t in tokens:
        h = (h * _BASE + int(t) + 1) % _MOD
        out.append(h)
    return out


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
    max_entries   snapshots kept; or ``budget_bytes``: as many as fit (at least one)
    min_length    prefixes shorter than this are not worth a snapshot (``save`` skips them)
    """

    def __init__(self, cache: StateCache, *, max_entries: int | None = None, budget_bytes: int | None = None,
                 min_length: int = 1):
        per_entry = sum(c[0].numel() * c.element_size() for c in cache.conv) + \
            sum(s[0].numel() * s.element_size() for s in cache.ssm)
        if max_entries is None:
            if budget_bytes is None:
                raise ValueError("PrefixCache: give max_entries or budget_bytes")
            max_entries = budget_bytes // per_entry
        if not (isinstance(max_entries, int) and max_entries >= 1):
            raise ValueError(f"PrefixCache: room for at least one snapshot of {per_entry} bytes is needed, got "
                             f"max_entries={max_entries} (budget_bytes={budget_bytes})")
        self.bytes_per_entry = per_entry
        self.max_entries = max_entries
        self.min_length = max(1, int(min_length))
        self.conv = [torch.empty((max_entries, *c.shape[1:]), dtype=c.dtype, device=c.device) for c in cache.conv]
        self.ssm = [torch.empty((max_entries, *s.shape[1:]), dtype=s.dtype, device=s.device) for s in cache.ssm]
        self._by_key: dict[tuple[int, int], PrefixEntry] = {}  # (length, hash) -> entry
        self._lru: OrderedDict[int, tuple[int, int]] = OrderedDict()  # pool row -> key, oldest first
        self._free = list(range(max_entries - 1, -1, -1))
        self._lengths: dict[int, int] = {}  # length -> snapshots of that length
        self.stats = {"lookups": 0, "hits": 0, "prompt_tokens": 0, "hit_tokens": 0, "saves": 0, "evictions": 0}

    def __len__(self) -> int:
        return len(self._lru)

    def _evict_one(self) -> int:
        index, key = self._lru.popitem(last=False)
        del self._by_key[key]
        self._lengths[key[0]] -= 1
        if not self._lengths[key[0]]:
            del self._lengths[key[0]]
        self.stats["evictions"] += 1
        return index

    def save(self, tokens: Sequence[int], cache: StateCache, slot: int) -> PrefixEntry | None:
        """Snapshot slot ``slot``'s states as the states after ``tokens``. An existing snapshot of
        the same prefix is refreshed in the LRU order instead. Returns the entry (None if skipped)."""
        tokens = tuple(int(t) for t in tokens)
        if len(tokens) < self.min_length:
            return None
        if not 0 <= slot < cache.num_slots:
            raise ValueError(f"PrefixCache.save: slot {slot} outside [0, {cache.num_slots})")
        key = (len(tokens), prefix_hashes(tokens)[-1])
        hit = self._by_key.get(key)
        if hit is not None and hit.tokens == tokens:
            self._lru.move_to_end(hit.index)
            return hit
        if hit is not None:  # a colliding prefix: replace it
            self._lru.pop(hit.index)
            self._free.append(hit.index)
            self._lengths[key[0]] -= 1
        index = self._free.pop() if self._free else self._evict_one()
        for dst, src in zip(self.conv, cache.conv):
            dst[index].copy_(src[slot])
        for dst, src in zip(self.ssm, cache.ssm):
            dst[index].copy_(src[slot])
        entry = PrefixEntry(index, tokens)
        self._by_key[key] = entry
        self._lru[index] = key
        self._lengths[key[0]] = self._lengths.get(key[0], 0) + 1
        self.stats["saves"] += 1
        return entry

    def match(self, prompt: Sequence[int]) -> PrefixEntry | None:
        """The longest cached prefix of ``prompt`` shorter than the prompt, or None. Counts the lookup."""
        self.stats["lookups"] += 1
        self.stats["prompt_tokens"] += len(prompt)
        best = None
        if self._lengths:
            hashes = prefix_hashes(prompt)
            for length in sorted(self._lengths, reverse=True):
                if length >= len(prompt):
                    continue
                entry = self._by_key.get((length, hashes[length]))
                if entry is not None and entry.tokens == tuple(int(t) for t in prompt[:length]):
                    best = entry
                    break
        if best is not None:
            self._lru.move_to_end(best.index)
            self.stats["hits"] += 1
            self.stats["hit_tokens"] += best.length
        return best

    def restore(self, entry: PrefixEntry, cache: StateCache, slot: int) -> None:
        """Copy ``entry``'s states into slot ``slot`` of ``cache`` (every layer)."""
        if self._lru.get(entry.index) is None or self._by_key.get((entry.length, prefix_hashes(entry.tokens)[-1])) is not entry:
            raise ValueError("PrefixCache.restore: the entry was evicted; call match() again")
        for src, dst in zip(self.conv, cache.conv):
            dst[slot].copy_(src[entry.index])
        for src, dst in zip(self.ssm, cache.ssm):
            dst[slot].copy_(src[entry.index])
