"""Launch configs for the replay state update's two kernels.

Chosen by the launcher from the problem size, never by @triton.autotune (autotuning re-runs an
in-place kernel and would corrupt the state and the replay cache). Under the interpreter the
smallest tiles are used (its cost grows with the number of programs and with tile area).

The launcher's config comes from TABLE, keyed on (requests x heads bucket, padded T). Its entries
are guesses until `python -m fastmamba.bench tune --ops replay` (issue 5, item 3) is run on the
GPU: the sweep prints a paste-ready TABLE at the end; the header comment of TABLE then records the
GPU, Triton version, date and command. Only the main kernel's P tile has been measured (one H100
sweep, quoted in pick_config).
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
# What the tuning sweep (`python -m fastmamba.bench tune --ops replay`) tries: the main kernel's P
# tile (with num_warps = block_p // 16, as above), heads per precompute program (2 is the guess at
# t_pad 32) and the precompute kernel's warps: 3 x 4 x 2 = 24 configs.
CANDIDATES = [
    dict(block_p=bp, num_warps=bp // 16, heads=hd, warps_pre=wp)
    for bp in (16, 32, 64)
    for hd in (2, 4, 8, 16)
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


def padded_tokens(T: int) -> int:
    """The token count the kernels pad T to for tl.dot (>= 16, a power of two): the table's second key."""
    return max(16, triton.next_power_of_2(T))


def table_key(*, programs_per_block: int, t_pad: int) -> tuple[int, int]:
    """TABLE's key: (requests x heads rounded up to a power of two, the padded token count)."""
    return triton.next_power_of_2(max(1, programs_per_block)), t_pad


# (requests x heads bucket, padded T) -> config, for 16-bit activations (fp32 activations keep
# block_p 64, see pick_config). NOT MEASURED YET: every entry is the pre-table guess (one program
# per (request, head) with block_p 16; heads per precompute program 8 at t_pad 16 and 2 at 32, so
# its [heads, t_pad, t_pad] fp32 tiles stay small). The buckets are the ones `bench spec`'s default
# shapes produce (Nemotron-H H128 and its TP=8 slice H16, batch 1-256). Replace the whole dict with
# the paste-ready table that `python -m fastmamba.bench tune --ops replay` prints at the end, and
# record here the GPU, Triton version, date and command of that run.
TABLE: dict[tuple[int, int], ReplayConfig] = {
    (16, 16): ReplayConfig(block_p=16, num_warps=1, heads=8, warps_pre=4),
    (128, 16): ReplayConfig(block_p=16, num_warps=1, heads=8, warps_pre=4),
    (512, 16): ReplayConfig(block_p=16, num_warps=1, heads=8, warps_pre=4),
    (1024, 16): ReplayConfig(block_p=16, num_warps=1, heads=8, warps_pre=4),
    (2048, 16): ReplayConfig(block_p=16, num_warps=1, heads=8, warps_pre=4),
    (4096, 16): ReplayConfig(block_p=16, num_warps=1, heads=8, warps_pre=4),
    (16384, 16): ReplayConfig(block_p=16, num_warps=1, heads=8, warps_pre=4),
    (32768, 16): ReplayConfig(block_p=16, num_warps=1, heads=8, warps_pre=4),
    (16, 32): ReplayConfig(block_p=16, num_warps=1, heads=2, warps_pre=4),
    (128, 32): ReplayConfig(block_p=16, num_warps=1, heads=2, warps_pre=4),
    (512, 32): ReplayConfig(block_p=16, num_warps=1, heads=2, warps_pre=4),
    (1024, 32): ReplayConfig(block_p=16, num_warps=1, heads=2, warps_pre=4),
    (2048, 32): ReplayConfig(block_p=16, num_warps=1, heads=2, warps_pre=4),
    (4096, 32): ReplayConfig(block_p=16, num_warps=1, heads=2, warps_pre=4),
    (16384, 32): ReplayConfig(block_p=16, num_warps=1, heads=2, warps_pre=4),
    (32768, 32): ReplayConfig(block_p=16, num_warps=1, heads=2, warps_pre=4),
}


def _guess(t_pad: int) -> ReplayConfig:
    """For a padded T beyond the table's: the precompute program's [heads, t_pad, t_pad] fp32
    tiles shrink with t_pad (heads = 8 * 16^2 / t_pad^2, at least 1)."""
    return ReplayConfig(block_p=16, num_warps=1, heads=max(1, min(8, 8 * 16 * 16 // (t_pad * t_pad))), warps_pre=4)


def lookup(bucket: int, t_pad: int, table: dict[tuple[int, int], ReplayConfig] | None = None) -> ReplayConfig:
    """TABLE's entry for (bucket, t_pad), else the nearest one: the nearest padded T (a larger
    t_pad than any in the table: ``_guess``), then the nearest bucket (log scale, the larger on a tie)."""
    table = TABLE if table is None else table
    if (bucket, t_pad) in table:
        return table[(bucket, t_pad)]
    t_pads = {t for _, t in table}
    if not t_pads or t_pad > max(t_pads):
        return _guess(t_pad)
    t_near = min(t_pads, key=lambda t: (abs(t.bit_length() - t_pad.bit_length()), -t))
    buckets = [b for b, t in table if t == t_near]
    b_near = min(buckets, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), -b))
    return table[(b_near, t_near)]


def pick_config(
    *, programs_per_block: int, headdim: int, dstate: int, t_pad: int, interpreter: bool, act_bytes: int = 2
) -> ReplayConfig:
    """Config for ``programs_per_block`` = requests x heads, head dim P, state size N and the
    token count padded for tl.dot (``t_pad`` >= 16).

    In order: a forced config (the sweep); under the interpreter the smallest tiles; else TABLE's
    entry for ``table_key(programs_per_block, t_pad)`` (``lookup``: the nearest entry when the
    key is missing), with block_p clamped to the head dim and, for fp32 activations, raised to 64
    (the only tile whose tf32x3 dots do not spill). ``dstate`` is not a key: every measured shape
    has N = 128.
    """
    if _forced is not None:
        return _forced._replace(block_p=max(16, min(_forced.block_p, triton.next_power_of_2(headdim))))
    if interpreter:
        return ReplayConfig(block_p=16, num_warps=1, heads=min(4, _guess(t_pad).heads), warps_pre=1)
    cfg = lookup(*table_key(programs_per_block=programs_per_block, t_pad=t_pad))
    # H100, T=6, bf16 activations, fp32 state (scripts/dev_replay_timing.py sweep, 2026-11-22):
    # 16 rows per program vs 32 / 64: 9.9 / 11.3 / 11.6 us (2.7b, batch 1), 23.1 / 21.8 / 24.2
    # (batch 8), 316 / 317 / 321 (batch 128), Nemotron-H batch 128 437 / 439 / 452. fp32
    # activations keep 64 (the only tile whose tf32x3 dots do not spill).
    block_p = 64 if act_bytes >= 4 else cfg.block_p
    block_p = max(16, min(block_p, triton.next_power_of_2(headdim)))
    if block_p != cfg.block_p:
        cfg = cfg._replace(block_p=block_p, num_warps=block_p // 16)
    return cfg
