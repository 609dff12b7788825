"""Launch configs for the conv1d decode kernels: (BLOCK_D, num_warps), and which kernel runs.

Measured on one NVIDIA H200 (Triton 3.6.0, torch 2.11, 2026-11-22) with
`python -m fastmamba.bench tune --ops conv` (W=4, bf16, cold L2, D 5376 and 10240, batch 1-256);
the numbers are quoted where each choice is made. Every [BLOCK_D] vector of the column kernel has
one channel per lane; the state_len-4 kernel gives each thread 4 channels' 16-byte rows.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple

from fastmamba.ops._common.forced import Forced
from fastmamba.ops._common.host_math import cdiv


class Conv1dUpdateConfig(NamedTuple):
    block_d: int
    num_warps: int


# what `python -m fastmamba.bench tune --ops conv` tries
CANDIDATES = [
    dict(block_d=bd, num_warps=w)
    for bd in (64, 128, 256, 512, 1024)
    for w in (1, 2, 4, 8)
    if 1 <= bd // (32 * w) <= 4
]

_forced: Forced[Conv1dUpdateConfig] = Forced()


def forced_config(block_d: int, num_warps: int) -> contextlib.AbstractContextManager[None]:
    """Use this config for every launch inside the block (the tuning sweep's hook)."""
    return _forced.use(Conv1dUpdateConfig(block_d, num_warps))


def pick_config(D: int, B: int, live_columns: int, *, interpreter: bool) -> Conv1dUpdateConfig:
    """Choose (BLOCK_D, num_warps) for the column kernel: D channels, B requests.

    Measured on one NVIDIA H200 (Triton 3.6.0, 2026-11-22, `python -m fastmamba.bench tune --ops
    conv`, W=4, state_len 3, bf16, cold L2): one channel per thread, 128 channels per program was
    best or within 4% of best at every batch (D=10240, batch 256: 16.7 us vs 19.0 us for 512 x 8
    warps). Under the interpreter the smallest block is used (its cost grows with programs).
    """
    if _forced.value is not None:
        return _forced.value
    if interpreter:
        return Conv1dUpdateConfig(block_d=32, num_warps=1)
    return Conv1dUpdateConfig(block_d=128, num_warps=4)


def use_vec4_kernel(D: int, B: int) -> bool:
    """The state_len-4 vector kernel wins once there is bandwidth to win (H200: 72% vs 58% of copy
    at D=10240, batch 256); at batch 1-8 the column kernel's smaller programs are faster
    (2.3 us vs 2.6-2.9 us), so it keeps the latency-bound sizes."""
    return B * cdiv(D, 128) >= 1024


def pick_vec4_config(D: int, B: int, *, interpreter: bool) -> Conv1dUpdateConfig:
    """(BLOCK_D, num_warps) for the state_len-4 fast path. One warp per 128 channels keeps every
    column split inside a thread (no shared memory: checked in the sm_90 compile)."""
    if _forced.value is not None:
        return _forced.value
    if interpreter:
        return Conv1dUpdateConfig(block_d=32, num_warps=1)
    return Conv1dUpdateConfig(block_d=128, num_warps=1)  # H200 tune: best at batch 64 and 256


def use_rows_kernel(D: int, B: int) -> bool:
    """The 16-byte row kernel (rows_kernel.py) for bandwidth-bound sizes, the column kernel for
    latency-bound ones. H200, W=4, state_len 3, bf16 (dev_pdl_waves (retired, docs/experiments.md), 2026-11-22):
    batch 256 8.55 vs 10.28 us (D=5376), 13.37 vs 17.26 us (D=10240); batch 64 3.88 vs 4.38 us and
    5.19 vs 6.28 us; batch 8 2.67 vs 2.56 us and 2.82 vs 2.70 us; batch 1 2.42 vs 2.26 us (D=5376).
    State_len 4 keeps its own kernel: the row kernel was slower there (H200, batch 256, D=5376 11.7
    vs 10.4 us, D=10240 18.1 vs 17.1 us at its best tile)."""
    return B * cdiv(D, 128) >= 1024


def pick_rows_config(
    D: int, B: int, *, interpreter: bool, one_wave: Callable[[Conv1dUpdateConfig], bool] | None = None
) -> Conv1dUpdateConfig:
    """(BLOCK_D, num_warps) for the row kernel: 8 channels per thread, one warp per 256 channels
    (H200, batch 1-256, D 5376 and 10240: best or within 3% of the best of 256x1, 512x1, 512x2,
    1024x2, 1024x4 without PDL). ``one_wave`` (given when PDL is on) says whether a config's grid
    fits the GPU in one wave: where 256x1 does not and 1024x4 does, 1024x4 runs under PDL (H200,
    D=5376 batch 256: 7.96 us vs 8.24 us for 256x1 launched with the exit trigger; at D=10240 no
    tile fits one wave and 256x1 with the exit trigger is the fastest, 13.14 us)."""
    if _forced.value is not None:
        return _forced.value
    if interpreter:
        return Conv1dUpdateConfig(block_d=64, num_warps=1)
    small, wide = Conv1dUpdateConfig(block_d=256, num_warps=1), Conv1dUpdateConfig(block_d=1024, num_warps=4)
    if one_wave is not None and not one_wave(small) and one_wave(wide):
        return wide
    return small
