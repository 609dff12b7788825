"""Slot-index errors found by the kernels, reported on the host without a synchronize (issue 19).

Reading slot indices on the host to range-check them costs a device-to-host copy and a
synchronize per call: most of an eager decode call's time. Where an op skips that read (its
lean eager path, for indices on a GPU), its kernel checks each index as it loads it anyway (an
index outside [0, S) that is not the pad id is treated as the pad slot: nothing is read or
written outside the pool) and records the first bad one in a small per-(op, device) buffer of
pinned host memory, which the kernel writes directly (unified addressing). The op's next call
reads the buffer -- host memory, no synchronize -- and raises the ValueError there, naming the
op, the device, the argument and the value. Only a later call of the same op on the same device
reports it (any call of it: the lean path or the checked one), never another op. The record is
written when the bad call's kernel runs, so a call made before that (no synchronize in between)
cannot see it yet: the first call after the kernel ran reports it. ``raise_pending_slot_errors()``
does the same check on demand for every op and device (after a synchronize it reports everything
launched before it).

The packed-batch ops (causal_conv1d_varlen, ssd_scan_varlen) check their cu_seqlens the same way
(ops/_common/varlen_checks.py): a call with any bad slot index or cu_seqlens value then runs as
all padding (no state read or written, zero outputs), and its next call raises.

Record layout (int64): [set, argument number, bad value, bound (S, or T for cu_seqlens), position].
"""
from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

from fastmamba.ops._common.host_values import host_reads_allowed
from fastmamba.ops._common.launch import lean

_records: dict = {}
_lock = threading.Lock()


def checked_on_device(t: torch.Tensor | None, cpu_too: bool) -> bool:
    """Whether an eager call checks the index values of ``t`` on the device (recorded, raised at
    the op's next call) instead of reading them on the host: a GPU tensor (or, with ``cpu_too``,
    the switch the tests set, a CPU one) whose values may be read at all (host_values.py)."""
    return t is not None and (t.is_cuda or cpu_too) and host_reads_allowed(t)


def slot_record(op: str, device: torch.device) -> tuple[torch.Tensor, object]:
    """(the record a kernel of ``op`` on ``device`` writes, a numpy view of it for the host)."""
    key = (op, device)
    rec = _records.get(key)
    if rec is None:
        with _lock:
            rec = _records.get(key)
            if rec is None:
                t = torch.zeros(5, dtype=torch.int64, pin_memory=device.type == "cuda")
                rec = _records[key] = (t, t.numpy())
    return rec


def raise_pending(op: str, device: torch.device, names: tuple[str, ...]) -> None:
    """Raise the ValueError an earlier call of ``op`` on ``device`` recorded (and clear it);
    ``names[k - 1]`` is argument number k."""
    if torch.compiler.is_compiling():  # a trace reads no host record (the eager calls report)
        return
    rec = _records.get((op, device))
    if rec is not None and rec[1][0]:
        _raise(op, device, rec, names, "at this call")


# what a call with a bad index did instead, by op (default: the decode ops' row skip)
EFFECTS: dict[str, str] = {}
_ROW_SKIPPED = "that row was skipped: nothing was written outside the pool"


def _raise(op: str, device: torch.device, rec, names: tuple[str, ...], where: str) -> None:
    arr = rec[1]
    which, value, bound, position = int(arr[1]), int(arr[2]), int(arr[3]), int(arr[4])
    arr[:] = 0
    name = names[which - 1] if 1 <= which <= len(names) else "slot index"
    effect = EFFECTS.get(op, _ROW_SKIPPED)
    if name == "accepted":  # commit_accepted's counts, in [0, T]
        raise ValueError(
            f"{op}: `accepted` values must lie in [0, {bound}]; an earlier call of {op} on {device} got [{value}] "
            f"(checked on the device and reported {where}; {effect})"
        )
    if name == "cu_seqlens":
        raise ValueError(
            f"{op}: `cu_seqlens` must start at 0, never decrease and end at the token count {bound}; an "
            f"earlier call of {op} on {device} got cu_seqlens[{position}] = {value} (checked on the device and "
            f"reported {where}; {effect})"
        )
    raise ValueError(
        f"{op}: `{name}` values must lie in [0, {bound}) or equal pad_slot_id; an earlier call of {op} on {device} "
        f"got [{value}] (checked on the device and reported {where}; {effect})"
    )


def clear_pending_slot_errors() -> list[str]:
    """Drop every recorded slot-index error without raising (tests: no error crosses from one test
    to the next); returns the ops that had one. Synchronizes an initialized CUDA first, so a kernel
    still running cannot record after the clear."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    dropped = []
    for (op, device), rec in list(_records.items()):
        if rec[1][0]:
            dropped.append(f"{op} on {device}")
        rec[1][:] = 0
    return dropped


NAMES: dict[str, tuple[str, ...]] = {}


def raise_pending_slot_errors() -> None:
    """Raise the first slot-index error any op recorded on the device since the last report.
    Synchronize first to include every launch made so far."""
    for (op, device), rec in list(_records.items()):
        if rec[1][0]:
            _raise(op, device, rec, NAMES.get(op, ()), "by raise_pending_slot_errors()")


@triton.jit
def report_bad_slot(err_ptr, slot, pad_slot_id, n_slots, which: tl.constexpr):
    """In a kernel: record ``slot`` as argument number ``which``'s bad value when it lies outside
    [0, n_slots) and is not the pad id (call it from one program per request)."""
    if (slot != pad_slot_id) & ((slot < 0) | (slot >= n_slots)):
        record(err_ptr, which, slot, n_slots, 0)


NO_BAD: tl.constexpr = tl.constexpr(2 ** 62)  # "no bad position" in the helpers below


@triton.jit
def load_slots(idx_ptr, stride_idx, offs, mask, HAS_IDX: tl.constexpr):
    """Slots ``offs`` of an index tensor (int64), or ``offs`` themselves without one (slot b = b)."""
    if HAS_IDX:
        return tl.load(idx_ptr + offs * stride_idx, mask=mask, other=0).to(tl.int64)
    return offs.to(tl.int64)


@triton.jit
def first_bad_slot(idx_ptr, stride_idx, B, n_slots, pad_slot_id, HAS_IDX: tl.constexpr, BLOCK: tl.constexpr):
    """(In one program) the position of the first of B slots outside [0, n_slots) that is not the
    pad id, or NO_BAD."""
    bad_at = tl.full([], NO_BAD, tl.int64)
    for start in range(0, B, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < B
        slot = load_slots(idx_ptr, stride_idx, offs, m, HAS_IDX)
        bad = m & (slot != pad_slot_id) & ((slot < 0) | (slot >= n_slots))
        bad_at = tl.minimum(bad_at, tl.min(tl.where(bad, offs.to(tl.int64), NO_BAD), 0))
    return bad_at


@triton.jit
def record(err_ptr, which, value, bound, position):
    """Write an op's record (layout in the module docstring); the set flag last."""
    tl.store(err_ptr + 1, which)
    tl.store(err_ptr + 2, value.to(tl.int64))
    tl.store(err_ptr + 3, tl.full([], 0, tl.int64) + bound)  # (an int Triton may have made a constant)
    tl.store(err_ptr + 4, position)
    tl.store(err_ptr, 1)


@triton.jit(do_not_specialize=["B", "n_slots", "pad_slot_id"])
def _check_slots_kernel(idx_ptr, stride_idx, err_ptr, B, n_slots, pad_slot_id, WHICH: tl.constexpr,
                        BLOCK: tl.constexpr):
    """One program: record the first of ``idx``'s B values outside [0, n_slots) that is not the pad id."""
    bad_at = first_bad_slot(idx_ptr, stride_idx, B, n_slots, pad_slot_id, True, BLOCK)
    if bad_at < NO_BAD:
        record(err_ptr, WHICH, tl.load(idx_ptr + bad_at * stride_idx), n_slots, bad_at)


def check_slots_on_device(op: str, idx: torch.Tensor, n_slots: int, pad_slot_id: int, which: int) -> None:
    """For an op whose kernels treat a slot outside [0, n_slots) as the pad slot but cannot record
    it themselves: one single-program launch that records the first bad value of ``idx`` ([B]
    int32/int64) as argument number ``which``, reported at the op's next call."""
    lean(_check_slots_kernel)[(1,)](idx, idx.stride(0), slot_record(op, idx.device)[0], idx.shape[0], n_slots,
                                    pad_slot_id, WHICH=which, BLOCK=256, num_warps=4)
