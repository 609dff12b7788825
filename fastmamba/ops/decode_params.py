"""Per-session decode parameters: the pre-expanded A and reusable slot-index buffers.

Mamba-2 stores ``A_log`` [H]; the state update wants ``A = -exp(A_log)`` broadcast to [H, P, N].
Prefer passing ``A_log`` itself with ``A_is_log=True`` (the kernels compute -exp on load): nothing
cached, so nothing goes stale under CUDA graphs, torch.compile or inference mode. ``expanded_A``
stays for callers that want the [H, P, N] view.
Recomputing that every layer of every token is wasted work, and caching it naively is dangerous:
a stale A after a weight reload silently produces garbage. ``expanded_A`` caches per tensor and
recomputes when the tensor's storage or version counter changes (``copy_``, ``load_state_dict``,
``param.data = ...`` all change one of them).
"""
from __future__ import annotations

import torch

_CACHE_ATTR = "_fastmamba_expanded_A"  # (key, view) stored on the A_log tensor object itself


def expanded_A(A_log: torch.Tensor, headdim: int, dstate: int) -> torch.Tensor:
    """``-exp(A_log.float())`` as an [H, P, N] stride-0 view, computed once per weight version.

    A_log   [H] any float dtype. Returns an fp32 [H, P, N] view with strides (1, 0, 0).
    The cache key is (storage pointer, version counter, device, P, N); a changed weight misses.
    """
    if A_log.dim() != 1:
        raise ValueError(f"expanded_A: `A_log` expected shape (H,), got {tuple(A_log.shape)}")
    if A_log.is_inference():  # no version counter to key on: computed afresh (prefer A_is_log=True)
        with torch.no_grad():
            return (-torch.exp(A_log.detach().float()))[:, None, None].expand(A_log.shape[0], headdim, dstate)
    key = (A_log.data_ptr(), A_log._version, A_log.device, headdim, dstate)
    hit = getattr(A_log, _CACHE_ATTR, None)
    if hit is not None and hit[0] == key:
        return hit[1]
    with torch.no_grad():
        A = -torch.exp(A_log.detach().float())
    view = A[:, None, None].expand(A.shape[0], headdim, dstate)
    setattr(A_log, _CACHE_ATTR, (key, view))
    return view


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
