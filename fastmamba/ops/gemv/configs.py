"""Launch configs of ``gemv`` (the decode-time projections): a tuning table keyed by (GPU family,
dtype, N, K) and a fallback for every other shape.

The fallback was measured on an H200 (Triton 3.6.0, 2026-11-22, dev_gemv_sweep (retired,
docs/experiments.md): 64 products on distinct weights in one CUDA graph, so every weight comes from
HBM), mamba2-2.7b bf16:
- tensor-core tiles of 32 features, 4 warps, 4 stages (out_proj: BLOCK_K 256, 11.5 µs at 1 and 4
  rows, cuBLAS 11.8 / 11.6; in_proj: BLOCK_K 128, 16.4 / 16.5 µs, cuBLAS 15.3 / 15.7);
- one row, FMAs on [8, BLOCK_K] weight tiles (``ONE_ROW_FMA``; out_proj: BLOCK_K 512, 8 warps, 11.0
  µs; in_proj: BLOCK_K 256, 4 warps, 15.8 µs).
Other shapes (Nemotron-3 Nano's out_proj has 2688 features: 84 programs of 32 on 132 SMs) are swept
by ``python -m fastmamba.bench tune --ops gemv`` and land in TABLE. A config never depends on the
number of rows: a row's result must not depend on the others (see ``ONE_ROW_FMA``), so a plain
decode step and a verify step give the same logits. Under the interpreter the same configs run
(they only change speed).
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from fastmamba.ops._common.dispatch import gpu_family
from fastmamba.ops._common.forced import Forced

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


# (family, dtype, N, K) -> GemvConfig; family as fastmamba.ops._common.dispatch.gpu_family ("h100", "h200")
TABLE: dict[tuple[str, str, int, int], GemvConfig | dict] = {}

# what ``tune --ops gemv`` tries: tensor-core tiles only (see the module docstring), 54 configs
CANDIDATES: list[dict] = [
    dict(use_dot=True, block_n=bn, block_k=bk, num_warps=w, num_stages=s)
    for bn in (16, 32, 64) for bk in (128, 256, 512) for w in (4, 8) for s in (3, 4, 6)
    if bn * bk * 2 * s <= 192 * 1024  # the pipelined weight tiles in shared memory
]

_forced: Forced[GemvConfig] = Forced()


def forced_config(**fields) -> contextlib.AbstractContextManager[None]:
    """Within the block every ``gemv`` call launches this config (``tune``'s hook)."""
    return _forced.use(GemvConfig(**fields))


def heuristic(rows: int, K: int) -> GemvConfig:
    """The fallback for shapes not in TABLE (measured on mamba2-2.7b's projections, above)."""
    wide = K >= 4096
    if rows == 1 and ONE_ROW_FMA:
        return GemvConfig(False, 8, 512 if wide else 256, 8 if wide else 4, 2)
    return GemvConfig(True, 32, 256 if wide else 128, 4, 4)


def table_key(device: torch.device, dtype: torch.dtype, N: int, K: int) -> tuple[str, str, int, int]:
    return (gpu_family(device), str(dtype).replace("torch.", ""), N, K)


def pick_config(rows: int, K: int, N: int | None = None, *, device: torch.device | None = None,
                dtype: torch.dtype | None = None) -> GemvConfig:
    """The config for ``rows`` rows of x against an (N, K) weight: forced (tune), the table's for
    this GPU family, dtype and shape, or the fallback's."""
    if _forced.value is not None:
        return _forced.value
    if TABLE and N is not None and device is not None and dtype is not None:
        cfg = TABLE.get(table_key(device, dtype, N, K))
        if cfg is not None:
            return cfg if isinstance(cfg, GemvConfig) else GemvConfig(**cfg)
    return heuristic(rows, K)
