"""Launch configs for the gated RMSNorm kernel.

The op is a pure streaming pass (read x, z; write y), so the config only has to (1) keep each
group's columns in registers, (2) put enough bytes in flight per SM, and (3) launch enough
programs to cover every SM when rows are few.

TABLE is keyed by (GPU family, dtype, group_size, rows bucket) and is empty: no entry has been
measured yet. Fill it from ``python -m fastmamba.bench tune gated_rmsnorm`` (record GPU, Triton
version, date and the benchmark row with each entry). Until then every call uses ``heuristic``.

Heuristic (not yet measured; written for H100/H200, Triton 3.6):
- BLOCK_N = next_power_of_2(group_size): the whole group is one register tile, loaded with
  16-byte vectors when group_size * sizeof(dtype) is a multiple of 16. Groups wider than
  MAX_TILE_N columns take the two-pass path instead (sum of squares over column chunks, then a
  second pass that re-reads x and z, mostly from L2).
- BLOCK_M (rows per program) doubles while the tile stays <= TARGET_TILE elements and the grid
  keeps >= MIN_PROGRAMS_PER_SM programs per SM. Few rows -> one program per (row, group); many
  rows -> several rows per program (weight loaded once per program, fewer, fatter programs).
- num_warps: about two 16-byte vectors per thread per tensor, between 1 and 16 warps.
Under the CPU interpreter the SM count is taken as 1, which gives the fewest programs (the
interpreter's cost grows with program count, not tile size).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass

import torch
from fastmamba.ops._common.forced import Forced
from fastmamba.ops._common.host_math import cdiv, next_power_of_2

MAX_TILE_N = 8192        # widest group kept whole in registers (columns)
CHUNK_N = 4096           # column chunk of the two-pass path
TARGET_TILE = 4096       # elements per tensor per program (BLOCK_M * BLOCK_N) when rows are many
MIN_PROGRAMS_PER_SM = 4
VECTORS_PER_THREAD = 2   # 16-byte vectors per thread per tensor
MAX_WARPS = 16


@dataclass(frozen=True)
class GatedRMSNormConfig:
    block_m: int          # rows per program
    block_n: int          # columns per tile (power of two)
    single_tile: bool     # True: the group fits in one tile; False: two passes over CHUNK_N chunks
    num_warps: int


# (GPU family e.g. "sm90", dtype, group_size, rows bucket = next_power_of_2(M)) -> config.
# Measured on one NVIDIA H200 (Triton 3.6.0, torch 2.11, 2026-11-22), bf16 with z, cold L2, by
# `python -m fastmamba.bench tune --ops norm`; one row per program won everywhere:
#   group 1024 (Nemotron-H 8192, G=8): 1-8 rows 8 warps 2.30 us; 64 rows 4 warps 2.85 us; 256 rows 4 warps 4.84 us
#   group 5120 (mamba2-2.7b):          1-64 rows 16 warps 2.88-3.17 us; 256 rows 8 warps 4.43 us;
#                                      with PDL, 8 warps at 1-8 rows (1.95 us vs 2.40 us with 16);
#                                      1-8 rows use 8 warps (the kernels table shows the no-PDL cost)
def _measured() -> dict[tuple[str, torch.dtype, int, int], GatedRMSNormConfig]:
    table = {}
    for rows, warps in ((1, 8), (2, 8), (4, 8), (8, 8), (16, 4), (32, 4), (64, 4), (128, 4), (256, 4)):
        table[("sm90", torch.bfloat16, 1024, rows)] = GatedRMSNormConfig(1, 1024, True, warps)
    for rows, warps in ((1, 8), (2, 8), (4, 8), (8, 8), (16, 16), (32, 16), (64, 16), (128, 8), (256, 8)):
        table[("sm90", torch.bfloat16, 5120, rows)] = GatedRMSNormConfig(1, 8192, True, warps)
    return table


TABLE: dict[tuple[str, torch.dtype, int, int], GatedRMSNormConfig] = _measured()


@functools.lru_cache(maxsize=None)
def _sm_info(device_index: int) -> tuple[str, int]:
    props = torch.cuda.get_device_properties(device_index)
    return f"sm{props.major}{props.minor}", props.multi_processor_count


@functools.lru_cache(maxsize=4096)
def heuristic(M: int, group_size: int, G: int, dtype: torch.dtype, num_sms: int) -> GatedRMSNormConfig:
    """Fallback config from (rows M, group_size, groups G, dtype, SM count); see the module doc."""
    per_thread = VECTORS_PER_THREAD * (16 // dtype.itemsize)

    block_n = next_power_of_2(group_size)
    if block_n > MAX_TILE_N:
        block_n = CHUNK_N
        warps = max(1, min(MAX_WARPS, block_n // (32 * per_thread)))
        return GatedRMSNormConfig(block_m=1, block_n=block_n, single_tile=False, num_warps=warps)

    block_m = 1
    while (2 * block_m * block_n <= TARGET_TILE
           and cdiv(M, 2 * block_m) * G >= MIN_PROGRAMS_PER_SM * num_sms):
        block_m *= 2
    warps = max(1, min(MAX_WARPS, block_m * block_n // (32 * per_thread)))
    return GatedRMSNormConfig(block_m=block_m, block_n=block_n, single_tile=True, num_warps=warps)


# what `python -m fastmamba.bench tune --ops norm` tries (BLOCK_N stays the heuristic's)
CANDIDATES = [dict(block_m=bm, num_warps=w) for bm in (1, 2, 4, 8) for w in (2, 4, 8, 16)]

_forced: Forced[dict] = Forced()


def forced_config(block_m: int, num_warps: int) -> contextlib.AbstractContextManager[None]:
    """Override rows per program and warps inside the block (the tuning sweep's hook)."""
    return _forced.use(dict(block_m=block_m, num_warps=num_warps))


def pick_config(M: int, group_size: int, G: int, dtype: torch.dtype, device: torch.device) -> GatedRMSNormConfig:
    """The config for one call: a measured TABLE entry when there is one, else ``heuristic``."""
    if device.type != "cuda":
        return heuristic(M, group_size, G, dtype, num_sms=1)
    index = device.index if device.index is not None else torch.cuda.current_device()
    family, num_sms = _sm_info(index)
    entry = TABLE.get((family, dtype, group_size, 1 << (M - 1).bit_length() if M > 1 else 1))  # next pow2
    cfg = entry if entry is not None else heuristic(M, group_size, G, dtype, num_sms)
    if _forced.value is not None and cfg.single_tile:
        cfg = dataclasses.replace(cfg, **_forced.value)
    return cfg
