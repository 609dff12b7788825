"""Input validation shared by the ops' api modules.

Every check raises before any kernel runs, so a bad call never leaves state half written.
Messages name the op, the argument, what was expected and what came.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from fastmamba.ops._common.host_values import host_list, host_reads_allowed

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _fmt_shape(shape: Sequence[object]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def check_tensors(op: str, required: Sequence[tuple[str, object]], optional: Sequence[tuple[str, object]] = ()) -> None:
    """TypeError unless each ``required`` value is a torch.Tensor and each ``optional`` one a
    tensor or None (a list, a number or None where a tensor is needed would otherwise fail later
    with an AttributeError that names nothing)."""
    for name, t in required:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: `{name}` expected a torch.Tensor, got {type(t).__name__}")
    for name, t in optional:
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: `{name}` expected a torch.Tensor or None, got {type(t).__name__}")


def check_int(op: str, name: str, value: object) -> int:
    """``value`` as an int; TypeError for anything but an integer (bool excluded, float refused:
    1.5 or "a" as a slot id would otherwise compare unequal to every index)."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)) and not hasattr(value, "__index__"):
        raise TypeError(f"{op}: `{name}` expected an int, got {type(value).__name__} {value!r}")
    return int(value)


def check_flag(op: str, name: str, value: object) -> bool:
    """``value`` as a bool: True / False (or 0 / 1); anything else ("no", 0.5, None...) is a TypeError,
    not silently truthy."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{op}: `{name}` expected a bool, got {type(value).__name__} {value!r}")


def check_shape(op: str, name: str, t: torch.Tensor, expected: Sequence[tuple[str, int | None]]) -> None:
    """Raise ValueError unless ``t.shape`` matches ``expected``.

    ``expected`` is a sequence of (letter, size) pairs; a size of None accepts any extent.
    """
    shape = t.shape
    if len(shape) == len(expected):
        for (_, w), g in zip(expected, shape):
            if w is not None and w != g:
                break
        else:
            return
    desc = _fmt_shape(f"{k}={v}" if v is not None else k for k, v in expected)
    raise ValueError(f"{op}: `{name}` expected shape {desc}, got {_fmt_shape(tuple(shape))}")


def check_dtype(op: str, name: str, t: torch.Tensor, allowed: Iterable[torch.dtype]) -> None:
    if t.dtype not in allowed:
        allowed = tuple(allowed)
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{op}: `{name}` expected dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")


def check_same_dtype(op: str, names_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    ref_name, ref = names_tensors[0]
    for name, t in names_tensors[1:]:
        if t.dtype != ref.dtype:
            raise TypeError(
                f"{op}: `{name}` has dtype {str(t.dtype).replace('torch.', '')} but `{ref_name}` has "
                f"{str(ref.dtype).replace('torch.', '')}; they must match"
            )


def check_same_device(op: str, names_tensors: Sequence[tuple[str, torch.Tensor | None]]) -> torch.device:
    ref_name = ref = device = None
    for name, t in names_tensors:
        if t is None:
            continue
        if ref is None:
            ref_name, ref, device = name, t, t.device
        elif t.device != device:
            raise ValueError(f"{op}: `{name}` is on {t.device} but `{ref_name}` is on {device}; all tensors must share a device")
    return device


def check_unit_stride(op: str, name: str, t: torch.Tensor, dim: int) -> None:
    if t.size(dim) > 1 and t.stride(dim) != 1:
        raise ValueError(
            f"{op}: `{name}` must be contiguous in dim {dim} (stride 1), got strides {tuple(t.stride())}"
        )


def check_indices(op: str, name: str, idx: torch.Tensor, batch: int, num_slots: int, pad_slot_id: int,
                  read: bool = True) -> None:
    """Slot indices: shape (B,), int32/int64, each in [0, num_slots) or equal to pad_slot_id.

    The range check reads the indices on the host (a small device sync on CUDA), every call: a
    cached read could miss a change made behind the version counter. It is skipped where host
    reads are not allowed (CUDA-graph capture, torch.compile tracing, ``trusted_inputs()``: see
    host_values.py); the kernels then treat an index outside [0, num_slots) as a pad slot, so
    nothing is ever written outside the pool. ``read=False``: shape and dtype only (the caller
    checks the values on the device: ops/_common/varlen_checks.py).
    """
    check_dtype(op, name, idx, INDEX_DTYPES)
    check_shape(op, name, idx, [("B", batch)])
    if not read or not host_reads_allowed(idx):
        return
    check_index_values(op, name, idx, num_slots, pad_slot_id)


def check_index_values(op: str, name: str, idx: torch.Tensor | Sequence[int] | None, num_slots: int,
                       pad_slot_id: int) -> None:
    """Raise ValueError unless every value of ``idx`` lies in [0, num_slots) or equals pad_slot_id.

    Always reads the values of a tensor (the references call it before writing anything: a Python
    index of -3 would otherwise write row S-3, and a loop would leave earlier rows written before it
    failed); a host sequence (a caller's copy of the values) is checked as it is.
    """
    if idx is None:
        return
    values = host_list(idx) if isinstance(idx, torch.Tensor) else idx
    bad = [int(v) for v in values if v != pad_slot_id and not 0 <= v < num_slots][:4]
    if bad:
        raise ValueError(
            f"{op}: `{name}` values must lie in [0, {num_slots}) or equal pad_slot_id={pad_slot_id}; got {bad}"
        )


def parse_activation(op: str, activation: str | bool | None) -> bool:
    """The conv ops' ``activation``: None / False -> no activation, "silu" / "swish" / True -> SiLU
    (True and False as vLLM passes them); anything else is a ValueError."""
    if activation is None or activation is False:
        return False
    if activation is True or activation in ("silu", "swish"):
        return True
    raise ValueError(f'{op}: `activation` expected None, "silu" or "swish", got {activation!r}')


def check_host_copies(op: str, copies: Iterable[tuple[str, Sequence[int] | None, torch.Tensor]]) -> None:
    """``copies``: (name, the caller's host copy of a tensor's values or None, the tensor). Raise
    ValueError when a given copy's length differs from its tensor's."""
    for name, given, t in copies:
        if given is not None and len(given) != t.shape[0]:
            raise ValueError(f"{op}: `{name}` has {len(given)} values, its tensor {t.shape[0]}")
