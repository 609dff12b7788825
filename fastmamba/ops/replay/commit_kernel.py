"""The replay cache's bookkeeping kernels: commit a step's accepted counts (``_commit_kernel``),
flush the replayed states into ``state`` (``_flush_kernel``), reset the counters
(``_reset_history_kernel``), each with its launcher. References: ``ref.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastmamba.ops._common.launch import lean
from fastmamba.ops._common.slot_errors import NO_BAD, record
from fastmamba.ops._common.host_math import cdiv
from fastmamba.ops.replay.kernel_common import (
    HISTORY_CHUNK,
    _dot_precision,
    _interpreting,
    _replay_history,
    _slot_history,
    dot_dim,
)


@triton.jit
def _commit_kernel(
    buf_idx_ptr, accepted_ptr, hist_ptr, slots_ptr, new_ptr, err_ptr,
    nreq, T, capacity, pad_slot_id, n_slots,
    HAS_SLOTS: tl.constexpr, BLOCK: tl.constexpr, REPORT: tl.constexpr = False, CHECK_NEW: tl.constexpr = False,
):
    # the bookkeeping after a call (see ref.commit_accepted_ref); one element per request
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mb = b < nreq
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + b, mask=mb, other=pad_slot_id).to(tl.int64)
    else:
        slot = b.to(tl.int64)
    live = mb & (slot != pad_slot_id) & (slot >= 0) & (slot < n_slots)  # outside [0, S): as the pad slot
    if REPORT:  # eager calls (slot_errors.py): record the first bad slot / accepted count, skip its row
        bad_slot = mb & (slot != pad_slot_id) & ((slot < 0) | (slot >= n_slots))
        at = tl.min(tl.where(bad_slot, b.to(tl.int64), NO_BAD), 0)
        if at < NO_BAD:
            record(err_ptr, 1, tl.sum(tl.where(b == at, slot, 0), 0), n_slots, at)
        if CHECK_NEW:
            n = tl.load(new_ptr + b, mask=live, other=0).to(tl.int64)
            bad_new = live & ((n < 0) | (n > T))
            at = tl.min(tl.where(bad_new, b.to(tl.int64), NO_BAD), 0)
            if at < NO_BAD:
                record(err_ptr, 2, tl.sum(tl.where(b == at, n, 0), 0), T, at)
            live = live & (bad_new == 0)
    k = tl.load(hist_ptr + slot, mask=live, other=0) + tl.load(accepted_ptr + slot, mask=live, other=0)
    checkpoint = k + T > capacity
    r = tl.load(buf_idx_ptr + slot, mask=live, other=0)
    tl.store(buf_idx_ptr + slot, tl.where(checkpoint, 1 - r, r).to(buf_idx_ptr.dtype.element_ty), mask=live)
    tl.store(hist_ptr + slot, tl.where(checkpoint, 0, k).to(hist_ptr.dtype.element_ty), mask=live)
    tl.store(accepted_ptr + slot, tl.load(new_ptr + b, mask=live, other=0).to(accepted_ptr.dtype.element_ty), mask=live)


def launch_commit(buf_idx, prev_accepted, hist_len, slots, accepted, *, tokens: int, history: int, pad_slot_id: int,
                  err=None, check_accepted: bool = False):
    """buf_idx, prev_accepted, hist_len (S,) int32/int64 (one dtype); slots (B,) or None; accepted (B,).
    ``err``: the op's slot-error record (slot_errors.py): bad slots (and, with ``check_accepted``,
    accepted counts outside [0, T]) are recorded there and their rows skipped."""
    nreq = accepted.shape[0]
    block = 128
    lean(_commit_kernel)[(cdiv(nreq, block),)](
        buf_idx, prev_accepted, hist_len, slots, accepted, err, nreq, tokens, history, pad_slot_id, buf_idx.shape[0],
        HAS_SLOTS=slots is not None, BLOCK=block, REPORT=err is not None, CHECK_NEW=err is not None and check_accepted,
        num_warps=1,
    )


@triton.jit
def _flush_kernel(
    state_ptr, old_x_ptr, old_B_ptr, old_dt_ptr, old_cumA_ptr, buf_idx_ptr, accepted_ptr, hist_ptr, slots_ptr,
    n_slots, pad_slot_id, capacity, heads_per_group, P, N,
    stride_s_s, stride_s_h, stride_s_p, stride_s_n,
    stride_ox_s, stride_ox_t, stride_ox_h, stride_ox_p,
    stride_oB_r, stride_oB_s, stride_oB_t, stride_oB_g, stride_oB_n,
    stride_odt_r, stride_odt_s, stride_odt_t, stride_odt_h,
    stride_ocs_r, stride_ocs_s, stride_ocs_t, stride_ocs_h,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # one program per (listed slot, head, block of P): the stored state tile with the slot's k
    # history tokens replayed (see ref.flush_ref), written back in the state's dtype (rounded to nearest)
    b = tl.program_id(0)
    h = tl.program_id(1)
    pid_p = tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    if (slot != pad_slot_id) & (slot >= 0) & (slot < n_slots):  # outside [0, S): as the pad slot
        rbuf, k = _slot_history(buf_idx_ptr, hist_ptr, accepted_ptr, slot, capacity)
        g = h // heads_per_group
        offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        mp = offs_p < P
        mn = offs_n < N
        cum_row = old_cumA_ptr + rbuf * stride_ocs_r + slot * stride_ocs_s + h * stride_ocs_h
        dt_row = old_dt_ptr + rbuf * stride_odt_r + slot * stride_odt_s + h * stride_odt_h
        x_row = old_x_ptr + slot * stride_ox_s + h * stride_ox_h
        B_hist = old_B_ptr + rbuf * stride_oB_r + slot * stride_oB_s + g * stride_oB_g
        cum_last = tl.load(cum_row + tl.maximum(k - 1, 0) * stride_ocs_t, mask=k > 0, other=0.0)
        ptrs = state_ptr + slot * stride_s_s + h * stride_s_h + offs_p[:, None] * stride_s_p + offs_n[None, :] * stride_s_n
        mask = mp[:, None] & mn[None, :]
        s = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * tl.exp(cum_last)
        s = _replay_history(s, k, cum_last, cum_row, dt_row, x_row, B_hist, offs_p, mp, offs_n, mn,
                            stride_ocs_t, stride_odt_t, stride_ox_t, stride_ox_p, stride_oB_t, stride_oB_n,
                            BLOCK_H, SPLIT, DOT_PRECISION)
        tl.store(ptrs, s.to(state_ptr.dtype.element_ty), mask=mask)


def launch_flush(state, old_x, old_B, old_dt, old_cumA, buf_idx, prev_accepted, hist_len, slots, *,
                 pad_slot_id: int) -> None:
    """One launch for the listed slots of one layer's replay cache (checked by the caller): state
    [S, H, P, N], old_x [S, C_h, H, P], old_B [2, S, C_h, G, N], old_dt / old_cumA [2, S, C_h, H];
    slots [B]. The counters are read, not reset."""
    S, H, P, N = state.shape
    G = old_B.shape[3]
    block_p = min(dot_dim(P), 32)
    lean(_flush_kernel)[(slots.shape[0], H, cdiv(P, block_p))](
        state, old_x, old_B, old_dt, old_cumA, buf_idx, prev_accepted, hist_len, slots,
        S, pad_slot_id, old_x.shape[1], H // G, P, N,
        *state.stride(), *old_x.stride(), *old_B.stride(), *old_dt.stride(), *old_cumA.stride(),
        BLOCK_P=block_p, BLOCK_N=dot_dim(N), BLOCK_H=HISTORY_CHUNK,
        SPLIT=old_x.dtype == torch.bfloat16 and not _interpreting(), DOT_PRECISION=_dot_precision(old_x.dtype, "ieee"),
        num_warps=4,
    )


@triton.jit
def _reset_history_kernel(accepted_ptr, hist_ptr, slots_ptr, nreq, pad_slot_id, n_slots, BLOCK: tl.constexpr):
    # hist_len = prev_accepted = 0 at every live listed slot (see replay.api.reset_history)
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mb = b < nreq
    slot = tl.load(slots_ptr + b, mask=mb, other=pad_slot_id).to(tl.int64)
    live = mb & (slot != pad_slot_id) & (slot >= 0) & (slot < n_slots)  # outside [0, S): as the pad slot
    tl.store(hist_ptr + slot, tl.zeros([BLOCK], dtype=hist_ptr.dtype.element_ty), mask=live)
    tl.store(accepted_ptr + slot, tl.zeros([BLOCK], dtype=accepted_ptr.dtype.element_ty), mask=live)


def launch_reset_history(prev_accepted, hist_len, slots, *, pad_slot_id: int) -> None:
    """prev_accepted, hist_len (S,) integer; slots (B,) integer, on one device."""
    nreq, block = slots.shape[0], 128
    lean(_reset_history_kernel)[(cdiv(nreq, block),)](
        prev_accepted, hist_len, slots, nreq, pad_slot_id, hist_len.shape[0], BLOCK=block, num_warps=1,
    )
