"""Slot pool for the per-layer conv and SSM states of a Mamba-2 model.

Every request holds one slot (an int32 row index) for its whole life; kernels read and write the
pools through those indices, so nothing is reallocated or copied while decoding.

    conv[l]  [S, E, state_len]  model dtype; state_len = W (the last W inputs of the conv), or
                                W-1+K with speculation (see below)
    ssm[l]   [S, H, P, N]       fp32 (default), bf16 or fp16

Speculative decoding (``speculate=K``, K >= 1: T = K+1 tokens verified per step) adds, with
replay-based rollback (``fastmamba.ops.replay``; nothing is copied when drafts are rejected):

    replay[l]     ReplayCache for T tokens (history ``default_history(T)``); its ``state`` *is*
                  ssm[l] (one tensor: prefill writes it, the verify step replays onto it and
                  stores it at checkpoints). All layers share one ``buf_idx``, ``prev_accepted``
                  and ``hist_len`` [S] int32, since every layer accepts the same tokens, so a
                  commit is one call for the whole model. Between checkpoints ssm[l] lags behind
                  the request: ``flush`` stores the replayed states (before a plain decode step
                  or any other reader of ssm[l]).
    conv_accepted [S] int32  the conv's ``num_accepted_tokens`` for the slot's next verify step

The conv state then keeps W-1+K columns, the most that a verify step can need
(``causal_conv1d_update`` with ``num_accepted_tokens`` a reads the history ending at column
a+W-3). Prefill writes the prompt's last state_len inputs right-aligned (``causal_conv1d_varlen``),
i.e. its history ends at the last column, which is a = state_len - W + 2 = T. So a slot fresh from
prefill has ``conv_accepted = T`` and ``prev_accepted = 0`` (``mark_prefilled``); after a verify
step that accepted a of its T inputs, both are a (``commit``).
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from fastmamba.layers.mamba2 import MambaLayerConfig

from fastmamba.ops.replay import ReplayCache, commit_accepted, default_history, flush_replay_cache, reset_history
from fastmamba.ops.runtime import host_reads_allowed, scatter_rows, trusted_inputs



class StateCache:
    paged = False  # no per-slot lengths, no ``grow``: the slots' rows are all there is
    kv = None  # no attention part

    def __init__(
        self,
        cfg: MambaLayerConfig,
        num_slots: int,
        *,
        device: torch.device | str,
        conv_dtype: torch.dtype = torch.bfloat16,
        ssm_dtype: torch.dtype = torch.float32,
        speculate: int = 0,
    ):
        if ssm_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"StateCache: ssm_dtype must be float32, bfloat16 or float16, got {ssm_dtype}")
        if num_slots < 1:
            raise ValueError(f"StateCache: num_slots must be >= 1, got {num_slots}")
        if not (isinstance(speculate, int) and speculate >= 0):
            raise ValueError(f"StateCache: speculate must be an int >= 0 (0 = off), got {speculate!r}")
        self.cfg = cfg
        self.num_slots = num_slots
        self.speculate = speculate
        W = cfg.d_conv
        state_len = W - 1 + speculate if speculate else W
        # every layer's pool is a view of one stacked tensor per kind: a slot's states in all layers
        # are then one strided tensor, copied or zeroed by one kernel (prefix-cache restores)
        self.conv_stack = torch.zeros(cfg.n_layer, num_slots, cfg.conv_dim, state_len, device=device, dtype=conv_dtype)
        self.ssm_stack = torch.zeros(cfg.n_layer, num_slots, cfg.nheads, cfg.headdim, cfg.d_state, device=device,
                                     dtype=ssm_dtype)
        self.conv = list(self.conv_stack.unbind(0))
        self.ssm = list(self.ssm_stack.unbind(0))
        self.replay: list[ReplayCache] = []
        self.conv_accepted: torch.Tensor | None = None
        if speculate:
            T, S = speculate + 1, num_slots
            H, P, N, G = cfg.nheads, cfg.headdim, cfg.d_state, cfg.ngroups
            C = default_history(T)
            self.buf_idx = torch.zeros(S, dtype=torch.int32, device=device)
            self.prev_accepted = torch.zeros(S, dtype=torch.int32, device=device)
            self.hist_len = torch.zeros(S, dtype=torch.int32, device=device)
            self.conv_accepted = torch.full((S,), T, dtype=torch.int32, device=device)
            for ssm in self.ssm:
                self.replay.append(ReplayCache(
                    state=ssm,
                    old_x=torch.zeros(S, C, H, P, dtype=conv_dtype, device=device),
                    old_B=torch.zeros(2, S, C, G, N, dtype=conv_dtype, device=device),
                    old_dt=torch.zeros(2, S, C, H, dtype=torch.float32, device=device),
                    old_cumA=torch.zeros(2, S, C, H, dtype=torch.float32, device=device),
                    buf_idx=self.buf_idx,
                    prev_accepted=self.prev_accepted,
                    hist_len=self.hist_len,
                ))
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out 0, 1, 2, ...

    @property
    def tokens_per_step(self) -> int:
        """T = K+1, the tokens a verify step takes per request (1 without speculation)."""
        return self.speculate + 1

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self, n: int = 1) -> torch.Tensor:
        """Take ``n`` slots, zero their states, return them as an int32 tensor on the cache's device.

        n  an int >= 0 (0: an empty tensor). Raises TypeError for a non-int, ValueError for a
        negative n, RuntimeError when fewer than n slots are free; nothing is taken then.
        """
        if not isinstance(n, numbers.Integral) or isinstance(n, bool):
            raise TypeError(f"StateCache.alloc: n must be an int (the number of slots), got {type(n).__name__} {n!r}")
        n = int(n)
        if n < 0:
            raise ValueError(f"StateCache.alloc: n must be >= 0, got {n}")
        if n > len(self._free):
            raise RuntimeError(f"StateCache.alloc: {n} slots requested but only {len(self._free)} of "
                               f"{self.num_slots} are free (free finished requests' slots first)")
        slots = [self._free.pop() for _ in range(n)]
        idx = torch.tensor(slots, dtype=torch.int32, device=self.conv[0].device)
        for conv, ssm in zip(self.conv, self.ssm):
            conv[idx.long()] = 0
            ssm[idx.long()] = 0
        if self.speculate:
            self.mark_prefilled(idx)
        return idx

    def take(self, n: int = 1, *, zero: Sequence[bool] | None = None) -> list[int]:
        """``alloc`` for a caller that wants host ints (the engine): the same slots, zeroed states
        (one kernel per kind and slot over every layer's rows, not a kernel per layer), no
        device-to-host read. ``zero``: n bools, False leaves that slot's rows as they are, for a
        caller that overwrites all of them next (a prefix-cache restore)."""
        if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 0:
            raise ValueError(f"StateCache.take: n must be an int >= 0, got {n!r}")
        if zero is not None and (not isinstance(zero, Sequence) or isinstance(zero, str) or len(zero) != n):
            got = f"{len(zero)}" if isinstance(zero, Sequence) else f"a {type(zero).__name__}"
            raise ValueError(f"StateCache.take: `zero` expected {n} bools (one per slot), got {got}")
        if n > len(self._free):
            raise RuntimeError(f"StateCache.take: {n} slots requested but only {len(self._free)} of "
                               f"{self.num_slots} are free (free finished requests' slots first)")
        slots = [self._free.pop() for _ in range(n)]
        wipe = slots if zero is None else [s for s, z in zip(slots, zero) if z]
        for s in wipe:  # all layers' rows of a slot: one strided tensor per kind
            self.conv_stack[:, s].zero_()
            self.ssm_stack[:, s].zero_()
        if slots and self.speculate:  # every taken slot, zeroed or about to be restored
            self.mark_prefilled(torch.tensor(slots, dtype=torch.int32).to(self.conv[0].device, non_blocking=True))
        return slots

    def free(self, slots: torch.Tensor | list[int]) -> None:
        """Give ``slots`` back (a 1-D integer tensor or a sequence of ints; one host read of a tensor).

        Every slot must be allocated and appear once: otherwise ValueError naming the slot, and no
        slot of the call is freed.
        """
        if isinstance(slots, torch.Tensor):
            if slots.dim() > 1 or slots.is_floating_point() or slots.is_complex() or slots.dtype == torch.bool:
                raise TypeError(f"StateCache.free: slots must be a 1-D integer tensor or a sequence of ints, got a "
                                f"tensor of shape {tuple(slots.shape)} and dtype {slots.dtype}")
            values = slots.reshape(-1).tolist()
        else:
            values = list(slots)
        free, seen = set(self._free), set()
        for s in values:
            if not isinstance(s, numbers.Integral) or isinstance(s, bool):
                raise TypeError(f"StateCache.free: slots must be ints, got {type(s).__name__} {s!r}")
            if not 0 <= s < self.num_slots:
                raise ValueError(f"StateCache.free: slot {s} is outside [0, {self.num_slots})")
            if s in seen:
                raise ValueError(f"StateCache.free: slot {s} appears twice in {values}; nothing was freed")
            if s in free:
                raise ValueError(f"StateCache.free: slot {s} is not allocated (already free); nothing was freed")
            seen.add(s)
        self._free.extend(int(s) for s in values)

    # ------------------------------------------------------------------ speculative decoding

    def _require_speculative(self, who: str) -> None:
        if not self.speculate:
            raise RuntimeError(f"StateCache.{who}: the cache was built without speculation (speculate=0)")

    def mark_prefilled(self, slots: torch.Tensor, *, pad_slot_id: int = -1) -> None:
        """Slots whose states a prefill just wrote: nothing to replay (``prev_accepted = hist_len
        = 0``) and a conv history that ends at the last column (``conv_accepted = T``). No host sync."""
        self._require_speculative("mark_prefilled")
        self.mark_replay_fresh(slots, pad_slot_id=pad_slot_id)
        full = torch.full((slots.shape[0],), self.tokens_per_step, dtype=torch.int32, device=slots.device)
        scatter_rows(self.conv_accepted, slots, full, pad_slot_id)

    def commit(self, slots: torch.Tensor, accepted: torch.Tensor, *, pad_slot_id: int = -1) -> None:
        """Commit a verify step: request b kept the first ``accepted[b]`` of its T inputs (1..T).

        slots     [B] int32/int64, the verify step's slots (pad_slot_id rows skipped)
        accepted  [B] integer in 1..T: the last emitted token plus the accepted drafts
        Moves the replay history on for every layer at once (``commit_accepted``: one small kernel)
        and sets ``conv_accepted`` for the next conv update. Must follow every verify step, before
        the next one on these slots. Checks the range on the host (one sync) unless a CUDA graph
        is being captured.
        """
        self._require_speculative("commit")
        T = self.tokens_per_step
        if host_reads_allowed(accepted):
            bad = (accepted < 1) | (accepted > T)
            if bool(bad.any()):
                raise ValueError(f"StateCache.commit: accepted counts must lie in [1, {T}]; got {accepted[bad][:4].tolist()}")
        commit_accepted(self.buf_idx, self.prev_accepted, self.hist_len, slots, accepted, tokens=T,
                        history=self.replay[0].history, pad_slot_id=pad_slot_id, check=False)
        scatter_rows(self.conv_accepted, slots, accepted, pad_slot_id)

    def flush(self, slots: torch.Tensor, *, pad_slot_id: int = -1) -> None:
        """Store the slots' replayed SSM states in every layer (``flush_replay_cache``) and empty
        their replay histories, so that ssm[l][slot] is the request's state after its last
        committed token. The conv state needs nothing (``conv_accepted`` already locates its
        window). No host sync besides the slot check (once, skipped while capturing)."""
        self._require_speculative("flush")
        # the counters are shared: reset them once, after every layer; the slots are checked by
        # the first layer's call (one host read), the other layers trust them
        flush_replay_cache(self.replay[0], slots, pad_slot_id=pad_slot_id, reset=False)
        with trusted_inputs():
            for replay in self.replay[1:]:
                flush_replay_cache(replay, slots, pad_slot_id=pad_slot_id, reset=False)
        self.mark_replay_fresh(slots, pad_slot_id=pad_slot_id)

    # ------------------------------------------------------------------ legacy and plain verify paths
    # (issue 5, items 5-6: the engine picks replay, legacy or plain per step; see Mamba2LM.verify)

    legacy_max_batch: int = 8  # default bound for the legacy buffers; reserve_legacy() changes it
    _legacy_inter: list[torch.Tensor] | None = None
    _no_dst: dict[int, torch.Tensor] | None = None

    def commit_path(self, slots: torch.Tensor, accepted: torch.Tensor, path: str, who: str) -> None:
        """After a verify step on ``path``: "replay" ``commit``, "legacy" ``commit_legacy``, "plain"
        ``commit_plain``; ValueError naming ``who`` for another path. (The models' ``commit``.)"""
        if path == "replay":
            self.commit(slots, accepted)
        elif path == "legacy":
            self.commit_legacy(slots, accepted)
        elif path == "plain":
            self.commit_plain(slots)
        else:
            raise ValueError(f'{who}: `path` expected "replay", "legacy" or "plain", got {path!r}')

    def reserve_legacy(self, max_batch: int) -> None:
        """Bound the legacy (per-position) path to ``max_batch`` requests per step. Its buffers,
        n_layer x [max_batch, T, H, P, N] in the SSM state dtype, are allocated at the first legacy
        step (``legacy_intermediate``); a different bound drops any allocated ones."""
        self._require_speculative("reserve_legacy")
        if not (isinstance(max_batch, int) and max_batch >= 1):
            raise ValueError(f"StateCache.reserve_legacy: max_batch must be an int >= 1, got {max_batch!r}")
        if max_batch != self.legacy_max_batch:
            self._legacy_inter = None
        self.legacy_max_batch = max_batch

    def legacy_intermediate(self, nreq: int) -> list[torch.Tensor]:
        """Per layer, the legacy path's per-position states [nreq, T, H, P, N] (SSM state dtype;
        views of buffers allocated on first use for ``legacy_max_batch`` rows): row b, position t
        holds request b's state after its t+1-th input of the step (``selective_state_update``'s
        ``intermediate_states``), until the next legacy step. Raises if nreq > legacy_max_batch."""
        self._require_speculative("legacy_intermediate")
        if not 1 <= nreq <= self.legacy_max_batch:
            raise ValueError(
                f"StateCache: the legacy verify path holds a state per position for at most legacy_max_batch="
                f"{self.legacy_max_batch} requests, got a step of {nreq}; use the replay path for larger batches "
                f"or raise the bound with reserve_legacy(n) (n_layer x n x T x H x P x N states of memory)")
        if self._legacy_inter is None:
            c, ssm = self.cfg, self.ssm[0]
            shape = (self.legacy_max_batch, self.tokens_per_step, c.nheads, c.headdim, c.d_state)
            with torch.inference_mode(False):  # plain tensors, whichever mode the first step runs in
                self._legacy_inter = [torch.empty(shape, dtype=ssm.dtype, device=ssm.device) for _ in self.ssm]
        return [t[:nreq] for t in self._legacy_inter]

    def legacy_no_dst(self, nreq: int) -> torch.Tensor:
        """[nreq] int32 of -1 on the cache's device: the legacy path's ``dst_state_batch_indices``
        (the multi-token update then writes no final state; ``commit_legacy`` copies the accepted
        one). One tensor per size, made outside inference mode, so the ops' index check reads it
        on the host only once."""
        if self._no_dst is None:
            self._no_dst = {}
        if nreq not in self._no_dst:
            with torch.inference_mode(False):
                self._no_dst[nreq] = torch.full((nreq,), -1, dtype=torch.int32, device=self.ssm[0].device)
        return self._no_dst[nreq]

    def mark_replay_fresh(self, slots: torch.Tensor, *, pad_slot_id: int = -1) -> None:
        """Slots whose SSM state was just written by another path (legacy commit, plain step):
        nothing to replay (``reset_history``: hist_len = prev_accepted = 0). No host sync."""
        self._require_speculative("mark_replay_fresh")
        reset_history(self.replay[0], slots, pad_slot_id=pad_slot_id)  # the counters are shared by every layer

    def commit_legacy(self, slots: torch.Tensor, accepted: torch.Tensor, *, pad_slot_id: int = -1) -> None:
        """Commit a legacy verify step: request b kept the first ``accepted[b]`` of its T inputs (1..T).

        slots     [B] int32/int64, the step's slots; pad_slot_id rows are skipped (they repeat the
                  first live row's copy: the same bytes to the same slot), at least one row live
        accepted  [B] integer in 1..T (pad rows: anything)
        Per layer ``ssm[l][slots[b]] = intermediate[b, accepted[b] - 1]`` (one gather and one
        ``index_copy_``), then ``conv_accepted = accepted`` and nothing to replay. No host sync
        except the range check (one sync), which is skipped while a CUDA graph is being captured.
        The slots' replay histories must have been flushed before the verify step.
        """
        self._require_speculative("commit_legacy")
        T, nreq = self.tokens_per_step, slots.shape[0]
        if tuple(accepted.shape) != (nreq,):
            raise ValueError(f"StateCache.commit_legacy: `accepted` expected shape (B,)=({nreq},), "
                             f"got {tuple(accepted.shape)}")
        live = slots != pad_slot_id
        if host_reads_allowed(accepted):
            bad = live & ((accepted < 1) | (accepted > T))
            flags = torch.stack([bad.any(), live.any()]).tolist()
            if flags[0]:
                raise ValueError(f"StateCache.commit_legacy: accepted counts must lie in [1, {T}]; "
                                 f"got {accepted[bad][:4].tolist()}")
            if not flags[1]:
                raise ValueError("StateCache.commit_legacy: every slot is pad_slot_id; nothing to commit")
        inter = self.legacy_intermediate(nreq)
        first_live = torch.argmax(live.to(torch.int32))
        rows = torch.where(live, torch.arange(nreq, device=slots.device), first_live)
        dest = slots.long()[rows]
        pos = (accepted.long()[rows] - 1).clamp(0, T - 1)
        for ssm, states in zip(self.ssm, inter):
            ssm.index_copy_(0, dest, states[rows, pos])
        scatter_rows(self.conv_accepted, slots, accepted, pad_slot_id)
        self.mark_replay_fresh(slots, pad_slot_id=pad_slot_id)

    def commit_plain(self, slots: torch.Tensor, *, pad_slot_id: int = -1) -> None:
        """Commit a plain step (one input per request, its state written in place): the conv
        history again ends at the last column (``conv_accepted = T``, as after prefill) and there
        is nothing to replay. No host sync."""
        self._require_speculative("commit_plain")
        self.mark_prefilled(slots, pad_slot_id=pad_slot_id)  # the same bookkeeping as after a prefill
