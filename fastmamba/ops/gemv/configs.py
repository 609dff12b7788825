"""Launch configs of ``gemv`` (the decode-time projections).

Measured on an H200 (Triton 3.6.0, 2026-11-22, dev_gemv_sweep (retired, docs/experiments.md): 64 products
on distinct weights in one CUDA graph, so every weight comes from HBM), mamba2-2.7b bf16:
- tensor-core tiles of 32 features, 4 warps, 4 stages (out_proj: BLOCK_K 256, 11.5 µs at 1 and 4
  rows, cuBLAS 11.8 / 11.6; in_proj: BLOCK_K 128, 16.4 / 16.5 µs, cuBLAS 15.3 / 15.7);
- one row, FMAs on [8, BLOCK_K] weight tiles (``ONE_ROW_FMA``; out_proj: BLOCK_K 512, 8 warps, 11.0
  µs; in_proj: BLOCK_K 256, 4 warps, 15.8 µs).
Under the interpreter the same configs run (they only change speed).
"""
from __future__ import annotations

from typing import NamedTuple

MAX_ROWS = 16  # rows of x one call takes (one tensor-core tile); more rows: use a GEMM
# One row could take the FMA tiles (1.5% faster at batch 1 end to end: 2.117 vs 2.150 ms per
# mamba2-2.7b step on the H200), but then row b of a call depends on how many rows it has: a plain
# decode step (B rows) and a verify step (B*T rows) round differently, and in bf16 the legacy
# verify path no longer reproduces plain decoding's logits (the oracle drafter's acceptance fell
# from 100% to 3% at batch 1). With the tensor-core tiles for every row count a row's result does
# not depend on the others: 100%, tokens equal.
ONE_ROW_FMA = False


class GemvConfig(NamedTuple):
    use_dot: bool  # tensor-core tiles (any rows up to MAX_ROWS) or fp32 FMAs (one row)
    block_n: int  # output features per program
    block_k: int  # weight columns per loop step
    num_warps: int
    num_stages: int


def pick_config(rows: int, K: int) -> GemvConfig:
    """The config for ``rows`` rows of x against a weight of K columns."""
    wide = K >= 4096
    if rows == 1 and ONE_ROW_FMA:
        return GemvConfig(False, 8, 512 if wide else 256, 8 if wide else 4, 2)
    return GemvConfig(True, 32, 256 if wide else 128, 4, 4)
