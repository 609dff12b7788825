"""Where an op runs: the Triton kernel or the PyTorch reference.

CUDA tensors always run the Triton kernel. CPU tensors run the same Triton kernel when the
interpreter is on (``TRITON_INTERPRET=1``, set before Python starts: Triton reads it when a
function is decorated), otherwise the plain-PyTorch reference. Layers therefore never carry a
second hand-written copy of the math.
"""
from __future__ import annotations

import functools
import os

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


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


def call_directly(x: torch.Tensor | None = None) -> bool:
    """Whether a public op may call its registered custom op's implementation as a plain Python
    function, skipping the dispatcher (issue 19: the ``torch.library`` round trip -- argument
    defaults, the autograd key, the redispatch -- is most of an eager call's host time).

    Only in plain eager use: not while torch.compile / export traces (it must see the custom op and
    its fake impl), not under a Python dispatch mode (FakeTensorMode, functionalization, a user's
    TorchDispatchMode) nor a torch-function mode. CUDA-graph capture records the same kernels
    either way. With ``x`` (the op's main operand), also not for a tensor subclass (FakeTensor,
    functional tensors...), which must reach the registered op, nor for a tensor on the meta device
    (shape inference: the dispatcher runs the op's fake implementation, which reads no values).
    """
    return ((x is None or (type(x) is torch.Tensor and x.device.type != "meta")) and not torch.compiler.is_compiling()
            and _get_current_dispatch_mode() is None and not torch._C._is_torch_function_mode_enabled())


def gpu_family(device: torch.device) -> str:
    """The GPU family that keys the ops' tuning tables: "h100", "h200", "a100", ... from the device
    name; "cpu" for a CPU tensor."""
    if device.type != "cuda":
        return "cpu"
    return _cuda_family(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_family(index: int) -> str:
    name = torch.cuda.get_device_name(index).lower()
    for fam in ("h200", "h100", "h20", "gh200", "b200", "a100", "l40", "a10"):
        if fam in name:
            return fam
    return name.replace(" ", "_")
