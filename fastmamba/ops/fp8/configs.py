"""Launch configs of the FP8 kernels: the decode GEMVs (``fp8_gemv`` and the MoE pair GEMV of
``fp8_moe``: a tuning table keyed by (GPU family, kind, path, N, K) over a measured default) and the
grouped W8A8 MoE (``fp8_moe_grouped``: a heuristic keyed by the mean rows per expert, no table yet).

Decode GEMVs. ``GemvConfig`` (use_dot, block_n, block_k, num_warps, num_stages, swap_ab): fp32 FMAs over the
converted weights (at most ``FMA_MAX_ROWS`` rows: decode at batch 1-2; the MoE pair GEMV's one row)
or the e4m3 tensor-core dot, which reads the weights as they are (rows padded to 16; 3-16 rows
always; 1-2 rows and the pair GEMV where the table says so: then every row count of a linear runs
the same sums, as the bf16 ``gemv`` does). ``swap_ab`` puts the weight tile on the dot's left (64 or 128
rows: Hopper's warpgroup MMA on the e4m3 tiles, fed by Triton's cp.async pipeline; the rows-left dot of
16 rows takes mma.sync over f16 copies); unmeasured on a GPU so far (docs/experiments/moe.md). The default FMA tile, 16 features x 1024 columns, 4 warps, was the best
of a sweep on an H100 (Triton 3.6.0, 2026-12-07, CUDA-graph timing, one row, Nano's four decode
shapes; the first cut's 32 x 128 took 3-4x longer):

    shape (N x K)            32 x 128 (first cut)   16 x 1024   weight bytes / 3.0 TB/s
    in_proj  10304 x 2688          51.3 µs            15.5 µs          9.2 µs
    out_proj  2688 x 4096          47.7 µs            10.3 µs          3.7 µs
    shared up 3712 x 2688          31.7 µs             9.3 µs          3.3 µs
    shared dn 2688 x 3712          43.2 µs            11.3 µs          3.3 µs

The sweep's grid ended at 16 features and 1024 columns, so smaller / longer tiles may be better:
``python -m fastmamba.bench tune --ops fp8`` sweeps ``CANDIDATES`` (FMA and dot tiles at 1 row, dot
tiles at 8) on the ``fp8`` bench's linear and MoE cases and prints TABLE entries.

Grouped MoE. Untuned first cut (Triton 3.6.0): the row block follows the mean number of (token, expert) pairs an
expert gets (T * k / E), so a block is mostly real rows at decode-to-prefill sizes; K steps of 128
e4m3 values are 128-byte rows. The lead measures it with ``python -m fastmamba.bench fp8 --kinds moe``
(providers fastmamba-fp8-grouped, bf16 fused_moe, torch._scaled_mm per expert); a table keyed like
ops/moe's (GPU family, M, F, E, k, token bucket) replaces the heuristic when rows justify it.
Under the CPU interpreter ``INTERPRETER`` runs (its cost grows with the number of programs).
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from fastmamba.ops._common.dispatch import gpu_family
from fastmamba.ops._common.forced import Forced

FMA_MAX_ROWS = 2  # the FMA loop holds rows x block_n x block_k products: more rows take the tensor-core dot


class GemvConfig(NamedTuple):
    use_dot: bool   # e4m3 tensor-core dot over rows padded to 16 (the pair GEMV: its one row), or fp32 FMAs (1-2 rows)
    block_n: int    # output features per program (>= 16 with the dot)
    block_k: int    # columns of the reduction per loop step (at most the next power of two of K is used)
    num_warps: int
    num_stages: int
    swap_ab: bool = False  # (with use_dot) the weight tile as the MMA's left operand: BLOCK_N rows, the padded rows as 16 columns


FMA_DEFAULT = GemvConfig(False, 16, 1024, 4, 2)  # measured on fp8_gemv (the table above); the pair GEMV's loop is the same, untimed
DOT_DEFAULT = GemvConfig(True, 64, 128, 4, 3)    # the first cut (Triton's default stages; not yet swept)

# (family, kind, rows, N, K) -> GemvConfig or its dict; kind "linear" (fp8_gemv: N, K of the weight)
# or "moe" (the pair GEMV: N, K = F, M of the experts, one config for the up and the down launch);
# rows "1-2" (at most FMA_MAX_ROWS rows; the pair GEMV) or "3-16"
TABLE: dict[tuple[str, str, str, int, int], GemvConfig | dict] = {}

# what ``tune --ops fp8`` tries (46 tiles); the bench keeps per case those that fit (``FP8Bench.tune_candidates``):
# the FMA tiles at 1-2 rows and in the pair GEMV (``fma_fits``), the dot tiles everywhere. At 1-2 rows and
# in the pair GEMV both compete. Dropped: tiles that spill registers on sm_90 (ptxas, Triton 3.6): the
# dot's 32 / 64 x 512 without the swap, the swap's 128 x 512.
CANDIDATES: list[dict] = [
    *(dict(use_dot=False, block_n=bn, block_k=bk, num_warps=w, num_stages=2)   # stages: no effect on the FMA loop
      for bn in (8, 16, 32) for bk in (512, 1024, 2048) for w in (4, 8)),
    # the bf16 gemv's winners in bytes per step (8 / 16 x 128 bf16, 2 warps: ops/moe's TABLE) as e4m3 tiles
    *(dict(use_dot=False, block_n=bn, block_k=256, num_warps=w, num_stages=2) for bn in (8, 16) for w in (2, 4)),
    *(dict(use_dot=True, block_n=bn, block_k=bk, num_warps=4, num_stages=s)     # 4 warps: the bf16 gemv's best
      for bn, bk in ((16, 128), (16, 256), (16, 512), (32, 128), (32, 256), (64, 128), (64, 256)) for s in (3, 4)),
    *(dict(use_dot=True, block_n=bn, block_k=bk, num_warps=4, num_stages=s, swap_ab=True)  # Hopper's wgmma: M >= 64
      for bn, bk in ((64, 128), (64, 256), (64, 512), (128, 128), (128, 256)) for s in (3, 4)),
]


def fma_fits(rows: int, block_n: int, block_k: int, num_warps: int) -> bool:
    """Whether an FMA tile's partial sums (rows x block_n x block_k fp32, kept across the K loop)
    fit in registers: at most 128 per thread (every CANDIDATES tile within it compiles for sm_90
    without spills; 256 per thread spilled 0.5-1.4 KB)."""
    return rows * block_n * block_k <= 4096 * num_warps


_forced: Forced[GemvConfig] = Forced()


def forced_config(**fields) -> contextlib.AbstractContextManager[None]:
    """Within the block every FP8 decode GEMV (``fp8_gemv``, the pair GEMV) launches this config
    (``tune``'s hook)."""
    return _forced.use(GemvConfig(**fields))


def rows_class(rows: int) -> str:
    return "1-2" if rows <= FMA_MAX_ROWS else "3-16"


def table_key(device: torch.device, kind: str, rows: int, N: int, K: int) -> tuple[str, str, str, int, int]:
    return (gpu_family(device), kind, rows_class(rows), N, K)


def gemv_config(device: torch.device, kind: str, rows: int, N: int, K: int) -> GemvConfig:
    """The config of an FP8 decode GEMV: forced (tune), the table's, or the default for ``rows``
    (x's rows; 1 for the pair GEMV). Whatever the source: 3-16 rows take the dot, and a dot tile has
    at least 16 features."""
    if _forced.value is not None:
        cfg = _forced.value
    else:
        cfg = TABLE.get(table_key(device, kind, rows, N, K)) if TABLE else None
        cfg = (cfg if isinstance(cfg, GemvConfig) else GemvConfig(**cfg)) if cfg is not None else None
        # two FMA rows: half the columns per step, so rows x block_n x block_k stays at 16k products
        cfg = cfg or (FMA_DEFAULT._replace(block_k=FMA_DEFAULT.block_k // max(rows, 1)) if rows <= FMA_MAX_ROWS
                      else DOT_DEFAULT)
    if rows > FMA_MAX_ROWS:
        cfg = cfg._replace(use_dot=True)
    if cfg.use_dot and cfg.block_n < 16:  # a tensor-core tile needs 16 features
        cfg = cfg._replace(block_n=16)
    return cfg


class MoeGroupedConfig(NamedTuple):
    block_m: int        # rows per block (pairs of one expert; a multiple of 16)
    block_n_up: int     # columns of F per program (up_proj)
    block_k_up: int     # steps along M (up_proj's reduction; >= 32 for the e4m3 dot)
    block_n_down: int   # columns of M per program (down_proj)
    block_k_down: int   # steps along F (down_proj's reduction)
    group_m: int        # row blocks per L2 group
    num_warps: int
    num_stages: int


INTERPRETER = MoeGroupedConfig(16, 32, 32, 32, 32, 1, 4, 1)


def fit_block_k(block_k: int, K: int) -> int:
    """The largest of block_k, block_k / 2, ... (down to 32) that divides K, else block_k: a reduction
    without a masked tail. Masking the e4m3 tiles along K makes ptxas spill at 128-row blocks (sm_90,
    Triton 3.6: 600-4800 bytes; tests/ops/fp8/test_fp8_compile_sm90.py); nano's F = 1856 = 29 * 64."""
    bk = block_k
    while bk > 32 and K % bk:
        bk //= 2
    return bk if K % bk == 0 else block_k


def moe_grouped_config(T: int, k: int, E: int, M: int, F: int, *, interpreter: bool) -> MoeGroupedConfig:
    """The config for T tokens, k experts each, E experts of width F over model width M."""
    if interpreter:
        return INTERPRETER
    rows = T * k / max(E, 1)  # mean pairs per expert
    if rows <= 16:
        cfg = MoeGroupedConfig(16, 64, 128, 64, 128, 1, 4, 4)
    elif rows <= 32:
        cfg = MoeGroupedConfig(32, 64, 128, 64, 128, 1, 4, 4)
    elif rows <= 96:
        cfg = MoeGroupedConfig(64, 128, 128, 128, 128, 8, 4, 4)
    else:
        cfg = MoeGroupedConfig(128, 128, 128, 128, 128, 8, 8, 3)
    return cfg._replace(block_k_up=fit_block_k(cfg.block_k_up, M), block_k_down=fit_block_k(cfg.block_k_down, F))
