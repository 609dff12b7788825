"""Programmatic dependent launch (PDL, Hopper and newer): opt-in.

With PDL a kernel's programs may be scheduled while the kernel before it in the stream is still
finishing; each program reads what cannot depend on that kernel (weights, slot indices), then
waits (``griddepcontrol.wait``) before touching anything the previous kernel may have written.
Inside a CUDA graph of back-to-back decode kernels this hides most of the launch gap.

Contract when it is on: slot-index tensors and weights passed to our kernels must not be written
by the kernel launched immediately before them (a host copy, or any earlier kernel, is fine).
Off by default; turn on with ``FASTMAMBA_PDL=1`` or ``with programmatic_dependent_launch():``.
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

_enabled = os.environ.get("FASTMAMBA_PDL", "0").lower() in ("1", "true", "yes", "on")


@contextlib.contextmanager
def programmatic_dependent_launch(enabled: bool = True) -> Iterator[None]:
    """Turn PDL on (or off) for launches inside the block (capture a CUDA graph inside it)."""
    global _enabled
    previous, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = previous


@functools.lru_cache(maxsize=None)
def _supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_active(t: torch.Tensor) -> bool:
    """Whether a kernel launched on ``t``'s device should use PDL now."""
    if not (_enabled and t.is_cuda):
        return False
    return _supports_pdl(t.device.index if t.device.index is not None else torch.cuda.current_device())
