"""When an op may read small index tensors (slot indices, cu_seqlens) on the host, and how.

A host read of a CUDA tensor is a device-to-host copy and a synchronize. The public ops read index
values only to validate them (and, for the varlen ops, to size their grids), and never:

- while a CUDA graph is being captured (a sync is not allowed there),
- while ``torch.compile`` traces the op (a host read would break the graph),
- inside ``trusted_inputs()``: the runtime validates a batch's metadata once, from values the
  host already holds, and then runs every layer's ops without reading them again.

Values are never cached across calls: a tensor changed behind its version counter (``.data``, a
shared numpy array, inference-mode tensors) is read afresh. Skipping a check never lets a kernel
write outside a state pool: every kernel treats a slot index outside [0, S) as a pad slot.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_local = threading.local()


@contextlib.contextmanager
def trusted_inputs() -> Iterator[None]:
    """Within this block the ops skip host reads of slot indices and cu_seqlens: the caller vouches
    that it has validated them (the model and engine do, once per batch, from host values)."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth


def inputs_trusted() -> bool:
    """True inside ``trusted_inputs()``."""
    return getattr(_local, "depth", 0) > 0


def compiling() -> bool:
    """True while torch.compile (dynamo) traces the caller."""
    return torch.compiler.is_compiling()


def host_reads_allowed(t: torch.Tensor) -> bool:
    """Whether an op may read ``t``'s values on the host now (see the module docstring)."""
    if compiling() or inputs_trusted():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def host_list(t: torch.Tensor) -> list:
    """``t.tolist()``: the tensor's current values, read every call (never cached)."""
    return t.tolist()
