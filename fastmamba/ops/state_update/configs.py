"""Launch configuration for the state-update kernel: (BLOCK_P, num_warps).

Chosen by the launcher from the problem size, never by @triton.autotune (autotuning re-runs an
in-place kernel and would corrupt the state). Under the interpreter the smallest tile is used.

Table: GPU family, Triton version, date and the command that produced it are recorded with each
entry once it is measured (`python -m fastmamba.bench tune state_update`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import triton

from fastmamba.ops._common.dispatch import interpreter_enabled


# what `python -m fastmamba.bench tune --ops ssu` tries
CANDIDATES = [
    dict(block_p=bp, num_warps=w)
    for bp in (2, 4, 8, 16, 32)
    for w in (1, 2, 4, 8)
    if 4 <= bp * 128 // (32 * w) <= 64  # 4..64 state elements per thread at N=128
]

_forced: tuple[int, int] | None = None


@contextlib.contextmanager
def forced_config(block_p: int, num_warps: int) -> Iterator[None]:
    """Use (block_p, num_warps) for every launch inside the block (the tuning sweep's hook)."""
    global _forced
    previous, _forced = _forced, (block_p, num_warps)
    try:
        yield
    finally:
        _forced = previous


def pick_config(*, programs_per_block: int, headdim: int, dstate: int, state_bytes: int) -> tuple[int, int]:
    """(BLOCK_P, num_warps) for ``programs_per_block`` = requests x heads.

    Few (request, head) pairs: small P blocks so that enough programs cover every SM and each
    has its loads in flight at once (latency bound). Many: larger blocks, fewer programs.
    """
    if _forced is not None:
        return _forced
    if interpreter_enabled():
        return min(triton.next_power_of_2(headdim), 16), 1
    block_n = triton.next_power_of_2(dstate)
    if programs_per_block <= 256:  # batch 1-2 at 80-128 heads: latency bound
        block_p = 4
    elif programs_per_block <= 2048:
        block_p = 8
    else:
        block_p = 16
    block_p = min(block_p, triton.next_power_of_2(headdim))
    # ~16 state elements per thread
    num_warps = max(1, min(8, block_p * block_n // (32 * 16)))
    return block_p, num_warps
