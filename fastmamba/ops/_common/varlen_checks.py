"""A packed batch's metadata (cu_seqlens, slot indices) checked on the device, with no synchronize.

An eager call of a packed-batch op (``causal_conv1d_varlen``, ``ssd_scan_varlen``) on GPU tensors
used to read cu_seqlens and the slot indices on the host to check them: two device-to-host copies,
each of which waits for all the GPU work queued before the call (issue 19 item 0). Instead, one
single-program kernel (``sanitize``) reads them on the device before the op's kernels run and
writes the copies those kernels use:

- every value right: the copies equal the inputs (slot b = b where no indices were given);
- any value wrong (cu_seqlens not starting at 0, decreasing, not ending at T; a slot outside
  [0, S) that is not the pad id): the whole call becomes padding (cu_seqlens [0, T, ..., T],
  every slot the pad id): no state is read or written and the outputs are zeros, so a bad call
  changes nothing but its outputs;

and records the first bad value in the op's pinned host record (ops/_common/slot_errors.py),
which the op's next call reads (host memory, no synchronize) and raises as a ValueError naming the
argument, the position and the value. ``fastmamba.ops.raise_pending_slot_errors()`` reports it on
demand.

Only plain eager calls take this path (``device_checked``): under CUDA-graph capture, torch.compile
and ``trusted_inputs()`` the ops read nothing (the runtime has validated the batch from host
values), and CPU tensors are checked on the host, which costs no synchronize.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from fastmamba.ops._common.launch import lean
from fastmamba.ops._common.pdl import pdl_requested, programmatic_dependent_launch
from fastmamba.ops._common.slot_errors import NO_BAD, checked_on_device, first_bad_slot, load_slots, record, slot_record

# Tests of the device check without a GPU: CPU tensors (under the interpreter) checked on the
# device too. On a real CPU run the host read is cheaper and stays.
DEVICE_CHECK_CPU = False
_BLOCK = 256


def device_checked(x: torch.Tensor, cu_seqlens: torch.Tensor) -> bool:
    """Whether a call checks its metadata with ``sanitize`` instead of reading it on the host: an
    eager call on GPU tensors (or CPU ones with DEVICE_CHECK_CPU) that may read them at all."""
    return checked_on_device(cu_seqlens, DEVICE_CHECK_CPU)  # (on x's device: checked before)


def launches_after(checked: bool, x: torch.Tensor):
    """The context for the launches that read what ``sanitize`` just wrote: PDL off when it is on
    (``FASTMAMBA_PDL=1``), since a PDL program reads its indices before the grid-dependency wait and
    pdl.py's contract forbids the kernel just before to write them; else nothing."""
    if checked and pdl_requested(x):
        return programmatic_dependent_launch(False)
    return contextlib.nullcontext()


@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["B", "T", "S", "pad_slot_id"])
def _sanitize_kernel(cu_ptr, stride_cu, idx_ptr, stride_idx, safe_ptr, err_ptr, B, T, S, pad_slot_id,
                     HAS_IDX: tl.constexpr, CU_WHICH: tl.constexpr, IDX_WHICH: tl.constexpr,
                     BLOCK: tl.constexpr):
    """One program. safe_ptr [2B+1] int32: cu_seqlens (B+1 values) then the slots (B values)."""
    cu_bad_at = tl.full([], NO_BAD, tl.int64)
    carry = tl.full([], -NO_BAD, tl.int64)
    for start in range(0, B + 1, BLOCK):  # cu_seqlens: the first position breaking the rules
        offs = start + tl.arange(0, BLOCK)
        m = offs <= B
        v = tl.load(cu_ptr + offs * stride_cu, mask=m, other=0).to(tl.int64)
        run = tl.maximum(tl.associative_scan(tl.where(m, v, -NO_BAD), 0, _max2), carry)  # running max
        bad = m & ((v < run) | (v < 0) | (v > T) | ((offs == 0) & (v != 0)) | ((offs == B) & (v != T)))
        cu_bad_at = tl.minimum(cu_bad_at, tl.min(tl.where(bad, offs.to(tl.int64), NO_BAD), 0))
        carry = tl.max(run, 0)
    slot_bad_at = first_bad_slot(idx_ptr, stride_idx, B, S, pad_slot_id, HAS_IDX, BLOCK)
    invalid = (cu_bad_at < NO_BAD) | (slot_bad_at < NO_BAD)
    for start in range(0, B + 1, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs <= B
        v = tl.load(cu_ptr + offs * stride_cu, mask=m, other=0)
        tl.store(safe_ptr + offs, tl.where(invalid, tl.where(offs == 0, 0, T), v).to(tl.int32), mask=m)
    for start in range(0, B, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < B
        slot = load_slots(idx_ptr, stride_idx, offs, m, HAS_IDX)
        tl.store(safe_ptr + B + 1 + offs, tl.where(invalid, pad_slot_id, slot).to(tl.int32), mask=m)
    if cu_bad_at < NO_BAD:
        record(err_ptr, CU_WHICH, tl.load(cu_ptr + cu_bad_at * stride_cu), T, cu_bad_at)
    elif slot_bad_at < NO_BAD:
        record(err_ptr, IDX_WHICH, load_slots(idx_ptr, stride_idx, slot_bad_at, True, HAS_IDX), S, slot_bad_at)


def sanitize(op: str, cu_seqlens: torch.Tensor, cache_indices: torch.Tensor | None, T: int, S: int,
             pad_slot_id: int, *, cu_which: int, idx_which: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens [B+1] int32, slots [B] int32) for the op's kernels, checked on the device (see
    the module docstring); a bad value is recorded for ``op`` as argument number ``cu_which`` /
    ``idx_which`` of slot_errors.NAMES[op]. Shapes and dtypes must have been checked."""
    B = cu_seqlens.shape[0] - 1
    safe = torch.empty(2 * B + 1, dtype=torch.int32, device=cu_seqlens.device)
    has_idx = cache_indices is not None
    lean(_sanitize_kernel)[(1,)](
        cu_seqlens, cu_seqlens.stride(0), cache_indices, cache_indices.stride(0) if has_idx else 0, safe,
        slot_record(op, cu_seqlens.device)[0], B, T, S, pad_slot_id,
        HAS_IDX=has_idx, CU_WHICH=cu_which, IDX_WHICH=idx_which, BLOCK=_BLOCK, num_warps=4,
    )
    return safe[:B + 1], safe[B + 1:]
