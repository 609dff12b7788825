"""Launch configs for the replay state update's two kernels.

Chosen by the launcher from the problem size, never by @triton.autotune (autotuning re-runs an
in-place kernel and would corrupt the state and the replay cache). Under the interpreter the
smallest tiles are used (its cost grows with the number of programs and with tile area).

Only the main kernel's P tile has been measured (one H100 sweep, quoted in pick_config); the
rest are guesses. Replace them with a table from `python -m fastmamba.bench tune --ops replay` (issue 5, item 3), keyed on batch x heads
and the padded token count, and record the GPU, Triton version, date and command here.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import triton


class ReplayConfig(NamedTuple):
    block_p: int  # head-dim rows per main-kernel program (>= 16: tl.dot's smallest M)
    num_warps: int  # main kernel: block_p // 16 (see below)
    heads: int  # heads per precompute program (all of one group)
    warps_pre: int = 4  # precompute kernel


# Why the main kernel's num_warps is block_p // 16: its three tl.dot form a chain (the replayed
# state feeds the output matmul), and Triton then lays every warp along M (the P rows, 16 per
# warp). More warps hold copies of the same rows; fewer spill (sm_90, Triton 3.6, N=128, T=6:
# (16, 1) 168 registers with bf16 activations and fp32 state, 226 with stochastic rounding of a
# 16-bit state; (64, 4) runs wgmma m64n128k8, 147-232 registers, and is the only tile without
# spills for fp32 activations; (32, 1) and (64, 2) spill.)
# what the tuning sweep tries
CANDIDATES = [
    dict(block_p=bp, num_warps=bp // 16, heads=hd, warps_pre=wp)
    for bp in (16, 32, 64)
    for hd in (4, 8, 16)
    for wp in (2, 4)
]

_forced: ReplayConfig | None = None


@contextlib.contextmanager
def forced_config(block_p: int, num_warps: int, heads: int, warps_pre: int = 4) -> Iterator[None]:
    """Use this config for every launch inside the block (the tuning sweep's hook)."""
    global _forced
    previous, _forced = _forced, ReplayConfig(block_p, num_warps, heads, warps_pre)
    try:
        yield
    finally:
        _forced = previous


def pick_config(
    *, programs_per_block: int, headdim: int, dstate: int, t_pad: int, interpreter: bool, act_bytes: int = 2
) -> ReplayConfig:
    """Config for ``programs_per_block`` = requests x heads, head dim P, state size N and the
    token count padded for tl.dot (``t_pad`` >= 16).

    Guess until the sweep: one program per (request, head) for P <= 64 (wgmma at P = 64, no
    spills for any dtype). The precompute program holds [heads, t_pad, t_pad] fp32 tiles:
    fewer heads for longer drafts. ``programs_per_block`` and ``dstate`` are the table's keys.
    """
    if _forced is not None:
        return _forced._replace(block_p=max(16, min(_forced.block_p, triton.next_power_of_2(headdim))))
    heads = max(1, min(8, 8 * 16 * 16 // (t_pad * t_pad)))
    if interpreter:
        return ReplayConfig(block_p=16, num_warps=1, heads=min(4, heads), warps_pre=1)
    # H100, T=6, bf16 activations, fp32 state (scripts/dev_replay_timing.py sweep, 2026-11-22):
    # 16 rows per program vs 32 / 64: 9.9 / 11.3 / 11.6 us (2.7b, batch 1), 23.1 / 21.8 / 24.2
    # (batch 8), 316 / 317 / 321 (batch 128), Nemotron-H batch 128 437 / 439 / 452. fp32
    # activations keep 64 (the only tile whose tf32x3 dots do not spill).
    block_p = 64 if act_bytes >= 4 else 16
    block_p = max(16, min(block_p, triton.next_power_of_2(headdim)))
    return ReplayConfig(block_p=block_p, num_warps=block_p // 16, heads=heads, warps_pre=4)
