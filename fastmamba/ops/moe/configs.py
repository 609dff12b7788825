"""Launch configs of ``fused_moe``: a tuning table keyed by (GPU family, dtype, M, F, E, k, S, token
bucket) and a fallback heuristic for every other key. S is the number of shared-expert slices the
call runs beside the k routed experts (``fused_moe_gemv``'s ``shared_up``: Nano's decode step runs
6 routed + 2 shared slices, so its GEMV grids are 8/6 of the routed-only op's; 0 elsewhere).

TABLE holds measured rows only (so far Nano's decode call at one token on an H100); the lead adds
the Nano (M=2688, F=1856, E=128, k=6) and Super-latent (M=1024, F=2688, E=512, k=22) rows on an
H100 / H200 with ``python -m fastmamba.bench tune --ops moe`` (Triton 3.6.0); each row's comment
names the GPU, the date and the bench row that justified it. Under the CPU interpreter ``INTERPRETER`` runs
(its cost grows with the number of programs, not the tile width).

Two paths (``MoeConfig.path``):
- "gemv": few tokens. No alignment; one program per (pair, block of F) for up_proj + relu², one per
  (pair, block of M) for down_proj, then the k-sum (its own kernel, or the down kernel's last
  program per block given arrival counters). Reads only the chosen experts' weights.
- "grouped": token-expert pairs sorted by expert into blocks of ``block_m`` rows; tensor-core
  GEMMs per (row block, column block); the k contributions summed in a last kernel.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from fastmamba.ops._common.dispatch import gpu_family
from fastmamba.ops._common.forced import Forced


class MoeConfig(NamedTuple):
    path: str  # "gemv" or "grouped"
    block_m: int  # grouped: rows per block (a multiple of 16; the pairs of one expert)
    block_n_up: int  # columns of F per program (up_proj)
    block_k_up: int  # steps along M (up_proj's reduction)
    block_n_down: int  # columns of M per program (down_proj)
    block_k_down: int  # steps along F (down_proj's reduction)
    group_m: int  # grouped: row blocks per L2 group
    num_warps: int
    num_stages: int
    gemv_dot: bool = False  # gemv: the tensor-core tiles (a pipelined weight stream; block_n >= 16), not FMAs


# the largest token count that takes the GEMV path (a bucket boundary: tokens 1, 2, 4)
GEMV_MAX_TOKENS = 4
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

# (family, dtype, M, F, E, k, S, token bucket) -> MoeConfig; family: "h100", "h200", ... (gpu_family)
TABLE: dict[tuple[str, str, int, int, int, int, int, int], MoeConfig | dict] = {
    # H100 80GB HBM3, Triton 3.6.0, 2026-12-07: `python -m fastmamba.bench tune --ops moe --batch 1 --cases
    # nano+shared --pdl` (Nano's decode call, 6 routed + 2 shared slices): default 66.05 us, this 63.95 us (82% of
    # the copy rate); `bench e2e --model nemotron-3-nano --batch 1` in the same call: 2.803 -> 2.766 ms/step
    ("h100", "bfloat16", 2688, 1856, 128, 6, 2, 1): MoeConfig("gemv", 16, 8, 128, 16, 128, 1, 2, 2),
}

INTERPRETER = MoeConfig("grouped", 16, 32, 32, 32, 32, 1, 4, 1)
INTERPRETER_GEMV = MoeConfig("gemv", 16, 16, 32, 16, 32, 1, 4, 1)

# the configs ``tune`` tries (its bench keeps, per case, the GEMV ones for T <= 2 * GEMV_MAX_TOKENS and
# the grouped ones whose block_m fits the mean rows per expert): 53 GEMV (12 on tensor cores), 70 grouped (vLLM's
# H100 table for Nano's shape among them).
# The GEMV tiles' loops are not pipelined (a program waits for each tile), so a grid a few programs
# past a whole number of waves ends on those few at one program's pace (worth 3% of Nano's decode
# call when measured: the TABLE row). How many programs an SM holds
# follows from the registers (sm_90, Triton 3.6, ptxas): [16, 256] x 4 warps takes 72 a thread, 7
# programs an SM, 924 on 132 SMs, while Nano's decode step launches 928 up programs (8 pairs x 116
# blocks of 16 of F=1856) at batch 1, 1856 at 2, 3712 at 4. 2 warps on tiles of at most 2048 values
# (47-72 registers, 14-21 programs an SM) shift those edges; larger 2-warp tiles take 150+ registers
CANDIDATES: list[dict] = (
    [dict(path="gemv", block_m=16, block_n_up=bn, block_k_up=bk, block_n_down=bnd, block_k_down=bk,
          group_m=1, num_warps=w, num_stages=2)
     for bn in (8, 16, 32) for bnd in (8, 16, 32) for bk in (128, 256) for w in (2, 4, 8)
     if w > 2 or max(bn, bnd) * bk <= 2048]
    # the GEMV path on tensor-core tiles: the weight tiles stream through cp.async, num_stages deep (12)
    + [dict(path="gemv", block_m=16, block_n_up=bn, block_k_up=bk, block_n_down=bn, block_k_down=bk,
            group_m=1, num_warps=4, num_stages=st, gemv_dot=True)
       for bn in (16, 32, 64) for bk in (128, 256) for st in (3, 4)]
    + [dict(path="grouped", block_m=bm, block_n_up=bn, block_k_up=bk, block_n_down=bn, block_k_down=bk,
            group_m=1 if bm <= 32 else 8, num_warps=w, num_stages=st)
       for bm in (16, 32, 64, 128) for bn in (64, 128) for bk in (64, 128) for w in (4, 8) for st in (3, 4)
       if (bm * bk + bk * bn) * 2 * st <= 200 * 1024]  # shared memory of the pipelined tiles (H100: 227 KiB)
    + [dict(path="grouped", block_m=bm, block_n_up=256, block_k_up=64, block_n_down=256, block_k_down=64,
            group_m=8, num_warps=8, num_stages=st) for bm in (64, 128) for st in (3, 4)]
    # vLLM 0.33's H100 table for Nano's experts (E=128, N=1856) as it stands, L2 groups of 1 row block:
    # 512-1024 tokens, 1536, 2048, 3072-4096
    + [dict(path="grouped", block_m=bm, block_n_up=bn, block_k_up=bk, block_n_down=bn, block_k_down=bk,
            group_m=1, num_warps=w, num_stages=st)
       for bm, bn, bk, w, st in ((64, 128, 128, 8, 4), (128, 128, 64, 4, 3), (128, 128, 64, 8, 5), (128, 256, 64, 8, 4))]
)

_forced: Forced[MoeConfig] = Forced()


def forced_config(**fields) -> contextlib.AbstractContextManager[None]:
    """Within the block every ``fused_moe`` call launches this config (``tune``'s hook)."""
    return _forced.use(MoeConfig(**fields))


def token_bucket(T: int) -> int:
    """The smallest bucket >= T (the largest bucket for more tokens)."""
    for b in TOKEN_BUCKETS:
        if T <= b:
            return b
    return TOKEN_BUCKETS[-1]


def table_key(device: torch.device, dtype: torch.dtype, T: int, M: int, F: int, E: int, k: int,
              shared: int = 0) -> tuple[str, str, int, int, int, int, int, int]:
    """TABLE's key of a call (also ``tune``'s, through the bench's ``tune_table_key``)."""
    return (gpu_family(device), str(dtype).replace("torch.", ""), M, F, E, k, shared, token_bucket(T))


def _even_block(K: int, wanted: int) -> int:
    """``wanted`` if it divides K, else the largest of 128 / 64 / 32 that does (unmasked loads),
    else ``wanted`` (masked)."""
    if K % wanted == 0:
        return wanted
    for b in (128, 64, 32):
        if b <= wanted and K % b == 0:
            return b
    return wanted


def gemv_heuristic(T: int, M: int, F: int) -> MoeConfig:
    """The GEMV path's fallback: [16, 256] weight tiles (16-byte loads, masked where 256 does not
    divide the width: still vectorised, as widths are multiples of 16), one pair per program."""
    return MoeConfig("gemv", 16, 16, 256, 16, 256, 1, 4, 2)


def heuristic(T: int, M: int, F: int, E: int, k: int) -> MoeConfig:
    """The fallback for keys not in TABLE (aimed at an H100, bf16 weights)."""
    if T <= GEMV_MAX_TOKENS:
        return gemv_heuristic(T, M, F)
    per_expert = T * k / E  # mean rows per expert
    if per_expert <= 16:
        bm, bn, bk, g, w, s = 16, 64, 128, 1, 4, 4
    elif per_expert <= 48:
        bm, bn, bk, g, w, s = 32, 64, 128, 4, 4, 4
    elif per_expert <= 192:
        bm, bn, bk, g, w, s = 64, 128, 64, 8, 4, 4
    else:
        bm, bn, bk, g, w, s = 128, 128, 64, 8, 8, 3
    return MoeConfig("grouped", bm, bn, _even_block(M, bk), bn, _even_block(F, bk), g, w, s)


def pick_config(device: torch.device, dtype: torch.dtype, T: int, M: int, F: int, E: int, k: int, *,
                shared: int = 0, interpreter: bool = False) -> MoeConfig:
    """The config of one call (``shared``: S, the shared-expert slices run in the same GEMVs):
    forced (tune), the interpreter's, the table's, or the heuristic's."""
    if _forced.value is not None:
        return _dot_tile_fits(_forced.value)
    if interpreter:
        return INTERPRETER_GEMV if T <= GEMV_MAX_TOKENS else INTERPRETER
    cfg = TABLE.get(table_key(device, dtype, T, M, F, E, k, shared)) if TABLE else None
    if cfg is None:
        return heuristic(T, M, F, E, k)
    return _dot_tile_fits(cfg if isinstance(cfg, MoeConfig) else MoeConfig(**cfg))  # (tune prints dicts)


def _dot_tile_fits(cfg: MoeConfig) -> MoeConfig:
    """A forced or tabled config as it can launch: a GEMV tensor-core tile has at least 16 features."""
    if cfg.path == "gemv" and cfg.gemv_dot and min(cfg.block_n_up, cfg.block_n_down) < 16:
        return cfg._replace(block_n_up=max(16, cfg.block_n_up), block_n_down=max(16, cfg.block_n_down))
    return cfg


# moe_gate: the router's GEMV and the routing in one launch, for up to this many tokens (one program
# routes them all, one after another)
GATE_MAX_TOKENS = 16


class GateConfig(NamedTuple):
    rows: int  # router rows (experts) per program
    block_m: int  # columns of M per step
    num_warps: int = 4  # (the last program's routing reduces across them: fewer warps, shorter reductions)


def gate_config(E: int, M: int, *, interpreter: bool = False) -> GateConfig:
    """``moe_gate``'s launch: about 128 programs of [rows, block_m] fp32 tiles of at most 4096 values
    (Nano: 128 programs of one row, M=2688 in one masked step; Super: 128 programs of 4 rows).
    Not measured yet: the lead's ``bench e2e`` / ``bench profile decode`` runs judge it."""
    if interpreter:
        return GateConfig(4, 32)
    rows = min(16, max(1, (E + 127) // 128))
    rows = 1 << (rows - 1).bit_length()  # a power of two
    block_m = min(4096 // rows, 1 << max(0, M - 1).bit_length())
    return GateConfig(rows, max(16, block_m))


def gemv_config(cfg: MoeConfig, T: int, M: int, F: int, *, interpreter: bool = False) -> MoeConfig:
    """``cfg`` if it is a GEMV config, else the GEMV heuristic's (``fused_moe_gemv`` forced on more tokens)."""
    if cfg.path == "gemv":
        return cfg
    return INTERPRETER_GEMV if interpreter else gemv_heuristic(T, M, F)
