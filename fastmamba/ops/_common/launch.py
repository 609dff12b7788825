"""Lean Triton launches: the compiled kernel called directly once Triton's JIT has picked it.

``kernel[grid](*args, **kwargs)`` on a ``triton.jit`` function runs Triton's whole launch path on
every call: argument binding and specialization of every argument, a cache-key string built from
the options, the global-value check, launch metadata for hooks, then the compiled launcher. For
kernels that take their strides as arguments (ours take 20 to 60) that costs tens of microseconds
of host time, more than the kernel itself at decode sizes (issue 19 item 0).

``lean(kernel)`` wraps a ``triton.jit`` function with the same ``[grid](*args, **kwargs)`` call.
The first call with a given *signature* goes through Triton's JIT (which compiles or finds the
kernel) and keeps the compiled kernel; later calls with that signature call its launcher
directly. The signature holds everything Triton specializes on, so the direct call runs exactly
the kernel the JIT would have picked:

- every non-tensor argument by value (ints: Triton specializes on ``== 1`` and divisibility by 16;
  None becomes a constexpr; constexpr keywords and launch options); an int parameter Triton does
  not specialize (``do_not_specialize``) by its width alone,
- every tensor's dtype and its address modulo 16 (Triton's pointer specialization), and the
  current CUDA device,
- a host TMA descriptor of a registered class (``register_descriptor_type``: Gluon's
  ``TensorDescriptor``) by its base's dtype and alignment, block shape, layout, padding and rank;
  the compiled launcher encodes it on every call.

Only the tensors' addresses, those ints and the grid change between calls that share a signature.
The direct path is off (every call goes through Triton's JIT) under the interpreter, for a
callable grid, while a launch hook is installed (profilers such as proton), for arguments it
cannot key (unregistered, unhashable objects) and for a kernel that needs scratch memory.
"""
from __future__ import annotations

import contextlib
import inspect
import os

import torch
from triton import knobs
from triton.runtime.autotuner import Heuristics
from triton.runtime.jit import JITFunction


def env_switch(name: str, default: bool) -> bool:
    """A boolean environment variable: 1/0, true/false, yes/no, on/off; anything else is an error."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} expected 1/0, true/false, yes/no or on/off, got {os.environ[name]!r}")


# FASTMAMBA_LEAN_LAUNCH=0 sends every launch through Triton's JIT (for measurements and bisection).
ENABLED = env_switch("FASTMAMBA_LEAN_LAUNCH", True)
MAX_SIGNATURES = 4096  # per kernel; a call with a new signature past this runs through the JIT

_Tensor = torch.Tensor
# Triton types a float as fp32 and a bool as u1 whatever the value: keyed by type alone
_UNSPECIALIZED = {float: (float,), bool: (bool,)}
_hooks = knobs.runtime


class _Entry:
    """The compiled kernel of one signature and what its launcher takes besides the call's arguments."""

    __slots__ = ("launch", "function", "head", "tail", "coop", "pdl", "scratch")

    def __init__(self, compiled, tail: tuple):
        launcher = compiled.run  # CudaLauncher (loads the binary on first use)
        self.launch = launcher.launch
        self.function = compiled.function
        self.coop = launcher.launch_cooperative_grid
        self.pdl = launcher.launch_pdl
        self.head = compiled.packed_metadata
        self.tail = tail
        self.scratch = bool(launcher.global_scratch_size or launcher.profile_scratch_size)


_DESCRIPTOR_TYPES: set = set()  # host TMA descriptor classes keyed by what Triton specializes on


def register_descriptor_type(cls) -> None:
    """Let ``signature`` key instances of a host TMA descriptor class (Gluon's ``TensorDescriptor``:
    base, shape, strides, block_shape, layout, padding), so that kernels taking them launch directly
    too; the launcher then encodes each descriptor (``cuTensorMapEncodeTiled``) as on Triton's path."""
    _DESCRIPTOR_TYPES.add(cls)


def _other_key(a) -> tuple:
    """The key of an argument that is neither a tensor, an int, None, a float nor a bool: a registered
    descriptor by its type string's parts (dtype, block shape, layout, padding, rank) and its base's
    16-byte alignment; anything else as itself (unhashable: TypeError at the lookup)."""
    if a.__class__ in _DESCRIPTOR_TYPES:
        base = a.base
        return (a.__class__, base.dtype, base.data_ptr() & 15, tuple(a.block_shape), a.layout, a.padding,
                len(a.shape))
    return (a.__class__, a)


def signature(args: tuple, unspecialized: tuple = ()) -> tuple:
    """The key of a launch's positional ``args`` (see the module docstring): a tensor by its dtype
    and its address modulo 16 (Triton specializes on 16-byte alignment), an int or None by value,
    a float or bool by its type alone (fp32 / u1 whatever the value), any other value with its
    type (True == 1 == 1.0 as keys, but Triton types them apart). An int at a position in
    ``unspecialized`` is keyed by whether it fits 32 bits (Triton's i32 / i64), not its value.
    Raises TypeError for an unhashable argument."""
    key = [a if a.__class__ is int else (a.dtype, a.data_ptr() & 15) if isinstance(a, _Tensor)
           else a if a is None else _UNSPECIALIZED.get(a.__class__) or _other_key(a) for a in args]
    for i in unspecialized:
        if i < len(key) and args[i].__class__ is int:
            key[i] = -0x80000000 <= args[i] <= 0x7FFFFFFF
    return tuple(key)


def trailing_params(fn, n_positional: int, kwargs: dict) -> tuple:
    """The values of ``fn``'s parameters after the first ``n_positional``, in order: the keywords
    given, else the parameter's default (Triton's launcher takes every parameter, constexprs too)."""
    out = []
    for p in fn.params[n_positional:]:
        name = p.name
        if name in kwargs:
            out.append(kwargs[name])
        elif p.default is not inspect.Parameter.empty:
            out.append(p.default)
        else:
            raise TypeError(f"{fn.__name__}: missing argument `{name}`")
    return tuple(out)


class LeanKernel:
    """A ``triton.jit`` function (or one under ``triton.heuristics``, whose values must follow from
    what the signature holds: ours test ``is not None``) whose launches skip Triton's JIT path after
    the first call of each signature. ``k[grid](*args, **kwargs)`` as for the function itself;
    attributes pass through."""

    def __init__(self, fn):
        self.fn = fn
        self.entries: dict = {}
        jit = fn.fn if isinstance(fn, Heuristics) else fn
        self.jit = jit
        self.heuristics = fn.values if isinstance(fn, Heuristics) else {}
        self.direct = isinstance(jit, JITFunction)  # not the interpreter's function
        # parameters Triton does not specialize on: an int there is keyed by its type (i32 or i64)
        # alone, so a varying length does not make a new signature
        self.unspecialized = tuple(p.num for p in jit.params if p.do_not_specialize) if self.direct else ()

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        if not (self.direct and ENABLED) or callable(grid):
            return self.fn[grid]
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def run(self, grid, args: tuple, kwargs: dict):
        if _hooks.launch_enter_hook.calls or _hooks.launch_exit_hook.calls:
            return self.fn[grid](*args, **kwargs)
        device = torch._C._cuda_getDevice()  # CUDA is initialised: the tensors are on it
        try:
            key = (device, signature(args, self.unspecialized), tuple(kwargs.items()))
            entry = self.entries.get(key)
        except TypeError:  # an unhashable argument (a TMA descriptor): Triton's path binds it
            return self.fn[grid](*args, **kwargs)
        if entry is None:
            compiled = self.fn[grid](*args, **kwargs)
            if compiled is not None and len(self.entries) < MAX_SIGNATURES:
                entry = _Entry(compiled, trailing_params(self.jit, len(args), self._with_heuristics(args, kwargs)))
                if not entry.scratch:
                    self.entries[key] = entry
            return compiled
        n = len(grid)
        # tensors go to the launcher as they are: it reads their addresses and checks each one
        # with the driver, as on Triton's path
        entry.launch(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
                     torch._C._cuda_getCurrentRawStream(device), entry.function, entry.coop, entry.pdl,
                     None, None, entry.head, None, None, None, *args, *entry.tail)
        return None

    def _with_heuristics(self, args: tuple, kwargs: dict) -> dict:
        """``kwargs`` plus the values the kernel's heuristics give for this call."""
        if not self.heuristics:
            return kwargs
        named = {**dict(zip(self.jit.arg_names, args)), **kwargs}
        return {**kwargs, **{name: h(named) for name, h in self.heuristics.items()}}


_wrapped: dict = {}
_NO_SWITCH = contextlib.nullcontext()


def on_device(t: torch.Tensor):
    """A context in which kernels launch on ``t``'s GPU: ``torch.cuda.device`` only when that is not
    already the current device (entering it costs microseconds per launch), else nothing."""
    if t.is_cuda and t.get_device() != torch._C._cuda_getDevice():
        return torch.cuda.device(t.device)
    return _NO_SWITCH


def lean(fn) -> LeanKernel:
    """The lean launcher of a ``triton.jit`` function (see the module docstring), made on first use
    and kept: call sites write ``lean(_kernel)[grid](...)``, so a kernel replaced at run time (a
    test's spy, the interpreter's function) is launched as it is."""
    k = _wrapped.get(fn)
    if k is None:
        k = _wrapped[fn] = LeanKernel(fn)
    return k
