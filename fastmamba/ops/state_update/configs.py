"""Launch configuration for the state-update kernel: (BLOCK_P, num_warps).

Chosen by the launcher from the problem size, never by @triton.autotune (autotuning re-runs an
in-place kernel and would corrupt the state). Under the interpreter the smallest tile is used.

Table: GPU family, Triton version, date and the command that produced it are recorded with each
entry once it is measured (`python -m fastmamba.bench tune state_update`).
"""
from __future__ import annotations

import contextlib
import functools


from fastmamba.ops._common.dispatch import interpreter_enabled
from fastmamba.ops._common.forced import Forced
from fastmamba.ops._common.host_math import next_power_of_2


# what `python -m fastmamba.bench tune --ops ssu` tries
# (Streaming cache hints on the state, evict_first loads and .cs stores, were swept too on the
# H200: no gain at batch 64 or 256, so the kernel does without them.)
CANDIDATES = [
    dict(block_p=bp, num_warps=w)
    for bp in (2, 4, 8, 16, 32)
    for w in (1, 2, 4, 8)
    if 4 <= bp * 128 // (32 * w) <= 128  # 4..128 state elements per thread at N=128
]

_forced: Forced[tuple[int, int]] = Forced()

# Where the kernel stores the final state: before the last token's output reduction ("early":
# its fp32 tile dies sooner; sm_90 compile, P=64, N=128, (16, 1) tile: bf16 state 127 -> 111
# registers, fp32 state 128 -> 96) or after it. "auto" = early for requests x heads <= 2048
# (batch 1-8), after for more. H200, 2026-11-22, dev_pdl_waves (retired, docs/experiments.md) --ops ssu --store-early
# 0,1: early is 1-4% faster at batch 1 and 8 (Nemotron-H fp32 batch 1 with PDL 4.01 -> 3.84 us,
# bf16 batch 8 12.22 -> 11.69 us) and 1-3% slower at batch 64 and 256 (2.7b fp32 batch 64
# 88.6 -> 91.3 us). True / False force one placement (experiments).
STORE_EARLY: bool | str = "auto"


def store_state_early(programs_per_block: int) -> bool:
    """Whether the kernel stores the final state before the last output (see STORE_EARLY)."""
    if STORE_EARLY == "auto":
        return programs_per_block <= 2048
    return bool(STORE_EARLY)


def forced_config(block_p: int, num_warps: int) -> contextlib.AbstractContextManager[None]:
    """Use (block_p, num_warps) for every launch inside the block (the tuning sweep's hook)."""
    return _forced.use((block_p, num_warps))


# Measured on one NVIDIA H200 (Triton 3.6.0, torch 2.11, 2026-11-22) with
# `python -m fastmamba.bench tune --ops ssu`, P=64, N=128, bf16 activations, cold L2:
#   B*H <= 256 (batch 1-2):  fp32 state (8, 8) 4.16 us (2.7b) | bf16 state (16, 8) 3.33 us
#   B*H <= 2048 (batch 8):   fp32 state (8, 2) 13.5 us (2.7b) | bf16 state (16, 1) 11.75 us (nemotron)
#   larger (batch 64, 256):  (16, 1) everywhere, 90-92% of the copy bandwidth at batch 256
#   with PDL on (`tune --pdl`), batch 1: (32, 8) 2.25-3.88 us, (16, 8) 2.82 us for 2.7b fp32
# (BLOCK_P, num_warps); num_warps scales with N / 128 for other state sizes.
_MEASURED = {
    # (state bytes, latency bucket) -> (BLOCK_P, num_warps)
    (4, 0): (8, 8), (4, 1): (8, 2), (4, 2): (16, 1),
    (2, 0): (16, 8), (2, 1): (16, 1), (2, 2): (16, 1),
}


def pick_config(
    *, programs_per_block: int, headdim: int, dstate: int, state_bytes: int, pdl: bool = False
) -> tuple[int, int]:
    """(BLOCK_P, num_warps) for ``programs_per_block`` = requests x heads.

    Few (request, head) pairs are latency bound: more warps per program. Many are bandwidth
    bound: one warp holding 16 x N state elements gives each thread 16 loads of 16 bytes in flight.
    """
    if _forced.value is not None:
        return _forced.value
    if interpreter_enabled():
        return min(next_power_of_2(headdim), 16), 1
    return _pick_config(programs_per_block, headdim, dstate, state_bytes, pdl)


@functools.lru_cache(maxsize=4096)
def _pick_config(programs_per_block: int, headdim: int, dstate: int, state_bytes: int, pdl: bool) -> tuple[int, int]:
    """pick_config's table lookup, cached per shape (an eager call's host time, issue 19)."""
    bucket = 0 if programs_per_block <= 256 else 1 if programs_per_block <= 2048 else 2
    if pdl and bucket == 0:  # fewer, larger programs leave SM room for the next kernel's early ones
        block_p, num_warps = 32, 8
    elif pdl and bucket == 1 and state_bytes >= 4:
        # H200, 2026-11-22, dev_pdl_waves (retired, docs/experiments.md) --ops ssu --batch 8 --variants pdl-1wave
        # --configs ...: fp32 state under PDL, (16, 1) 13.09 / 19.22 us (2.7b / Nemotron-H) vs
        # (8, 2) 13.4 / 19.9 us; without PDL (8, 2) stays ahead (13.6 vs 14.7, 20.1 vs 22.3 us)
        block_p, num_warps = 16, 1
    else:
        block_p, num_warps = _MEASURED.get((min(state_bytes, 4), bucket), (16, 1))
    scale = max(1, next_power_of_2(dstate) // 128)
    block_p = min(block_p, next_power_of_2(headdim))
    num_warps = max(1, min(8, num_warps * scale))
    return block_p, num_warps
