"""Launch configs for the chunked SSD scan's three kernels.

Defaults until a sweep on the GPU replaces them (`python -m fastmamba.bench tune --ops ssd`):
tiles of 64 rows and the full head dim (P=64) and state (N=128). Under the interpreter the
smallest tiles that tl.dot accepts (16) are used, since its cost grows with the tile area.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

from fastmamba.ops._common.forced import Forced
from fastmamba.ops._common.host_math import next_power_of_2


class SsdScanConfig(NamedTuple):
    block_k_state: int  # tokens per step of the chunk-state matmul
    block_n_state: int  # state columns per chunk-state program
    warps_state: int
    block_m: int  # output rows per chunk-scan program
    block_k: int  # tokens per step of the chunk-scan inner loop
    block_p: int  # head-dim columns per chunk-scan program (0: all of P)
    warps_scan: int
    stages_scan: int
    block_pass: int  # flattened P*N elements per state-passing program with fp32 chunk states (16-bit: twice)
    head_major: int = 0  # chunk-scan grid (tiles, chunks, heads) instead of (chunks, heads, tiles)
    heads: int = 1  # heads per chunk-scan program (one after the other; 1 if it does not divide H)
    maxnreg_scan: int = 0  # register cap of the chunk-scan kernel (ptxas maxnreg; 0: none)


# what `python -m fastmamba.bench tune --ops ssd` tries
CANDIDATES = [
    dict(block_k_state=ks, block_n_state=128, warps_state=4, block_m=bm, block_k=bk, block_p=0, warps_scan=w,
         stages_scan=st, block_pass=512, head_major=hm, maxnreg_scan=128)
    for ks in (32, 64)
    for bm, w in ((64, 4), (128, 8))
    for bk in (32, 64)
    for st in (1, 2)
    for hm in (0, 1)
]

_forced: Forced[SsdScanConfig] = Forced()


def forced_config(**fields: int) -> contextlib.AbstractContextManager[None]:
    """Use this config for every launch inside the block (the tuning sweep's hook)."""
    return _forced.use(SsdScanConfig(**fields))


def pick_config(H: int, P: int, N: int, dtype_bytes: int, *, interpreter: bool) -> SsdScanConfig:
    """Choose the tiles for head dim P, state size N and activation width ``dtype_bytes``."""
    if _forced.value is not None:
        return _forced.value
    if interpreter:
        # state passing is elementwise: the interpreter's cost is per program, not per element
        return SsdScanConfig(16, 16, 1, 16, 16, 16, 1, 1, 256, 0)
    # H200, mamba2-2.7b shape, bf16, B=1, L=2048 and 8192 (dev_ssd_profile (retired, docs/experiments.md), 2026-11-22):
    # chunk scan 64 rows x 64 tokens per step on 4 warps, capped at 128 registers so that four
    # programs share an SM (L=8192: 193 us; 32 tokens per step 215 us; uncapped 64 tokens 295 us,
    # capped at 168 224 us; 8 warps, 128-row tiles or pipelining (stages 2) 244-283 us); chunk states
    # 32 tokens x all of N on 4 warps, 3 stages (2026-11-27, .ab-style sweep, L=2048 / 8192: bf16
    # states 15.0 / 52.7 us, 64 tokens 15.6 / 57.4; fp32 states 18.7 / 63.1 vs 17.9 / 66.7; 8 warps or
    # 2 stages slower; 2 or 4 heads of a group stacked in one matmul, B read once: slower or out of
    # shared memory); 2 or 4 heads per chunk-scan program 2.2-2.3x slower (spills under the cap).
    # State passing: 512 fp32 state elements per program (32.5 us at L=8192 against 39.5 / 45.3 us for
    # 1024 / 256), 1024 bf16 ones (2026-11-27, captured launch: 32 x 512 varlen 73.4 -> 63.7 us, 8
    # varlen sequences T=2048 17.0 -> 13.4, 1 x 2048 6.5 -> 5.6, 1 x 8192 29.3 -> 30.0; 2048 / 4096 /
    # 8192 elements or 8 warps no better at either width)
    return SsdScanConfig(
        block_k_state=32, block_n_state=128, warps_state=4, block_m=64, block_k=64, block_p=0, warps_scan=4,
        stages_scan=1, block_pass=512, head_major=1, heads=1, maxnreg_scan=128,
    )


def check_config(config: SsdScanConfig) -> None:
    """ValueError unless the chunk scan's token step divides its row block: its off-diagonal loop
    stops at the block's first row, so a wider step would reach into the diagonal block."""
    if config.block_k <= 0 or config.block_m % config.block_k:
        raise ValueError(f"SsdScanConfig: block_k={config.block_k} must divide block_m={config.block_m}")


def block_p_of(config: SsdScanConfig, P: int) -> int:
    """The chunk-scan program's P tile: the config's, or all of P (rounded up to a power of 2, >= 16)."""
    full = max(16, next_power_of_2(P))
    return full if config.block_p == 0 else min(config.block_p, full)
