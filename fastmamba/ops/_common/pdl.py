"""Programmatic dependent launch (PDL, Hopper and newer): opt-in for the ops, on in the runtime's graphs.

With PDL a kernel's programs may be scheduled while the kernel before it in the stream is still
finishing; each program first reads what a decode step never produces in the kernel just before
(weights, slot indices, and its rows of the state cache), then waits (``griddepcontrol.wait``)
before touching the activations the previous kernel may have written. Inside a CUDA graph of
back-to-back decode kernels this hides the launch gap and the state-load latency.

Contract when it is on: weights, slot-index tensors and the state caches (conv and SSM) passed to
our kernels must not be written by the kernel launched immediately before them. In a Mamba-2
decode step (in_proj -> conv update -> state update -> norm -> out_proj) the caches are written
only by their own op one step earlier, so this holds; a host copy or any earlier kernel is fine.
Activations (x, dt, B, C, z) are always read after the wait.
Off by default for calls of the ops; turn on with ``FASTMAMBA_PDL=1`` or ``with
programmatic_dependent_launch():``. The runtime's decode and verify graphs (``GraphedDecoder``,
``GraphedVerifier``: their steps keep the contract) capture inside it by default on sm_90+.
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

_enabled = os.environ.get("FASTMAMBA_PDL", "0").lower() in ("1", "true", "yes", "on")

# Where a PDL program lets its dependents launch: right after its grid-dependency wait (kernels take
# it as their PDL_TRIGGER constexpr; the conv update's multi-wave grids trigger at exit instead,
# ``pdl_launch``). Measured against a trigger at exit for every kernel: docs/experiments.md (dev_pdl_waves).
TRIGGER_EARLY = True


@contextlib.contextmanager
def programmatic_dependent_launch(enabled: bool = True) -> Iterator[None]:
    """Turn PDL on (or off) for launches inside the block (capture a CUDA graph inside it)."""
    global _enabled
    previous, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = previous


@functools.lru_cache(maxsize=None)
def _sm_info(device_index: int) -> tuple[bool, int]:
    props = torch.cuda.get_device_properties(device_index)
    return props.major >= 9, props.multi_processor_count


def _device_sm_info(t: torch.Tensor) -> tuple[bool, int]:
    """_sm_info of ``t``'s CUDA device (the current one for a tensor on plain "cuda")."""
    return _sm_info(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_requested(t: torch.Tensor) -> bool:
    """PDL is switched on and ``t`` is a CUDA tensor (launch configs may differ under PDL)."""
    return _enabled and t.is_cuda


def pdl_supported(t: torch.Tensor) -> bool:
    """Whether ``t``'s device can launch programmatic dependents (a CUDA tensor on sm_90 or newer),
    whether or not PDL is switched on: for chains of our own kernels inside one op, where the
    contract above is ours to keep."""
    if not t.is_cuda:
        return False
    return _device_sm_info(t)[0]


def pdl_active(t: torch.Tensor, programs: int, num_warps: int) -> bool:
    """Whether a launch of ``programs`` programs of ``num_warps`` warps on ``t``'s device uses PDL.

    Only grids that fit on the GPU in one wave (at most 32 programs and 64 warps per SM) use it:
    there the launch gap and load latency are most of the time, and PDL hides them. Multi-wave,
    bandwidth-bound grids ran slower with it on an H200 (the next kernel's early programs hold
    SM slots while they wait), so they launch plainly. Re-measured 2026-11-22 (H200, the retired
    dev_pdl_waves script, per call in graphs of back-to-back calls): every grid under PDL,
    state update fp32 batch 256 347 -> 356 us (2.7b), 555 -> 570 us (Nemotron-H); conv update
    batch 256 10.4 -> 15.1 us (D=5376, state_len 4); with the dependents launched only as programs
    exit the state update is as slow and the conv 1-3% faster.
    """
    if not (_enabled and t.is_cuda):
        return False
    return _device_sm_info(t)[0] and fits_one_wave(t, programs, num_warps)


def pdl_chained(t: torch.Tensor, programs: int, num_warps: int) -> bool:
    """Whether a kernel that follows another kernel of the same op in the stream uses PDL: as
    ``pdl_active`` when PDL is switched on, else on sm_90+ for grids of one wave all the same. Such a
    kernel waits for the kernel before at its start (it reads nothing earlier), and the op's first
    kernel launches plainly, after everything its caller queued: the contract above is the op's to
    keep, whoever calls it (as the replay op's ``CHAIN_PDL``)."""
    if pdl_active(t, programs, num_warps):
        return True
    return pdl_supported(t) and fits_one_wave(t, programs, num_warps)


def pdl_launch(t: torch.Tensor, programs: int, num_warps: int) -> tuple[bool, bool]:
    """(use PDL, trigger early) for a streaming kernel that gains from PDL on multi-wave grids
    too, when its programs let the dependents launch only as they exit (the conv update: H200,
    batch 256, 1-3% faster per call than a plain launch; an early trigger there is 40-55% slower).
    Grids of one wave use PDL as ``pdl_active`` says, with the early trigger."""
    if not (_enabled and t.is_cuda):
        return False, True
    if pdl_active(t, programs, num_warps):
        return True, TRIGGER_EARLY
    return _device_sm_info(t)[0], False


def pdl_launch_early(t: torch.Tensor) -> tuple[bool, bool]:
    """(use PDL, trigger early) for a streaming kernel that gains from PDL with the early trigger
    on grids of any size: the prefill conv's channel-last rows kernel (H200, graphs of back-to-back
    calls, ``bench prefill --ops conv_fn`` with PDL on every grid: 1 x 2048 D=5376 13.9 ->
    13.3 us, D=10240 24.3 -> 23.8 us, 8 x 8192 within 1%; the channel-first kernel, by contrast,
    ran 8-23% slower with it and keeps ``pdl_launch``)."""
    if not (_enabled and t.is_cuda):
        return False, True
    return _device_sm_info(t)[0], TRIGGER_EARLY


def fits_one_wave(t: torch.Tensor, programs: int, num_warps: int) -> bool:
    """Whether ``programs`` programs of ``num_warps`` warps fit on ``t``'s GPU at once (at most 32
    programs and 64 warps per SM), the condition ``pdl_active`` puts on PDL."""
    return programs <= _device_sm_info(t)[1] * min(32, 64 // num_warps)


def sm_count(t: torch.Tensor) -> int:
    """Multiprocessors of ``t``'s CUDA device."""
    return _device_sm_info(t)[1]
