"""Tiles of the fused small-L scan (``fused_kernel.py``) and when the varlen op takes it.

The fused kernel runs one program per (sequence, head, block of P) and walks the sequence's tokens
in blocks of BLOCK_T with the state in registers, so its cost grows with the longest sequence while
the five-kernel path spreads a long sequence's chunks over the GPU. ``MAX_FUSED_LEN`` is where the
automatic choice switches: every sequence of a call at most that many tokens -> fused.

The table below comes from the GPU sweep (``python -m fastmamba.bench.ops.scan_small_l --sweep``,
mamba2-2.7b layer shape, bf16, fp32 state); its comment gives the run.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

from fastmamba.ops._common.host_math import next_power_of_2

# every sequence of a call at most this many tokens -> the fused kernel. Measured on an H100
# (bench.ops.scan_small_l, 2.7b layer, bf16, fp32 state, CUDA graphs; fused vs five kernels):
# 1x16 8.2 vs 31.7 us, 1x64 19.0 vs 32.9, 1x128 32.9 vs 36.6, 4x128 61.2 vs 76.5, 16x64 112.7 vs
# 162.8, but 1x512 113.0 vs 69.0: one program per (sequence, head) walks the tokens serially.
MAX_FUSED_LEN = 128


class FusedScanConfig(NamedTuple):
    block_t: int  # tokens per step of the scan (the state advances once per step); power of 2, >= 16
    block_p: int  # head-dim columns per program (0: all of P); smaller -> more programs
    num_warps: int
    num_stages: int = 1


# (longest sequence at most, programs (sequences x heads) at most) -> config; first match wins.
# From the sweep on an H100 (2026-11-25, `python -m fastmamba.bench.ops.scan_small_l --sweep --shapes
# 1x16,1x64,2x64,1x128,16x64`, 2.7b layer: 80 heads of P 64, N 128, bf16, fp32 state, CUDA graphs):
# 1x64 13.5 us (was 19.0 with t32 p16 w4), 1x128 20.4 (was 32.9), 2x64 19.6 (was 28.7), 16x64 103.0
# (was 113.2); 1x16 kept its 8.2 us. "programs" counts live sequences only (``live_seqs``): a graphed
# prefill's padding request just writes zeros, so a prefix-cache hit's 64 new tokens take the 1x64 tiles.
TABLE: list[tuple[int, int, FusedScanConfig]] = [
    (16, 256, FusedScanConfig(block_t=16, block_p=16, num_warps=2)),
    (16, 1 << 30, FusedScanConfig(block_t=16, block_p=32, num_warps=2)),
    (1 << 30, 128, FusedScanConfig(block_t=32, block_p=32, num_warps=4, num_stages=2)),
    (1 << 30, 256, FusedScanConfig(block_t=32, block_p=32, num_warps=2)),
    (1 << 30, 1 << 30, FusedScanConfig(block_t=16, block_p=64, num_warps=4, num_stages=2)),
]
# Triton 3.6 on an H100: BLOCK_T = 64 with 16-bit inputs and 4 warps compiles into a kernel that
# faults (illegal memory access; 2.7b layer shape, 1 x 40 tokens), and with 2 more rows it returned
# garbage instead; 8 warps or BLOCK_T <= 32 run correctly. So BLOCK_T = 64 always gets 8 warps.
MIN_WARPS_AT_BLOCK_T_64 = 8

_forced: FusedScanConfig | None = None


@contextlib.contextmanager
def forced_fused_config(**fields: int) -> Iterator[None]:
    """Use this config for every fused launch inside the block (the experiment's sweep hook)."""
    global _forced
    previous = _forced
    _forced = FusedScanConfig(**fields)
    try:
        yield
    finally:
        _forced = previous


def pick_fused_config(max_len: int, nseq: int, H: int, P: int, *, interpreter: bool) -> FusedScanConfig:
    """Tiles for sequences of at most ``max_len`` tokens (a host bound), ``nseq`` sequences of H heads."""
    if _forced is not None:
        cfg = _forced
    elif interpreter:
        # the interpreter's cost is per program and loop trip: the smallest tiles tl.dot accepts
        cfg = FusedScanConfig(block_t=16, block_p=16, num_warps=1)
    else:
        programs = nseq * H
        cfg = next(c for lmax, pmax, c in TABLE if max_len <= lmax and programs <= pmax)
    full_p = max(16, next_power_of_2(P))
    block_p = full_p if cfg.block_p == 0 else min(max(16, cfg.block_p), full_p)
    block_t = max(16, next_power_of_2(cfg.block_t))
    warps = max(cfg.num_warps, MIN_WARPS_AT_BLOCK_T_64) if block_t >= 64 and not interpreter else cfg.num_warps
    return cfg._replace(block_p=block_p, block_t=block_t, num_warps=warps)
