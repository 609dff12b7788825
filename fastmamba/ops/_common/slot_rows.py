"""Writing per-slot rows from a batch that may contain pad rows, without a host sync."""
from __future__ import annotations

import torch


def scatter_rows(dst: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, pad_slot_id: int = -1) -> None:
    """dst[slots[b]] = values[b] for every b with slots[b] in [0, S) and != pad_slot_id; other rows untouched.

    dst [S, ...]; slots [B] integer; values [B, ...] (cast to dst's dtype). Pad rows go to a
    scratch row past the end, so there is no boolean indexing and no host sync (CUDA-graph safe).
    Meant for small per-slot tables (it copies ``dst`` once). Two live rows must not share a slot.

    >>> t = torch.zeros(3, dtype=torch.int32)
    >>> scatter_rows(t, torch.tensor([2, -1]), torch.tensor([5, 7]))
    >>> t.tolist()
    [0, 0, 5]
    """
    S = dst.shape[0]
    # a slot outside [0, S) is written nowhere, like a pad row (unchecked indices never write outside dst)
    dead = (slots == pad_slot_id) | (slots < 0) | (slots >= S)
    dest = torch.where(dead, torch.full_like(slots, S), slots).long()
    ext = torch.cat([dst, dst.new_zeros(1, *dst.shape[1:])])
    ext.index_copy_(0, dest, values.to(dst.dtype))
    dst.copy_(ext[:S])
