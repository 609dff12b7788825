"""Where an op runs: the Triton kernel or the PyTorch reference.

CUDA tensors always run the Triton kernel. CPU tensors run the same Triton kernel when the
interpreter is on (``TRITON_INTERPRET=1``, set before Python starts: Triton reads it when a
function is decorated), otherwise the plain-PyTorch reference. Layers therefore never carry a
second hand-written copy of the math.
"""
from __future__ import annotations

import os

import torch


def interpreter_enabled() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op whose main operand is ``t`` should launch its Triton kernel."""
    return t.is_cuda or (t.device.type == "cpu" and interpreter_enabled())


def inline_asm_ok(t: torch.Tensor) -> bool:
    """Whether a kernel launched on ``t`` may run inline PTX (the approximate-math paths): a CUDA
    tensor outside the interpreter, which runs no inline assembly."""
    return t.is_cuda and not interpreter_enabled()
