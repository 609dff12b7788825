"""Reusable slot-index buffers for decode steps.

(``A = -exp(A_log)`` is not precomputed here any more: every op that takes ``A`` takes
``A_is_log=True`` and computes it in the kernel, so no derived copy of a weight can go stale under
CUDA graphs, ``.data`` updates, torch.compile or inference mode.)
"""
from __future__ import annotations

import torch


class SlotIndexBuffer:
    """A slot-index tensor allocated once and refilled in place, so decode steps allocate nothing.

    ``fill(slots)`` copies ``slots`` (any int tensor or list, length <= capacity) into the buffer
    and returns the [B] view to pass as ``state_batch_indices`` / ``conv_state_indices``; the
    pointer stays the same, so a captured CUDA graph keeps reading the right memory.
    """

    def __init__(self, capacity: int, device: torch.device | str, dtype: torch.dtype = torch.int32):
        if dtype not in (torch.int32, torch.int64):
            raise TypeError(f"SlotIndexBuffer: dtype must be int32 or int64, got {dtype}")
        self.buffer = torch.zeros(capacity, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    def fill(self, slots: torch.Tensor | list[int]) -> torch.Tensor:
        n = len(slots)
        if n > self.capacity:
            raise ValueError(f"SlotIndexBuffer: {n} slots do not fit a buffer of capacity {self.capacity}")
        view = self.buffer[:n]
        if isinstance(slots, torch.Tensor):
            view.copy_(slots, non_blocking=True)
        else:
            view.copy_(torch.tensor(slots, dtype=self.buffer.dtype), non_blocking=True)
        return view
