"""Launch configs for the conv1d decode kernel: BLOCK_D and num_warps from (D, B).

No measured table yet: the fallback below is reasoned from the sm_90 compile (ptxas -v), not
timed. Replace it with rows from `python -m fastmamba.bench tune conv1d` on the target GPU, keyed
by (GPU family, dtype, state_len, D, B bucket), and put the benchmark rows in the commit message.

Reasoning behind the fallback:
* Every [BLOCK_D] vector has one channel per lane (see kernel.py), repeated
  BLOCK_D / (32 * num_warps) times per thread. Two repeats keep the W=4, L=1 kernel at 32
  registers (full occupancy) with no spills on sm_90; four need 48-80 registers.
* The op moves ~(2 * state_len + 2) elements per channel and does almost no math, so large
  batches want enough CTAs to fill every SM several times: 512 channels (8 warps) per program.
* Small batches (B=1 decode) are latency bound (slot index -> state load -> store): smaller
  programs, 128 channels, spread that chain over more SMs.
* Long histories (many tokens L) keep one channel per thread so their columns stay in registers.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import triton

_REPEATS = 2  # channels per thread
_BIG_WORK = 1024  # programs of 512 channels at which the large block is used
_MAX_LIVE_COLUMNS = 16  # [BLOCK_D] fp32 vectors per repeat above which a thread keeps one channel


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

_forced: Conv1dUpdateConfig | None = None


@contextlib.contextmanager
def forced_config(block_d: int, num_warps: int) -> Iterator[None]:
    """Use this config for every launch inside the block (the tuning sweep's hook)."""
    global _forced, _forced_flat
    previous = (_forced, _forced_flat)
    _forced = _forced_flat = Conv1dUpdateConfig(block_d, num_warps)
    try:
        yield
    finally:
        _forced, _forced_flat = previous


def pick_config(D: int, B: int, live_columns: int, *, interpreter: bool) -> Conv1dUpdateConfig:
    """Choose (BLOCK_D, num_warps) for D channels and B requests.

    ``live_columns`` counts the [BLOCK_D] fp32 vectors a program keeps in registers (history
    columns, weight taps, outputs). Under the interpreter the smallest block is used: its cost
    grows with the number of programs, and a small block lets small test shapes cover partial
    blocks.
    """
    if _forced is not None:
        return _forced
    if interpreter:
        return Conv1dUpdateConfig(block_d=32, num_warps=1)
    if B * triton.cdiv(D, 512) >= _BIG_WORK:
        block_d = 512
    elif B * triton.cdiv(D, 256) >= _BIG_WORK // 2:
        block_d = 256
    else:
        block_d = 128
    repeats = _REPEATS if live_columns <= _MAX_LIVE_COLUMNS else 1
    num_warps = max(1, min(8, block_d // (32 * repeats)))
    return Conv1dUpdateConfig(block_d=block_d, num_warps=num_warps)


def pick_vec4_config(D: int, B: int, *, interpreter: bool) -> Conv1dUpdateConfig:
    """(BLOCK_D, num_warps) for the state_len-4 fast path. One warp per 128 channels keeps every
    column split inside a thread (no shared memory: checked in the sm_90 compile)."""
    if _forced_flat is not None:
        return _forced_flat
    if interpreter:
        return Conv1dUpdateConfig(block_d=32, num_warps=1)
    return Conv1dUpdateConfig(block_d=128, num_warps=1)


_forced_flat: Conv1dUpdateConfig | None = None
