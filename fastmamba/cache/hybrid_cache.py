"""One owner of a model's per-request caches: Mamba-2 slots and paged attention KV.

A request takes one slot (``alloc``) for its whole life and gives it back once (``free``). The
slot is its row in every Mamba layer's conv / SSM pool (a ``StateCache``) and its row of the
shared KV page table (``KVPages``); pages follow its length (``grow`` before each prefill or
decode step writes tokens) and all go back with the slot. Layers find their slice by their
ordinal among the layers of their kind: ``conv[j]`` / ``ssm[j]`` for the j-th Mamba layer,
``kv.k[j]`` / ``kv.v[j]`` for the j-th attention layer. A fourth layer kind with its own per-request
state adds its pool here and keeps the same alloc / free.

A pure Mamba-2 LM's cache is this class with an empty attention part and ``paged=False``: no
per-slot lengths and no ``grow`` (its slots' rows are all there is; the model reads nothing on the
host per step), slot bookkeeping and speculative state as its ``StateCache`` (``state``) keeps them.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from fastmamba.cache.kv_pages import KVPages
from fastmamba.cache.state_cache import StateCache
from fastmamba.layers.mamba2 import MambaLayerConfig



class HybridCache:
    def __init__(
        self,
        max_batch: int,
        *,
        mamba_cfg: MambaLayerConfig | None,
        n_attn_layers: int,
        n_kv_heads: int = 1,
        head_dim: int = 1,
        max_seq_len: int = 4096,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_budget_bytes: int | None = None,
        device: torch.device | str,
        dtype: torch.dtype = torch.bfloat16,
        ssm_dtype: torch.dtype = torch.float32,
        speculate: int = 0,
        paged: bool = True,
        kv_dtype: torch.dtype | None = None,
    ):
        """max_batch    requests held at once (slots)
        mamba_cfg      the Mamba layers' config (``n_layer`` = their count) or None without any
        n_attn_layers  attention layers (0: no KV pools); n_kv_heads, head_dim their K/V shape
        max_seq_len    the most tokens one request may hold (its page-table width)
        page_size      tokens per page (a power of two)
        num_pages      pages in the pool; default from ``kv_budget_bytes`` when given, else enough
                       for every slot at ``max_seq_len``
        speculate      K >= 1: the Mamba pools get what speculative verify with T = K+1 needs
                       (``StateCache(speculate=K)``: replay histories, legacy buffers); the KV
                       needs nothing more (a verify step grows it by T tokens, the commit
                       shortens it to the accepted ones: ``rollback``)
        kv_dtype       the K/V pages' dtype (``KVPages``: float8_e4m3fn halves them); None: ``dtype``
        paged          True: each slot's length is tracked (``grow`` before a step writes tokens,
                       ``rollback``; K/V pages with attention layers). False (a pure Mamba-2 LM):
                       no lengths, no attention layers, slots as the ``StateCache`` hands them out
        """
        if not (isinstance(max_batch, int) and max_batch >= 1):
            raise ValueError(f"HybridCache: `max_batch` expected a positive integer, got {max_batch!r}")
        if not (isinstance(max_seq_len, int) and max_seq_len >= 1):
            raise ValueError(f"HybridCache: `max_seq_len` expected a positive integer, got {max_seq_len!r}")
        if num_pages is not None and kv_budget_bytes is not None:
            raise ValueError("HybridCache: pass `num_pages` or `kv_budget_bytes`, not both")
        self.max_batch = max_batch
        self.paged = paged
        if not paged and (mamba_cfg is None or n_attn_layers):
            raise ValueError("HybridCache: paged=False is the cache of a pure Mamba-2 model (Mamba layers, no "
                             f"attention layers), got mamba_cfg={mamba_cfg!r}, n_attn_layers={n_attn_layers}")
        if speculate and mamba_cfg is None:
            raise ValueError("HybridCache: speculate needs Mamba layers (an attention-only model has no verify path)")
        self.speculate = speculate
        self.state = (StateCache(mamba_cfg, max_batch, device=device, conv_dtype=dtype, ssm_dtype=ssm_dtype,
                                 speculate=speculate)
                      if mamba_cfg is not None else None)
        self.kv: KVPages | None = None
        if n_attn_layers:
            kv_dtype = kv_dtype or dtype
            max_pages = -(-max_seq_len // page_size)
            if kv_budget_bytes is not None:
                num_pages = kv_budget_bytes // KVPages.page_bytes(n_attn_layers, page_size, n_kv_heads, head_dim,
                                                                  kv_dtype)
                if num_pages < 1:
                    raise ValueError(f"HybridCache: `kv_budget_bytes`={kv_budget_bytes} is less than one page")
            elif num_pages is None:
                num_pages = max_batch * max_pages
            self.kv = KVPages(n_attn_layers, num_pages, max_batch, max_pages, page_size=page_size,
                              n_kv_heads=n_kv_heads, head_dim=head_dim, device=device, dtype=kv_dtype)
        self.device = torch.device(device)
        self._free = list(range(max_batch - 1, -1, -1))
        self._len = [0] * max_batch  # tokens each slot has consumed (its KV length too)
        # the per-layer slices (plain attributes: the layers read them every step), the Mamba part
        # of speculative decoding, as the StateCache holds them
        state = self.state
        self.conv: list[torch.Tensor] = state.conv if state is not None else []
        self.ssm: list[torch.Tensor] = state.ssm if state is not None else []
        self.replay = state.replay if state is not None else []
        self.conv_accepted: torch.Tensor | None = state.conv_accepted if state is not None else None
        self.conv_stack = state.conv_stack if state is not None else None
        self.ssm_stack = state.ssm_stack if state is not None else None
        self.cfg = mamba_cfg
        for name in ("buf_idx", "prev_accepted", "hist_len"):  # the replay counters shared by every layer
            setattr(self, name, getattr(state, name, None))

    # -- speculative decoding: the Mamba pools' part (``StateCache``'s) -------------------------------

    @property
    def tokens_per_step(self) -> int:
        return self.state.tokens_per_step if self.state is not None else 1

    @property
    def legacy_max_batch(self) -> int:
        return self.state.legacy_max_batch

    def mark_prefilled(self, slots: torch.Tensor, *, pad_slot_id: int = -1) -> None:
        self.state.mark_prefilled(slots, pad_slot_id=pad_slot_id)

    def reserve_legacy(self, max_batch: int) -> None:
        self.state.reserve_legacy(max_batch)

    def legacy_intermediate(self, nreq: int) -> list[torch.Tensor]:
        return self.state.legacy_intermediate(nreq)

    def legacy_no_dst(self, nreq: int) -> torch.Tensor:
        return self.state.legacy_no_dst(nreq)

    def flush(self, slots: torch.Tensor, *, pad_slot_id: int = -1) -> None:
        self.state.flush(slots, pad_slot_id=pad_slot_id)

    def commit(self, slots: torch.Tensor, accepted: torch.Tensor, *, pad_slot_id: int = -1) -> None:
        self.state.commit(slots, accepted, pad_slot_id=pad_slot_id)

    def commit_legacy(self, slots: torch.Tensor, accepted: torch.Tensor, *, pad_slot_id: int = -1) -> None:
        self.state.commit_legacy(slots, accepted, pad_slot_id=pad_slot_id)

    def commit_plain(self, slots: torch.Tensor, *, pad_slot_id: int = -1) -> None:
        self.state.commit_plain(slots, pad_slot_id=pad_slot_id)

    def commit_path(self, slots: torch.Tensor, accepted: torch.Tensor, path: str, who: str) -> None:
        self.state.commit_path(slots, accepted, path, who)

    def rollback(self, slots: list[int], drop: list[int]) -> None:
        """After a verify step: slot ``slots[i]`` forgets its last ``drop[i]`` tokens (the rejected
        drafts' K/V; their pages past the new length go back to the pool). Host lists; one sync
        of the device block table and lengths."""
        for s, d in zip(slots, drop):
            if not 0 <= s < self.max_batch or s in self._free or not 0 <= d <= self._len[s]:
                raise ValueError(f"HybridCache.rollback: slot {s} (allocated: {s not in self._free}) cannot drop {d} "
                                 "tokens")
        new = [self._len[s] - d for s, d in zip(slots, drop)]
        if self.kv is not None:
            self.kv.shrink(slots, new)
        for s, n in zip(slots, new):
            self._len[s] = n

    # -- requests -------------------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self.max_batch

    @property
    def free_slots(self) -> int:
        return len(self._free) if self.paged else self.state.free_slots

    @property
    def kv_pages_in_use(self) -> int:
        """KV pages held by requests (0 without attention layers)."""
        return 0 if self.kv is None else self.kv.num_pages - self.kv.free_pages

    def length(self, slot: int) -> int:
        """Tokens slot ``slot`` has consumed so far."""
        return self._len[slot]

    def alloc(self, n: int = 1) -> torch.Tensor:
        """Take ``n`` slots (zeroed Mamba states, no KV pages yet); int32 tensor on the cache's device."""
        if not self.paged:
            return self.state.alloc(n)
        if n > len(self._free):
            raise RuntimeError(f"HybridCache: {n} slots requested, {len(self._free)} of {self.max_batch} free")
        if self.state is not None:
            slots = self.state.alloc(n)
            taken = slots.tolist()
            self._free = [s for s in self._free if s not in taken]
            return slots
        taken = [self._free.pop() for _ in range(n)]
        return torch.tensor(taken, dtype=torch.int32, device=self.device)

    def take(self, n: int = 1, *, zero: Sequence[bool] | None = None) -> list[int]:
        """``alloc`` as host ints, without a device-to-host read (``StateCache.take``; ``zero``: n
        bools, False leaves that slot's Mamba rows as they are, for a prefix-cache restore)."""
        if not self.paged:
            return self.state.take(n, zero=zero)
        if n > len(self._free):
            raise RuntimeError(f"HybridCache: {n} slots requested, {len(self._free)} of {self.max_batch} free")
        if self.state is not None:
            taken = self.state.take(n, zero=zero)
            self._free = [s for s in self._free if s not in taken]
            return taken
        return [self._free.pop() for _ in range(n)]

    def free(self, slots: torch.Tensor | list[int]) -> None:
        """Give slots back: their Mamba rows and every KV page they hold. Checks all first."""
        if not self.paged:
            return self.state.free(slots)
        values = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        for s in values:
            if not 0 <= s < self.max_batch or s in self._free or values.count(s) > 1:
                raise ValueError(f"HybridCache: slot {s} is not allocated (or listed twice)")
        if self.state is not None:
            self.state.free(values)
        if self.kv is not None:
            self.kv.release(values)
        for s in values:
            self._len[s] = 0
            self._free.append(s)

    # -- KV capacity (the engine's admission control) ----------------------------------------------

    @property
    def max_len(self) -> int | None:
        """The most tokens one request can ever hold: its page-table width, or the whole pool if
        that is smaller. None without attention layers (no limit)."""
        if self.kv is None:
            return None
        return min(self.kv.max_len, self.kv.num_pages * self.kv.page_size)

    @property
    def free_pages(self) -> int | None:
        """Free KV pages (None without attention layers)."""
        return None if self.kv is None else self.kv.free_pages

    def room(self, slot: int | None, pages: int) -> int:
        """How many more tokens ``slot`` (None: a request not yet admitted, length 0) can take with
        at most ``pages`` new pages: the rest of its last page plus ``pages`` pages, capped by the
        page table's width. Without attention layers: unlimited (a large int)."""
        if self.kv is None:
            return 1 << 62
        n = 0 if slot is None else self._len[slot]
        P = self.kv.page_size
        held = -(-n // P) * P
        return max(0, min(held + max(pages, 0) * P, self.kv.max_len) - n)

    def pages_for(self, slot: int | None, new_tokens: int) -> int:
        """New pages ``slot`` (None: a fresh request) needs for ``new_tokens`` more tokens (0 without attention)."""
        if self.kv is None:
            return 0
        n = 0 if slot is None else self._len[slot]
        P = self.kv.page_size
        return -(-(n + new_tokens) // P) - -(-n // P)

    def can_grow(self, slots: list[int], new_tokens: list[int]) -> bool:
        """Whether ``grow(slots, new_tokens)`` would find enough free pages (admission control)."""
        return self.kv is None or self.kv.pages_needed(slots, new_tokens) <= self.kv.free_pages

    def grow(self, slots: list[int], new_tokens: list[int]) -> list[int]:
        """Before a step writes ``new_tokens[i]`` tokens for ``slots[i]``: allocate the KV pages they
        need; returns each slot's length before (its first new token's position). Pad slots (-1)
        are skipped (length 0). Raises before changing anything when a slot is not allocated or
        pages run out."""
        if not self.paged:
            raise RuntimeError("HybridCache.grow: this cache keeps no per-slot lengths (paged=False: a pure "
                               "Mamba-2 model's); nothing to grow")
        live = [(s, n) for s, n in zip(slots, new_tokens) if s != -1]
        for s, _ in live:
            if not 0 <= s < self.max_batch or s in self._free:
                raise ValueError(f"HybridCache.grow: slot {s} is not allocated")
        if self.kv is not None and live:
            self.kv.grow([s for s, _ in live], [n for _, n in live])
        before = [self._len[s] if s != -1 else 0 for s in slots]
        for s, n in live:
            self._len[s] += n
        return before

    def truncate(self, slot: int, new_len: int) -> None:
        """Shorten a slot's KV to ``new_len`` tokens (speculative rollback of the attention layers)."""
        if self.kv is not None:
            self.kv.truncate(slot, new_len)
        self._len[slot] = new_len
