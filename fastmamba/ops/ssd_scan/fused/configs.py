"""Tiles of the fused small-L scan (``fused/kernel.py``) and when the varlen op takes it.

The fused kernel runs one program per (sequence, head, block of P) and walks the sequence's tokens
in blocks of BLOCK_T with the state in registers, so its cost grows with the longest sequence while
the five-kernel path spreads a long sequence's chunks over the GPU. ``MAX_FUSED_LEN`` is where the
automatic choice switches: every sequence of a call at most that many tokens -> fused.

The table below comes from the GPU sweep (``python -m fastmamba.bench.ops.scan_small_l --sweep``,
mamba2-2.7b layer shape, bf16, fp32 state); its comment gives the run.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

from fastmamba.ops._common.forced import Forced
from fastmamba.ops._common.host_math import next_power_of_2

# every sequence of a call at most this many tokens -> the fused kernel. Measured on an H100
# (bench.ops.scan_small_l, 2.7b layer, bf16, fp32 state, CUDA graphs; fused vs five kernels):
# 1x16 8.2 vs 31.7 us, 1x64 19.0 vs 32.9, 1x128 32.9 vs 36.6, 4x128 61.2 vs 76.5, 16x64 112.7 vs
# 162.8, but 1x512 113.0 vs 69.0: one program per (sequence, head) walks the tokens serially.
MAX_FUSED_LEN = 128
# ... but where the chunked path runs the Hopper kernels (inside hopper_kernels(): graphed prefills of
# >= 1024 tokens, eager ones of >= 8192), only up to this many (three blocks of the walk). H200,
# 2026-11-27, `python -m fastmamba.bench.ops.scan_small_l --quick` with FASTMAMBA_HOPPER_SCAN=1, chunked
# (Hopper) vs fused: 8x128 61.9 vs 69.4 us, 16x128 105.7 vs 119.2, 64x128 375.3 vs 440.1; but 8x96
# 73.7 vs 56.4, 16x96 105.8 vs 98.7, 64x96 380.6 vs 358.8, 16x80 101.1 vs 88.4, 64x64 316.4 vs 278.4
# (below 1024 tokens the Hopper kernels do not run). Whole prefill (`bench ttft`, two rounds): graphed
# 8 x 128 13.72 / 13.35 -> 12.82 / 12.89 ms, 16 x 128 25.03 / 25.25 -> 24.27 / 23.98; eager 64 x 128
# 99.5 / 99.3 -> 93.2 / 95.0; 1 x 128 3.53-3.54 either way.
MAX_FUSED_LEN_HOPPER = 96


class FusedScanConfig(NamedTuple):
    block_t: int  # tokens per step of the scan (the state advances once per step); power of 2, >= 16
    block_p: int  # head-dim columns per program (0: all of P); smaller -> more programs
    num_warps: int
    num_stages: int = 1


# (longest sequence at most, programs (sequences x heads) at most) -> config; first match wins.
# First from a sweep on an H100 (2026-11-25, `python -m fastmamba.bench.ops.scan_small_l --sweep --shapes
# 1x16,1x64,2x64,1x128,16x64`, 2.7b layer: 80 heads of P 64, N 128, bf16, fp32 state, CUDA graphs),
# then re-swept on an H200 once the kernel issued each block's loads an iteration ahead (2026-11-27,
# `--sweep --quick --shapes 2x64,1x128,1x64,16x64,1x16`, blocks of at most 32 tokens): 1x16 6.9 us,
# 1x64 10.8, 1x128 15.8, 16x64 77.7 with the tiles below; 2x64 took 21.9 us with the old fourth row
# (t32 p32 w2) and 16.3 with the last row's tiles, which it now shares (15.5 with t16 p32 w2, whose
# output was not checked on the GPU in that run). "programs" counts live sequences only
# (``live_seqs``): a graphed prefill's padding request just writes zeros, so a prefix-cache hit's 64
# new tokens take the 1x64 tiles.
TABLE: list[tuple[int, int, FusedScanConfig]] = [
    (16, 256, FusedScanConfig(block_t=16, block_p=16, num_warps=2)),
    (16, 1 << 30, FusedScanConfig(block_t=16, block_p=32, num_warps=2)),
    (1 << 30, 128, FusedScanConfig(block_t=32, block_p=32, num_warps=4, num_stages=2)),
    (1 << 30, 1 << 30, FusedScanConfig(block_t=16, block_p=64, num_warps=4, num_stages=2)),
]
# Blocks of at most 32 tokens. Triton 3.6 on an H100: BLOCK_T = 64 with 16-bit inputs and 4 warps
# compiled into a kernel that faulted (illegal memory access; 2.7b layer shape, 1 x 40 tokens), and
# with 2 more rows returned garbage; 8 warps ran correctly then. Once the kernel issued each block's
# loads an iteration ahead, a sweep over every tile on an H200 (2026-11-27) hit an illegal memory
# access again in its first shape (2 x 64; the loads are masked to the sequence, so a miscompile is
# the likely cause), and the same sweep at blocks of at most 32 tokens ran every tile without error.
# The table never used 64.
MAX_BLOCK_T = 32

_forced: Forced[FusedScanConfig] = Forced()


def forced_fused_config(**fields: int) -> contextlib.AbstractContextManager[None]:
    """Use this config for every fused launch inside the block (the experiment's sweep hook)."""
    return _forced.use(FusedScanConfig(**fields))


def pick_fused_config(max_len: int, nseq: int, H: int, P: int, *, interpreter: bool) -> FusedScanConfig:
    """Tiles for sequences of at most ``max_len`` tokens (a host bound), ``nseq`` sequences of H heads."""
    if _forced.value is not None:
        cfg = _forced.value
    elif interpreter:
        # the interpreter's cost is per program and loop trip: the smallest tiles tl.dot accepts
        cfg = FusedScanConfig(block_t=16, block_p=16, num_warps=1)
    else:
        programs = nseq * H
        cfg = next(c for lmax, pmax, c in TABLE if max_len <= lmax and programs <= pmax)
    full_p = max(16, next_power_of_2(P))
    block_p = full_p if cfg.block_p == 0 else min(max(16, cfg.block_p), full_p)
    block_t = min(MAX_BLOCK_T, max(16, next_power_of_2(cfg.block_t)))
    return cfg._replace(block_p=block_p, block_t=block_t)
