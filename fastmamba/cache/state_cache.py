"""Slot pool for the per-layer conv and SSM states of a Mamba-2 model.

Every request holds one slot (an int32 row index) for its whole life; kernels read and write the
pools through those indices, so nothing is reallocated or copied while decoding.

    conv[l]  [S, E, state_len]  model dtype; state_len = W (the last W inputs of the conv), or
                                W-1+K with speculation (see below)
    ssm[l]   [S, H, P, N]       fp32 (default), bf16 or fp16

Speculative decoding (``speculate=K``, K >= 1: T = K+1 tokens verified per step) adds, with
replay-based rollback (``fastmamba.ops.replay``; nothing is copied when drafts are rejected):

    replay[l]     ReplayCache for T tokens; its ``state`` *is* ssm[l] (one tensor: prefill writes
                  it, the verify step replays onto it). All layers share one ``buf_idx`` and one
                  ``prev_accepted`` [S] int32, since every layer accepts the same tokens, so a
                  commit is one call for the whole model.
    conv_accepted [S] int32  the conv's ``num_accepted_tokens`` for the slot's next verify step

The conv state then keeps W-1+K columns, the most that a verify step can need
(``causal_conv1d_update`` with ``num_accepted_tokens`` a reads the history ending at column
a+W-3). Prefill writes the prompt's last state_len inputs right-aligned (``causal_conv1d_varlen``),
i.e. its history ends at the last column, which is a = state_len - W + 2 = T. So a slot fresh from
prefill has ``conv_accepted = T`` and ``prev_accepted = 0`` (``mark_prefilled``); after a verify
step that accepted a of its T inputs, both are a (``commit``).
"""
from __future__ import annotations

import torch

from fastmamba.models.config import Mamba2Config
from fastmamba.ops.replay import ReplayCache, commit_accepted


class StateCache:
    def __init__(
        self,
        cfg: Mamba2Config,
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
        self.conv = [torch.zeros(num_slots, cfg.conv_dim, state_len, device=device, dtype=conv_dtype)
                     for _ in range(cfg.n_layer)]
        self.ssm = [torch.zeros(num_slots, cfg.nheads, cfg.headdim, cfg.d_state, device=device, dtype=ssm_dtype)
                    for _ in range(cfg.n_layer)]
        self.replay: list[ReplayCache] = []
        self.conv_accepted: torch.Tensor | None = None
        if speculate:
            T, S = speculate + 1, num_slots
            H, P, N, G = cfg.nheads, cfg.headdim, cfg.d_state, cfg.ngroups
            self.buf_idx = torch.zeros(S, dtype=torch.int32, device=device)
            self.prev_accepted = torch.zeros(S, dtype=torch.int32, device=device)
            self.conv_accepted = torch.full((S,), T, dtype=torch.int32, device=device)
            for ssm in self.ssm:
                self.replay.append(ReplayCache(
                    state=ssm,
                    old_x=torch.zeros(S, T, H, P, dtype=conv_dtype, device=device),
                    old_B=torch.zeros(2, S, T, G, N, dtype=conv_dtype, device=device),
                    old_dt=torch.zeros(2, S, T, H, dtype=torch.float32, device=device),
                    old_cumA=torch.zeros(2, S, T, H, dtype=torch.float32, device=device),
                    buf_idx=self.buf_idx,
                    prev_accepted=self.prev_accepted,
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
        """Take ``n`` slots, zero their states, return them as an int32 tensor on the cache's device."""
        if n > len(self._free):
            raise RuntimeError(f"StateCache: {n} slots requested, {len(self._free)} of {self.num_slots} free")
        slots = [self._free.pop() for _ in range(n)]
        idx = torch.tensor(slots, dtype=torch.int32, device=self.conv[0].device)
        for conv, ssm in zip(self.conv, self.ssm):
            conv[idx.long()] = 0
            ssm[idx.long()] = 0
        if self.speculate:
            self.mark_prefilled(idx)
        return idx

    def free(self, slots: torch.Tensor | list[int]) -> None:
        values = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        for s in values:
            if not 0 <= s < self.num_slots or s in self._free:
                raise ValueError(f"StateCache: slot {s} is not allocated")
            self._free.append(s)

    # ------------------------------------------------------------------ speculative decoding

    def _require_speculative(self, who: str) -> None:
        if not self.speculate:
            raise RuntimeError(f"StateCache.{who}: the cache was built without speculation (speculate=0)")

    def mark_prefilled(self, slots: torch.Tensor, *, pad_slot_id: int = -1) -> None:
        """Slots whose states a prefill just wrote: nothing to replay (``prev_accepted = 0``) and a
        conv history that ends at the last column (``conv_accepted = T``). No host sync."""
        self._require_speculative("mark_prefilled")
        zeros = torch.zeros(slots.shape[0], dtype=torch.int32, device=slots.device)
        commit_accepted(self.buf_idx, self.prev_accepted, slots, zeros, pad_slot_id=pad_slot_id)
        _scatter(self.conv_accepted, slots, zeros + self.tokens_per_step, pad_slot_id)

    def commit(self, slots: torch.Tensor, accepted: torch.Tensor, *, pad_slot_id: int = -1) -> None:
        """Commit a verify step: request b kept the first ``accepted[b]`` of its T inputs (1..T).

        slots     [B] int32/int64, the verify step's slots (pad_slot_id rows skipped)
        accepted  [B] integer in 1..T: the last emitted token plus the accepted drafts
        Flips the replay double buffer and sets ``prev_accepted`` for every layer at once, and
        sets ``conv_accepted`` for the next conv update. Must follow every verify step, before
        the next one on these slots. Checks the range on the host (one sync).
        """
        self._require_speculative("commit")
        T = self.tokens_per_step
        bad = (accepted < 1) | (accepted > T)
        if bool(bad.any()):
            raise ValueError(f"StateCache.commit: accepted counts must lie in [1, {T}]; got {accepted[bad][:4].tolist()}")
        commit_accepted(self.buf_idx, self.prev_accepted, slots, accepted, pad_slot_id=pad_slot_id)
        _scatter(self.conv_accepted, slots, accepted, pad_slot_id)


def _scatter(dst: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, pad_slot_id: int) -> None:
    """dst[slots[b]] = values[b] for non-pad b, without boolean indexing (no host sync)."""
    S = dst.shape[0]
    dest = torch.where(slots == pad_slot_id, torch.full_like(slots, S), slots).long()
    ext = torch.cat([dst, dst.new_zeros(1)])
    ext.index_copy_(0, dest, values.to(dst.dtype))
    dst.copy_(ext[:S])
