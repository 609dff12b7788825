"""Launch configs of the grouped W8A8 MoE (``fp8_moe_grouped``): a heuristic keyed by the mean rows
per expert, no measured table yet.

Untuned first cut (Triton 3.6.0): the row block follows the mean number of (token, expert) pairs an
expert gets (T * k / E), so a block is mostly real rows at decode-to-prefill sizes; K steps of 128
e4m3 values are 128-byte rows. The lead measures it with ``python -m fastmamba.bench fp8 --kinds moe``
(providers fastmamba-fp8-grouped, bf16 fused_moe, torch._scaled_mm per expert); a table keyed like
ops/moe's (GPU family, M, F, E, k, token bucket) replaces the heuristic when rows justify it.
Under the CPU interpreter ``INTERPRETER`` runs (its cost grows with the number of programs).
"""
from __future__ import annotations

from typing import NamedTuple


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
