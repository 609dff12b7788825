"""The layers' non-persistent buffers after ``Module.to_empty``.

A model built on the meta device and moved with ``to_empty`` (tensor parallelism builds each rank's
model that way) holds uninitialised memory in every buffer. The persistent ones are loaded from
the checkpoint next; the non-persistent ones are in no checkpoint, so nothing would ever fill them:
attention's float8 K/V scales (``k_scale`` / ``v_scale``, 1.0) and the MoE decode kernels' arrival
counters (``decode_arrivals``, zeros; garbage there makes the kernels' last-program election wrong).
Each layer that holds such buffers says what they start as in ``reset_runtime_buffers()``.
"""
from __future__ import annotations

from torch import nn


def reset_runtime_buffers(model: nn.Module) -> None:
    """Give every non-persistent buffer of ``model`` the value its layer builds it with. Raises
    TypeError naming the module when a module holds non-persistent buffers but no
    ``reset_runtime_buffers()`` (a new layer kind must say what its buffers start as)."""
    for name, module in model.named_modules():
        if not module._non_persistent_buffers_set:
            continue
        reset = getattr(module, "reset_runtime_buffers", None)
        if reset is None:
            raise TypeError(f"reset_runtime_buffers: {name or 'the model'} ({type(module).__name__}) holds "
                            f"non-persistent buffers {sorted(module._non_persistent_buffers_set)} but no "
                            "reset_runtime_buffers() saying what they start as")
        reset()
