"""Launch configs of ``paged_decode_attention``: tile (tokens per loop trip), warps, stages, splits.

Chosen by the launcher, never by @triton.autotune (STYLE.md section 4); under the interpreter the
smallest tile runs, unpipelined, with one split unless the caller asks for more.

The kernel is a stream over K and V: batch 32 at an 8k context reads 1 GiB for 32 x 8 (request,
KV head) programs, so what matters is bytes in flight, not arithmetic. The defaults below are a
first-principles guess, to be replaced by measured rows (``python -m fastmamba.bench tune-attention``
prints the table and the best config per shape):
- a tile of 64 tokens (4 pages of 16): a 16 KiB K tile and a 16 KiB V tile at head dim 128 in
  bf16, each token's row 256 contiguous bytes; 3 stages: two K and two V buffers, so the next
  tile's 32 KiB are in flight while one is computed (sm_90 compile: 70 KiB of shared memory and
  160 registers a program, three programs per SM);
- 4 warps: the tile's two tensor-core products are [16, 128] x [128, 64] and [16, 64] x [64, 128]
  (the G = 4 query heads of a KV head padded to 16 rows), small work for 4 warps;
- splits: enough (request, KV head, split) programs for SPLIT_TARGET_WAVES programs per SM, since
  one program alone is latency-bound (each trip waits on loads issued a trip or two earlier), but
  no run shorter than MIN_SPLIT_TOKENS of the block table's width: a run's partials (G rows of
  Dh + 2 fp32, written and read back once) are then under 2% of the 128 KiB of K and V it reads
  (head dim 128, bf16), and the merge is one small extra kernel.
The split count only changes how a request's tokens are grouped into partial sums, so it changes
results by rounding only; the block table's width (not the requests' lengths, which stay on the
device) is the context bound it sees.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

MAX_SPLITS = 64


class DecodeConfig(NamedTuple):
    block_n: int  # tokens per loop trip (a power of two >= 16)
    num_warps: int
    num_stages: int
    num_splits: int  # runs per request's context (split-K), a power of two in [1, MAX_SPLITS]


# (head dim, itemsize) -> (block_n, num_warps, num_stages): the tile for dims not listed is the
# fallback's. (128, 2) is checked on an H100 (`python -m fastmamba.bench tune-attention --budget-s 100`,
# 2026-11-25, Nemotron-H shape): 0.99 of the best tile's speed on average over 14 (batch, context)
# shapes, 98-102% of a same-size copy at batch >= 32 x 8k. The other rows are first-principles
# defaults (see the module docstring); replace them with measured rows.
TILES: dict[tuple[int, int], tuple[int, int, int]] = {
    (128, 2): (64, 4, 3),
    (64, 2): (64, 4, 3),
    (128, 4): (32, 4, 2),
    # float8 pages (first-principles, not measured): the bf16 row's 64 tokens per trip (the same
    # registers once each tile is converted to bf16) and one more stage, 48 KiB in flight per program
    # (the fallback's 128-token tile would hold 64 KiB of converted K and V in registers)
    (128, 1): (64, 4, 4),
}
SPLIT_TARGET_WAVES = 4  # aim for this many programs per SM ...
MIN_SPLIT_TOKENS = 256  # ... with runs of at least this many tokens of the table's width
INTERPRET_CONFIG = DecodeConfig(block_n=16, num_warps=1, num_stages=1, num_splits=1)
SMEM_BYTES = 227 * 1024  # shared memory one program may use on an H100 / H200

# what `bench tune-attention` sweeps: (block_n, num_warps, num_stages) ... num_stages - 1
# tiles are loaded ahead of the one computed (2 stages: none overlaps the compute, the program
# waits for each tile; other programs on the SM hide it or not).
CANDIDATE_TILES = ([(64, w, st) for w in (2, 4, 8) for st in (3, 4, 5)] + [(64, 4, 2)]
                   + [(32, 2, 4), (32, 4, 3), (32, 4, 5), (32, 8, 5)]
                   + [(128, 4, 3), (128, 8, 3), (128, 8, 4)])
# ... and split counts
CANDIDATE_SPLITS = (1, 2, 4, 8, 16, 32, 64)


def tile_smem_bytes(block_n: int, num_stages: int, head_dim: int, itemsize: int) -> int:
    """Shared memory of the pipelined K and V tiles if each stage had its own buffer (an upper
    bound: with the page-id indirection Triton keeps fewer)."""
    block_d = 1 << (max(16, head_dim) - 1).bit_length()
    return 2 * block_n * block_d * itemsize * max(1, num_stages)


def fallback_tile(head_dim: int, itemsize: int) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages) for a (head dim, dtype size) not in TILES: tiles of about
    16 KiB of K per trip, two stages past 128 head dims."""
    block_n = max(16, min(128, (16384 // itemsize) // max(head_dim, 16)))
    block_n = 1 << (block_n.bit_length() - 1)
    return block_n, 4 if head_dim <= 128 else 8, 3 if head_dim * itemsize <= 256 else 2


def pick_splits(programs: int, max_tokens: int, sms: int) -> int:
    """Split-K runs for ``programs`` (request, KV head) pairs over contexts of up to ``max_tokens``."""
    splits = 1
    while (splits < MAX_SPLITS and programs * splits < SPLIT_TARGET_WAVES * sms
           and max_tokens >= MIN_SPLIT_TOKENS * splits * 2):
        splits *= 2
    return splits


def pick_tile(head_dim: int, itemsize: int) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages) for a (head dim, dtype size): the table's row or the fallback."""
    return TILES.get((head_dim, itemsize)) or fallback_tile(head_dim, itemsize)


def pick_config(programs: int, max_tokens: int, head_dim: int, itemsize: int, sms: int) -> DecodeConfig:
    """The launch config for ``programs`` = rows x KV heads over a block table of ``max_tokens``
    tokens (= width x page size), on a GPU of ``sms`` SMs."""
    return DecodeConfig(*pick_tile(head_dim, itemsize), pick_splits(programs, max_tokens, sms))


class PrefillTile(NamedTuple):
    rows: int  # query rows per program: tokens x the KV head's query heads (G padded), a power of two
    block_n: int  # keys per loop trip (a power of two >= 16)
    num_warps: int
    num_stages: int


# prefill attention (``prefill_kernel.py``): (head dim, itemsize) -> tile. (128, 2) from two sweeps at
# Nemotron-H's shape (1 x 16 ... 1 x 8192, 8 x 1024, 4 x 512 after 1536 cached tokens; .ab-style,
# CUDA graphs): on an H200 with one masked loop, 64 rows / 4 warps and 128 rows / 8 warps within 2%
# of each other (128 rows with 4 warps 2.7x slower); on an H100 with the unmasked trips split off,
# 128 rows / 8 warps 4-9% ahead from 2048 tokens on, equal below. (64, 2) is a first-principles guess.
PREFILL_TILES: dict[tuple[int, int], PrefillTile] = {
    (128, 2): PrefillTile(128, 64, 8, 3),
    (64, 2): PrefillTile(64, 64, 4, 3),
}
PREFILL_INTERPRET_TILE = PrefillTile(16, 16, 1, 1)


def pick_prefill_tile(head_dim: int, itemsize: int, g_pad: int, on_gpu: bool) -> PrefillTile:
    """The prefill attention tile for a head dim, dtype size and padded group (``group_pad``): the
    table's row, else 64 rows with about 16 KiB of K a trip; the smallest tile in the interpreter.
    Rows are at least ``g_pad`` (one token's query heads)."""
    if not on_gpu:
        tile = PREFILL_INTERPRET_TILE
    else:
        tile = PREFILL_TILES.get((head_dim, itemsize))
        if tile is None:
            block_n, warps, stages = fallback_tile(head_dim, itemsize)
            tile = PrefillTile(64, block_n, warps, stages)
    return tile._replace(rows=max(tile.rows, g_pad))


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
