"""Launch configs for the prefill conv kernels: (BLOCK_L, BLOCK_D, num_warps).

Measured on one NVIDIA H200 (Triton 3.6.0, torch 2.11, 2026-11-22; earlier on an H100) with
`python -m fastmamba.bench tune --ops conv_fn` and dev_conv_fn_configs (retired, docs/experiments.md) (W=4, silu,
bf16, cold L2, D 5376 and 10240, B x L = 1 x 2048 and 8 x 8192, both layouts); the numbers are
quoted where each choice is made.

Two tile shapes, one per kernel (see kernel.py and varlen_kernel.py):
* rows (channel-last x, packed varlen x): a program owns BLOCK_L tokens x BLOCK_D channels and
  walks the tokens; each thread holds BLOCK_D / (32 * num_warps) channels of every row, loaded
  as 16-byte vectors when that count is a multiple of V = 16 / sizeof(x).
* columns (channel-first x, and any other strides): a program owns BLOCK_D channels x BLOCK_L
  tokens, cut into V-token chunks (one 16-byte vector each); BLOCK_L must be a multiple of V.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

from fastmamba.ops._common.forced import Forced


class ConvFnConfig(NamedTuple):
    block_l: int
    block_d: int
    num_warps: int


# what the tuning sweep tries for the rows kernel (channel-last causal_conv1d_fn and
# causal_conv1d_varlen, the Mamba-2 layouts): 4-16 channels per thread and row, i.e. one or two
# 16-byte bf16 vectors (or 8-byte ones at 4), and 8-64 rows per program. A thread holds its whole
# window in registers: channels per thread x (BLOCK_L + 3) window rows is capped at 280, as the
# sm_90 compile (Triton 3.6, bf16, W=4) spills above it (8 x 35 values: 247 registers, 16 x 19:
# 255 + spills; 8 x 19: 166).
CANDIDATES = [
    dict(block_l=bl, block_d=bd, num_warps=w)
    for bl in (8, 16, 32, 64)
    for bd in (128, 256, 512, 1024, 2048)
    for w in (1, 2, 4, 8)
    if bd // (32 * w) in (4, 8, 16) and bd // (32 * w) * (bl + 3) <= 280
]

# what the sweep tries for the column kernel (channel-first x): BLOCK_L covers 128-512 tokens
# (a warp's 32 chunks of 8 bf16 tokens span 256), 8-64 tokens per thread (29-80 registers, no
# spills, no shared memory in the sm_90 compile)
CANDIDATES_CHANNEL_FIRST = [
    dict(block_l=bl, block_d=bd, num_warps=w)
    for bl in (128, 256, 512)
    for bd in (2, 4, 8, 16, 32)
    for w in (1, 2, 4, 8)
    if 8 <= bl * bd // (32 * w) <= 64
]

_forced: Forced[ConvFnConfig] = Forced()


def forced_config(block_l: int, block_d: int, num_warps: int) -> contextlib.AbstractContextManager[None]:
    """Use this config for every launch inside the block (the tuning sweep's hook); it applies to
    whichever kernel the layout picks, so sweep CANDIDATES on channel-last cases and
    CANDIDATES_CHANNEL_FIRST on channel-first ones."""
    return _forced.use(ConvFnConfig(block_l, block_d, num_warps))


def vector_width(element_size: int, W: int) -> int:
    """V: tokens per chunk in the column kernel, and channels per 16-byte vector in the rows
    kernel. At least W-1 (a chunk's halo comes from the one chunk before it), so fp32 with W=6
    uses 8-element (two-vector) chunks."""
    return max(16 // element_size, 1 << (W - 2).bit_length())  # next power of two >= W-1 (W >= 2)


# rows x channels up to which the rows kernel of causal_conv1d_fn takes the small-input tile
SMALL_ROWS_ELEMENTS = 24 * 2**20


def pick_rows_config(D: int, rows: int, element_size: int, *, interpreter: bool, varlen: bool = False) -> ConvFnConfig:
    """(BLOCK_L, BLOCK_D, num_warps) for the rows kernel: D channels, ``rows`` tokens in all
    (B * L, or T for varlen).

    16 rows x 128 channels on one warp (4 channels per thread). H200 with the approximate-PTX silu
    (dev_conv_fn_configs (retired, docs/experiments.md), 2026-11-22, copy 4268 GB/s): 8 x 8192 354 us at D=5376 and
    689 us at D=10240 (93% / 91% of copy), 1 x 2048 14.8 / 25.1 us (70% / 78%), against 380 / 819 us
    and 15.8 / 26.8 us for 8 rows (the H100 tune's choice: 100% of its copy at 8 x 8192); 8 channels
    per thread (one 16-byte vector, 256 channels per warp) 18-33% slower at every size.

    Small dense inputs (rows x D <= SMALL_ROWS_ELEMENTS; 1 x 2048 at both bench dims) take the same
    tile on two warps (2 channels per thread): H200, four runs of the script on 2026-11-22,
    1 x 2048 D=5376 13.8-13.9 us against 14.8-15.1 us (74-75% of copy against 68-70%), D=10240
    24.4-24.5 against 24.6 us; at 8 x 8192 it falls to 87-88% / 77-87% (the one-warp tile: 96-97%).
    The varlen kernel keeps the one-warp tile (it was not measured with the other).
    Under the interpreter: 8 rows by 64 channels (its cost grows with programs x unrolled rows).
    """
    del element_size
    if _forced.value is not None:
        return _forced.value
    if interpreter:
        return ConvFnConfig(block_l=8, block_d=64, num_warps=1)
    if not varlen and rows * D <= SMALL_ROWS_ELEMENTS:
        return ConvFnConfig(block_l=16, block_d=128, num_warps=2)
    return ConvFnConfig(block_l=16, block_d=128, num_warps=1)


def pick_cols_config(D: int, L: int, B: int, V: int, *, interpreter: bool) -> ConvFnConfig:
    """(BLOCK_L, BLOCK_D, num_warps) for the column kernel (channel-first x), V tokens per chunk.

    512 tokens x 2 channels on one warp. H200 with the approximate-PTX silu
    (dev_conv_fn_configs (retired, docs/experiments.md), 2026-11-22, copy 4268 GB/s): 8 x 8192 341 us at D=5376 and
    652 us at D=10240 (97% / 96% of copy) against 356 / 681 us for 512 x 4 on 4 warps, the H100
    tune's choice for large inputs; 1 x 2048 13.6 / 23.7 us (76% / 83%). Under the interpreter: two
    chunks by 64 channels.
    """
    if _forced.value is not None:
        return _forced.value
    if interpreter:
        return ConvFnConfig(block_l=2 * V, block_d=64, num_warps=1)
    del D, L, B
    return ConvFnConfig(max(512, 32 * V), 2, 1)
