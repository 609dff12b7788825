"""Host copies of small index tensors (cu_seqlens, slot indices), read once per tensor version.

A packed prefill passes the same ``cu_seqlens`` and slot tensors to the conv and the scan of every
layer; validating them costs a device-to-host copy (a sync) each time. ``host_list`` keeps the
values of a tensor object until it is modified in place (its version counter moves, views included)
or freed, so a 64-layer prefill reads them once instead of ~200 times.
"""
from __future__ import annotations

import weakref

import torch

_values: dict[int, tuple[weakref.ref, int, list]] = {}


def host_list(t: torch.Tensor) -> list:
    """``t.tolist()``, reusing the previous read while ``t`` is the same, unmodified object.

    Tensors made under ``torch.inference_mode()`` keep no version counter, so they are read every time.
    """
    if t.is_inference():
        return t.tolist()
    key = id(t)
    hit = _values.get(key)
    if hit is not None:
        ref, version, values = hit
        if ref() is t and version == t._version:
            return values
    values = t.tolist()
    _values[key] = (weakref.ref(t, lambda _ref, k=key: _values.pop(k, None)), t._version, values)
    return values
