"""The replay cache and its bookkeeping: ``ReplayCache`` (the per-slot buffers) and
``allocate_replay_cache``, ``commit_accepted`` after each step, ``reset_history`` after an outside
write, ``flush_replay_cache`` when another path needs the state. The op itself: ``api.py``."""
from __future__ import annotations

from typing import NamedTuple

import torch

from fastmamba.ops._common import slot_errors
from fastmamba.ops._common.host_values import host_list, host_reads_allowed
from fastmamba.ops._common.checks import (
    INDEX_DTYPES,
    check_dtype,
    check_indices,
    check_same_device,
    check_shape,
    check_tensors,
    check_int,
)
from fastmamba.ops._common.dispatch import use_triton
from fastmamba.ops._common.slot_rows import scatter_rows
from fastmamba.ops.replay.api import _device_check  # reads api.DEVICE_CHECK_CPU at call time
from fastmamba.ops.replay.commit_kernel import launch_commit, launch_flush, launch_reset_history

slot_errors.NAMES["flush_replay_cache"] = ("slots",)
slot_errors.NAMES["commit_accepted"] = ("slots", "accepted")


def default_history(tokens: int) -> int:
    """History capacity for T = ``tokens`` per step: 4T rounded up to a multiple of 16 (the replay's
    tl.dot chunk), so a slot stores its state about once every (C_h - T) / (accepted per step) + 1
    steps while replaying at most C_h tokens (x: 1/(2N) of an fp32 state row per token).

    >>> [default_history(t) for t in (1, 2, 4, 6, 8, 16)]
    [16, 16, 16, 32, 32, 64]
    """
    return max(16, -(-4 * tokens // 16) * 16)


class ReplayCache(NamedTuple):
    """The per-slot buffers of replay-based speculative verification, in the op's argument order
    (``replay_selective_state_update(*cache, x, dt, ...)``). C_h is the history capacity.

    state          [S, H, P, N]       the stored state (as of the start of the slot's history)
    old_x          [S, C_h, H, P]     x of the history tokens (activation dtype)
    old_B          [2, S, C_h, G, N]  their B (activation dtype), double-buffered
    old_dt         [2, S, C_h, H]     their dt' = softplus(dt + dt_bias), fp32, double-buffered
    old_cumA       [2, S, C_h, H]     cumulative sum of A dt' since the stored state, fp32, double-buffered
    buf_idx        [S] int32          which buffer holds the history's B / dt' / cumA
    prev_accepted  [S] int32          how many of the previous step's tokens were accepted (0..T)
    hist_len       [S] int32          tokens accepted before the previous step (its tokens start there)
    """

    state: torch.Tensor
    old_x: torch.Tensor
    old_B: torch.Tensor
    old_dt: torch.Tensor
    old_cumA: torch.Tensor
    buf_idx: torch.Tensor
    prev_accepted: torch.Tensor
    hist_len: torch.Tensor

    @property
    def history(self) -> int:
        """C_h, the most tokens a slot replays (a step verifies T <= C_h tokens)."""
        return self.old_x.shape[1]

    def commit(self, slots: torch.Tensor, accepted: torch.Tensor, tokens: int, *, pad_slot_id: int = -1) -> None:
        """Record the acceptance of a step of ``tokens`` (T) for ``slots`` (see :func:`commit_accepted`)."""
        commit_accepted(self.buf_idx, self.prev_accepted, self.hist_len, slots, accepted, tokens=tokens,
                        history=self.history, pad_slot_id=pad_slot_id)

    def flush(self, slots: torch.Tensor, *, pad_slot_id: int = -1) -> None:
        """Store the slots' replayed states and empty their histories (see :func:`flush_replay_cache`)."""
        flush_replay_cache(self, slots, pad_slot_id=pad_slot_id)


def allocate_replay_cache(
    S: int, T: int, H: int, P: int, G: int, N: int,
    state_dtype: torch.dtype, act_dtype: torch.dtype, device: torch.device | str, *, history: int | None = None,
) -> ReplayCache:
    """Zero-initialised replay cache for S slots verifying up to T tokens per step, with a history
    of ``history`` tokens (default ``default_history(T)``; must be >= T; history = T stores the
    state at every step that replays anything).

    Every slot starts fresh: state 0, nothing to replay (prev_accepted = hist_len = 0), buf_idx 0.
    A prefill that writes a slot's state must also reset its history (``reset_history``).
    """
    history = default_history(T) if history is None else history
    if history < T:
        raise ValueError(f"allocate_replay_cache: history={history} must be >= T={T} tokens per step")

    def zeros(*shape, dtype):
        return torch.zeros(*shape, dtype=dtype, device=device)

    return ReplayCache(
        state=zeros(S, H, P, N, dtype=state_dtype),
        old_x=zeros(S, history, H, P, dtype=act_dtype),
        old_B=zeros(2, S, history, G, N, dtype=act_dtype),
        old_dt=zeros(2, S, history, H, dtype=torch.float32),
        old_cumA=zeros(2, S, history, H, dtype=torch.float32),
        buf_idx=zeros(S, dtype=torch.int32),
        prev_accepted=zeros(S, dtype=torch.int32),
        hist_len=zeros(S, dtype=torch.int32),
    )


def commit_accepted(
    buf_idx: torch.Tensor,
    prev_accepted: torch.Tensor,
    hist_len: torch.Tensor,
    slots: torch.Tensor | None,
    accepted: torch.Tensor,
    *,
    tokens: int,
    history: int,
    pad_slot_id: int = -1,
    check: bool = True,
) -> None:
    """Commit a verification step of T = ``tokens`` tokens per request on a cache of ``history``
    (C_h) capacity: for each non-pad ``slots[b]``, with k = hist_len + prev_accepted (what the
    step replayed), move the history on (k + T > C_h: the step stored the state and started a new
    history in the other buffer, so hist_len = 0 and buf_idx flips; else hist_len = k) and set
    ``prev_accepted`` to ``accepted[b]``.

    buf_idx, prev_accepted, hist_len  [S] int32/int64, mutated in place at the given slots only
    slots      [B] int32/int64, the step's ``state_batch_indices`` (None: slot b); pad rows skipped
    accepted   [B] integer in 0..T: tokens accepted per request (0: none; the next step then
               replays only the older history)
    check      range-check ``accepted`` (CPU: on the host; eager GPU calls: in the kernel, which
               skips a bad row and records it for the op's next call to raise; skipped while a
               CUDA graph is captured). Slots are checked the same way

    Must run once for every slot of every replay call, with the call's T, before the next call on
    that slot. One kernel launch on a GPU (plain torch on the CPU), no host sync of its own when
    ``check`` is off; two requests must not share a slot.

    >>> z = lambda: torch.zeros(4, dtype=torch.int32)
    >>> buf_idx, prev_accepted, hist_len = z(), z(), z()
    >>> commit_accepted(buf_idx, prev_accepted, hist_len, torch.tensor([2, -1]), torch.tensor([3, 1]), tokens=4, history=8)
    >>> commit_accepted(buf_idx, prev_accepted, hist_len, torch.tensor([2]), torch.tensor([2]), tokens=4, history=8)
    >>> hist_len.tolist(), prev_accepted.tolist(), buf_idx.tolist()  # 3 + 4 <= 8: appended
    ([0, 0, 3, 0], [0, 0, 2, 0], [0, 0, 0, 0])
    >>> commit_accepted(buf_idx, prev_accepted, hist_len, torch.tensor([2]), torch.tensor([1]), tokens=4, history=8)
    >>> hist_len.tolist(), prev_accepted.tolist(), buf_idx.tolist()  # 5 + 4 > 8: stored, new history
    ([0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 1, 0])
    """
    op = "commit_accepted"
    check_tensors(op, [("buf_idx", buf_idx), ("prev_accepted", prev_accepted), ("hist_len", hist_len),
                       ("accepted", accepted)], [("slots", slots)])
    tokens, history = check_int(op, "tokens", tokens), check_int(op, "history", history)
    pad_slot_id = check_int(op, "pad_slot_id", pad_slot_id)
    for name, t in (("buf_idx", buf_idx), ("prev_accepted", prev_accepted), ("hist_len", hist_len)):
        check_dtype(op, name, t, INDEX_DTYPES)
    nslots = buf_idx.shape[0]
    check_shape(op, "prev_accepted", prev_accepted, [("S", nslots)])
    check_shape(op, "hist_len", hist_len, [("S", nslots)])
    nreq = accepted.shape[0] if accepted.dim() == 1 else -1
    check_shape(op, "accepted", accepted, [("B", nreq)])
    if accepted.dtype.is_floating_point or accepted.dtype.is_complex:
        raise TypeError(f"{op}: `accepted` expected an integer dtype, got {str(accepted.dtype).replace('torch.', '')}")
    if not 1 <= tokens <= history:
        raise ValueError(f"{op}: need 1 <= tokens <= history, got tokens={tokens}, history={history}")
    check_same_device(op, [("buf_idx", buf_idx), ("prev_accepted", prev_accepted), ("hist_len", hist_len),
                           ("slots", slots), ("accepted", accepted)])
    on_device = _device_check(accepted) and use_triton(accepted)
    slot_errors.raise_pending(op, accepted.device, slot_errors.NAMES[op])
    if slots is not None:
        check_indices(op, "slots", slots, nreq, nslots, pad_slot_id, read=not on_device)
    elif nreq > nslots:
        raise ValueError(f"{op}: without slots, the cache needs at least B={nreq} rows, got {nslots}")
    if check and not on_device and host_reads_allowed(accepted):  # one read of the values
        bad = [int(v) for v in host_list(accepted) if not 0 <= v <= tokens][:4]
        if bad:
            raise ValueError(f"{op}: `accepted` values must lie in [0, {tokens}]; got {bad}")
    if use_triton(accepted):
        # eager GPU calls: the kernel checks slots (and, with ``check``, accepted), skips a bad
        # row and records it for the next call
        launch_commit(buf_idx, prev_accepted, hist_len, slots, accepted, tokens=tokens, history=history,
                      pad_slot_id=pad_slot_id,
                      err=slot_errors.slot_record(op, accepted.device)[0] if on_device else None,
                      check_accepted=bool(check))
        return
    # CPU without the interpreter: the same arithmetic as the kernel, vectorised
    idx = torch.arange(nreq, device=accepted.device) if slots is None else slots
    dead = (idx == pad_slot_id) | (idx < 0) | (idx >= nslots)  # outside [0, S): as the pad slot
    rows = torch.where(dead, torch.zeros_like(idx), idx).long()  # pad rows read slot 0, write nothing
    k = hist_len[rows] + prev_accepted[rows].to(hist_len.dtype)
    stored = k + tokens > history
    scatter_rows(buf_idx, idx, torch.where(stored, 1 - buf_idx[rows], buf_idx[rows]), pad_slot_id)
    scatter_rows(hist_len, idx, torch.where(stored, torch.zeros_like(k), k), pad_slot_id)
    scatter_rows(prev_accepted, idx, accepted, pad_slot_id)


def reset_history(cache: ReplayCache, slots: torch.Tensor, *, pad_slot_id: int = -1) -> None:
    """Slots whose ``state`` was just written from outside (prefill, a plain decode step, a copy):
    nothing to replay (hist_len = prev_accepted = 0). No host sync: one small kernel (plain torch
    on a CPU without the interpreter)."""
    if slots.shape[0] == 0:
        return
    if use_triton(slots):
        launch_reset_history(cache.prev_accepted, cache.hist_len, slots, pad_slot_id=pad_slot_id)
        return
    zeros = torch.zeros(slots.shape[0], dtype=torch.int32, device=slots.device)
    scatter_rows(cache.hist_len, slots, zeros, pad_slot_id)
    scatter_rows(cache.prev_accepted, slots, zeros, pad_slot_id)


def flush_replay_cache(cache: ReplayCache, slots: torch.Tensor, *, pad_slot_id: int = -1, reset: bool = True) -> None:
    """Store each non-pad slot's replayed state (its stored state with every accepted history token
    applied) into ``cache.state`` and empty the history (hist_len = prev_accepted = 0), so that
    other paths (plain decode, per-position verification, prefill continuation) can use the state.

    slots [B] int32/int64 on the cache's device. ``reset=False`` leaves the counters alone (for
    caches whose layers share them: flush every layer, then reset once). One kernel launch
    (``_flush_kernel``: the replay kernels' history loop) plus the counter reset; plain torch on a
    CPU without the interpreter. No host sync: CPU slots are checked on the host, eager GPU ones
    on the device (a bad slot is skipped and the op's next call raises). 16-bit states are
    rounded to nearest. Reference: ``ref.flush_ref``.
    """
    op = "flush_replay_cache"
    check_tensors(op, [("slots", slots)])
    pad_slot_id = check_int(op, "pad_slot_id", pad_slot_id)
    state, old_x, old_B, old_dt, old_cumA, buf_idx, prev_accepted, hist_len = cache
    nslots, H = state.shape[0], state.shape[1]
    on_device = _device_check(slots) and use_triton(state)
    slot_errors.raise_pending(op, slots.device, slot_errors.NAMES[op])
    check_indices(op, "slots", slots, slots.shape[0], nslots, pad_slot_id, read=not on_device)
    if slots.shape[0] == 0:
        return
    if use_triton(state):
        if on_device:  # the kernels skip a slot outside [0, S); this records it for the next call
            slot_errors.check_slots_on_device(op, slots, nslots, pad_slot_id, which=1)
        launch_flush(state, old_x, old_B, old_dt, old_cumA, buf_idx, prev_accepted, hist_len, slots,
                     pad_slot_id=pad_slot_id)
        if reset:
            reset_history(cache, slots, pad_slot_id=pad_slot_id)
        return
    # CPU without the interpreter: the same arithmetic in plain torch, batched over the slots
    live = (slots != pad_slot_id) & (slots >= 0) & (slots < nslots)  # outside [0, S): as the pad slot
    rows = torch.where(live, slots, torch.zeros_like(slots)).long()  # pad rows read slot 0 ...
    capacity = old_x.shape[1]
    r = (buf_idx[rows] != 0).long()  # 0 or 1 (as the kernels read it)
    k = torch.where(live, hist_len[rows] + prev_accepted[rows], 0).long().clamp(0, capacity)  # ... and replay nothing
    cum = old_cumA[r, rows].float()  # [B, C_h, H]
    pos = torch.arange(capacity, device=state.device)
    valid = pos[None, :] < k[:, None]  # [B, C_h]
    last_pos = (k - 1).clamp(min=0)[:, None, None].expand(-1, 1, H)
    last = torch.where(k[:, None] > 0, cum.gather(1, last_pos).squeeze(1), 0.0)  # [B, H]
    w = torch.where(valid[..., None], torch.exp(last[:, None, :] - cum) * old_dt[r, rows].float(), 0.0)
    # NaN-safe: positions past k may hold anything
    xw = torch.where(valid[:, :, None, None], old_x[rows].float() * w[..., None], 0.0)  # [B, C_h, H, P]
    Bh = old_B[r, rows].float().repeat_interleave(H // old_B.shape[3], dim=2)  # [B, C_h, H, N]
    Bh = torch.where(valid[:, :, None, None], Bh, 0.0)
    s = state[rows].float() * torch.exp(last)[:, :, None, None] + torch.einsum("bchp,bchn->bhpn", xw, Bh)
    # pad rows write the first live row's value to its slot (a duplicate of the same write), or,
    # with no live row, slot 0's unchanged value: no boolean indexing, no host sync
    first_live = torch.argmax(live.to(torch.int32))
    src = torch.where(live, torch.arange(slots.shape[0], device=slots.device), first_live)
    state.index_copy_(0, rows[src], s[src].to(state.dtype))
    if reset:
        reset_history(cache, slots, pad_slot_id=pad_slot_id)
