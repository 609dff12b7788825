"""Static inputs of CUDA graphs, written on the host and sent down in one asynchronous copy.

A graph reads its inputs (token ids, cu_seqlens, slots, flags) from fixed device buffers, which
each call must fill first. ``torch.tensor(values).to("cuda")`` does that from pageable memory: the
host waits for everything queued on the stream before the copy (a prefix-cache hit's state
restore), then launches a copy kernel per static buffer while the GPU idles.

``StagedInputs`` keeps every field in one pinned host block and one device block of the same byte
layout: the caller writes the values of every field it uses (padding included) into the host views
(``set``), ``upload()`` sends the whole block (a few KB) down with one non-blocking copy, and the
graphs read typed views of the device block. The host block is written again only once the copy
before has finished (an event; in the engine every step has synchronised by then).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from fastmamba.ops.runtime import cdiv

ALIGN = 16  # bytes: every field starts on a 16-byte boundary


class StagedInputs:
    """Fields ``name -> (dtype, length)``: ``dev[name]`` is the device view a graph captures,
    ``host[name]`` the pinned host view that ``set`` writes before ``upload``."""

    def __init__(self, fields: dict[str, tuple[torch.dtype, int]], device: torch.device):
        spans, end = {}, 0
        for name, (dtype, length) in fields.items():
            nbytes = length * dtype.itemsize
            spans[name] = (end, end + nbytes, dtype)
            end += cdiv(nbytes, ALIGN) * ALIGN
        self._host = torch.zeros(max(end, ALIGN), dtype=torch.uint8, pin_memory=True)
        self._dev = torch.zeros(max(end, ALIGN), dtype=torch.uint8, device=device)
        self.host = {n: self._host[a:b].view(dt) for n, (a, b, dt) in spans.items()}
        # numpy views of the same pinned bytes: ``set`` writes a Python list through them (no
        # torch op per call: four fields cost ~0.1 ms through torch.tensor + copy_ on an H200 host)
        # (numpy is not a dependency of the core: without it, the torch path)
        try:
            self._np = {n: v.numpy() for n, v in self.host.items()}
        except (ImportError, RuntimeError):
            self._np = None
        self.dev = {n: self._dev[a:b].view(dt) for n, (a, b, dt) in spans.items()}
        self._copied = torch.cuda.Event()
        self._pending = False

    def set(self, name: str, values: Sequence[int | bool], start: int = 0) -> None:
        """Write ``values`` into field ``name`` from position ``start`` (host side only)."""
        if self._pending:  # the last upload may still be reading the host block
            self._copied.synchronize()
            self._pending = False
        view = self.host[name] if self._np is None else self._np[name]
        if start + len(values) > view.shape[0]:
            raise ValueError(f"StagedInputs.set: {len(values)} values from {start} overflow field {name!r} "
                             f"of {view.shape[0]}")
        if not values:
            return
        if self._np is None:
            view[start:start + len(values)].copy_(torch.tensor(values, dtype=view.dtype))
        else:
            view[start:start + len(values)] = values

    def upload(self) -> None:
        """One non-blocking host-to-device copy of the whole block, on the current stream."""
        self._dev.copy_(self._host, non_blocking=True)
        self._copied.record()
        self._pending = True
