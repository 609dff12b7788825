"""Launch configs of ``gemv`` (the decode-time projections).

Measured on an H200 (Triton 3.6.0, 2026-11-22, ``python scripts/dev_gemv_sweep.py``: 64 products
on distinct weights in one CUDA graph, so every weight comes from HBM), mamba2-2.7b bf16:
- one row: FMAs on [8, BLOCK_K] weight tiles beat tensor-core tiles (out_proj N=2560, K=5120:
  BLOCK_K 512, 8 warps, 11.0 µs against cuBLAS 11.8; in_proj N=10576, K=2560: BLOCK_K 256, 4 warps,
  15.8 µs against cuBLAS 15.3);
- 2-16 rows: tensor-core tiles of 32 features (out_proj: BLOCK_K 256, 11.5 µs, cuBLAS 11.6; in_proj:
  BLOCK_K 128, 16.5 µs, cuBLAS 15.7), 4 warps, 4 stages.
Under the interpreter the same configs run (they only change speed).
"""
from __future__ import annotations

from typing import NamedTuple

MAX_ROWS = 16  # rows of x one call takes (one tensor-core tile); more rows: use a GEMM


class GemvConfig(NamedTuple):
    use_dot: bool  # tensor-core tiles (any rows up to MAX_ROWS) or fp32 FMAs (one row)
    block_n: int  # output features per program
    block_k: int  # weight columns per loop step
    num_warps: int
    num_stages: int


def pick_config(rows: int, K: int) -> GemvConfig:
    """The config for ``rows`` rows of x against a weight of K columns."""
    wide = K >= 4096
    if rows == 1:
        return GemvConfig(False, 8, 512 if wide else 256, 8 if wide else 4, 2)
    return GemvConfig(True, 32, 256 if wide else 128, 4, 4)
