"""Launch configs for the replay state update's kernels (precompute + main, or the split path).

Chosen by the launcher from the problem size, never by @triton.autotune (autotuning re-runs an
in-place kernel and would corrupt the state and the replay cache). Under the interpreter the
smallest tiles are used (its cost grows with the number of programs and with tile area).

The launcher's config comes from TABLE, keyed on (requests x heads bucket, padded T), produced by
`python -m fastmamba.bench tune --ops replay` on the GPU (the sweep prints a paste-ready TABLE at
the end; TABLE's header comment records the GPU, Triton version, date and commands of the run).
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

from fastmamba.ops._common.forced import Forced
from fastmamba.ops._common.host_math import next_power_of_2


class ReplayConfig(NamedTuple):
    block_p: int  # head-dim rows per program of the main kernel (>= 16: tl.dot's smallest M), or on
    num_warps: int  # the split path of the checkpoint kernel; main kernel: num_warps = block_p // 16
    heads: int  # heads per precompute program (all of one group)
    warps_pre: int = 4  # precompute kernel
    split: bool = False  # the split path (output kernel + checkpoint kernel) instead of the main kernel
    out_block_p: int | None = None  # the split path's output kernel: head-dim rows per program and
    out_warps: int | None = None  # warps (None: OUT_TILES' for the state dtype)


# Why the main kernel's num_warps is block_p // 16: its three tl.dot form a chain (the replayed
# state feeds the output matmul), and Triton then lays every warp along M (the P rows, 16 per
# warp); with more warps than that, each warp's slice of the dots shrinks but the chain's layout
# conversions grow (H100, Nemotron-H batch 128, T=6, fp32 state: 16x1 402 us, 16x2 417, 16x4 504).
# At 200-220 registers it runs at 8 warps per SM, latency-bound (ncu: 52% of DRAM bandwidth).
#
# The split path (large grids): an output kernel computes every request's T outputs from the
# stored state, without replaying it (the history enters through C.B products per group from the
# precompute kernel), and a persistent checkpoint kernel replays and stores the state of only the
# requests that store it this step (about one step in eight at the default history). Its output
# tile is not in the table (H100, Nemotron-H batch 128, dev_replay_variants (retired, docs/experiments.md): fp32 state,
# T=6: 64x4 343 us vs 32x2 404; fp16 state with C.S on 16-bit tensor cores, T=2 / 6 / 16: 64x4
# 185 / 211 / 308 us vs 32x2 194 / 226 / 336, and vs TF32 at 32x2, the best TF32 tile, 210 / 233 / 313).
OUT_TILES = {4: (64, 4), 2: (64, 4)}  # state bytes -> (out_block_p, out_warps)
# ... and its register cap (ptxas maxnreg; None: none): at 128 an fp32-state program fits four to
# an SM instead of three, without spills (H200, Nemotron-H batch 128 T=6: output kernel 225 -> 194 us)
OUT_MAXNREG = {4: 128, 2: None}
# fp32 state with bf16 activations, where TMA works (out_kernel.out_tma_usable): the output kernel as a
# persistent loop fed by TMA, so the pipeliner prefetches the next tile's state into shared memory
# (programs per SM, pipeline stages, register cap; "pdl_in": launch it as a programmatic dependent
# of the precompute kernel -- off: its waiting programs hold every SM's registers and keep the
# precompute kernel's later programs out). H200, Nemotron-H, step from a CUDA graph with the chain
# (dev_replay_persist (retired, docs/experiments.md), 2026-11-22; outputs bit-identical to the one-tile kernel's):
# batch 128 T=2 / 6 / 16: 232.8 / 262.5 / 325.2 -> 224.0 / 246.3 / 308.2 us; batch 256: 447.3 /
# 512.3 / 625.4 -> 435.6 / 475.0 / 610.0 us. With pdl_in 225.5 / 249.2 / 310.8; 3 stages 225.6 /
# 246.3 / 319.3; 4 programs per SM at 128 registers spill (356-362 us at T=6); 2 per SM uncapped
# 283-286; the same loop with pointer loads instead of TMA 317 (the addresses of every prefetched
# tile live in registers: 255 per thread, spills at any cap).
OUT_TMA: dict[str, int] | None = {"programs_per_sm": 3, "stages": 2, "maxnreg": 168, "pdl_in": 0}

# bf16 activations where TMA works (checkpoint_kernel.checkpoint_tma_usable: a history of up to 64 positions):
# the checkpoint kernel as a persistent loop fed by TMA, so the pipeliner prefetches the next
# tile's state and whole history while this one replays it in one tl.dot (P rows per tile, warps,
# pipeline stages, register cap; None: the pointer-load kernel, whose chunk loop runs at 240
# registers, two programs per SM). Programs per SM by history capacity (CKPT_TMA_PROGRAMS).
# H200, Nemotron-H batch 128, step from a CUDA graph (dev_replay_ckpt_tma (retired, docs/experiments.md),
# 2026-11-23), pointer kernel -> 32 x 4 at 128 registers with 2 stages, 4 programs per SM
# (history 16 / 32, T=2 / 6) or 3 (history 64, T=16): fp16 state 138.4 / 161.5 / 228.5 ->
# 130.7 / 154.8 / 228.1 us (checkpoint kernel 26.3 / 31.8 / 49.4 -> 20.2 / 25.9 / 50.1);
# fp32 state 222.2 / 243.8 / 306.1 -> 219.2 / 238.8 / 296.0. At history 64, 4 per SM: 235.3 (fp16)
# and 312.1 (fp32); 64 x 8 tiles (1 or 2 per SM) and 2 per SM with 3 stages were slower everywhere.
CKPT_TMA: dict[str, int] | None = {"block_p": 32, "num_warps": 4, "stages": 2, "maxnreg": 128}
CKPT_TMA_PROGRAMS = {16: 4, 32: 4, 64: 3}  # history capacity (power of two) -> programs per SM


def checkpoint_tma_programs_per_sm(capacity: int) -> int:
    """Programs per SM of the TMA checkpoint kernel for a history of ``capacity`` positions."""
    return CKPT_TMA_PROGRAMS.get(max(16, next_power_of_2(capacity)), 3)


# The split path's three kernels run as a chain of programmatic dependent launches where the GPU
# has them (sm_90+; our own kernels inside one op, so independent of the FASTMAMBA_PDL opt-in):
# the output kernel loads each slot's stored state and history while the precompute kernel runs,
# and the checkpoint kernel replays while the output kernel's last programs finish (it waits before
# it stores). H200, Nemotron-H batch 128, fp16 state: T=2 150 -> 142 us, T=16 250 -> 241 us.
CHAIN_PDL = True

# What the tuning sweep (`python -m fastmamba.bench tune --ops replay`) tries: the one-kernel path
# with each main-kernel P tile and 4 or 8 heads per precompute program, and the split path with
# two checkpoint-kernel tiles and 8 heads x 4 warps or 16 heads x 2 warps per precompute program
# (every swept T pads to 16).
CANDIDATES = [
    dict(block_p=bp, num_warps=bp // 16, heads=hd, warps_pre=4) for bp in (16, 32, 64) for hd in (4, 8)
] + [
    dict(block_p=bp, num_warps=w, heads=hd, warps_pre=wp, split=True)
    for bp, w in ((32, 4), (64, 4)) for hd, wp in ((8, 4), (16, 2))
]

_forced: Forced[ReplayConfig] = Forced()


def forced_config(block_p: int, num_warps: int, heads: int, warps_pre: int = 4, split: bool = False,
                  out_block_p: int | None = None, out_warps: int | None = None) -> contextlib.AbstractContextManager[None]:
    """Use this config for every launch inside the block (the tuning sweep's and the tests' hook);
    the split path's output tile defaults to OUT_TILES' for the state dtype."""
    return _forced.use(ReplayConfig(block_p, num_warps, heads, warps_pre, split, out_block_p, out_warps))


def padded_tokens(T: int) -> int:
    """The token count the kernels pad T to for tl.dot (>= 16, a power of two): the table's second key."""
    return max(16, next_power_of_2(T))


def table_key(*, programs_per_block: int, t_pad: int) -> tuple[int, int]:
    """TABLE's key: (requests x heads rounded up to a power of two, the padded token count)."""
    return next_power_of_2(max(1, programs_per_block)), t_pad


# (requests x heads bucket, padded T) -> config, for 16-bit activations (fp32 activations take the
# one-kernel path with block_p 64, see pick_config). MEASURED: the paste-ready table of
#   python -m fastmamba.bench tune --ops replay --cases nemotron-h-tp8 --json tune-tp8.jsonl
#   python -m fastmamba.bench tune --ops replay --cases "nemotron-h T" --json tune-full.jsonl
#   python -m fastmamba.bench tune --ops replay --table-from tune-tp8.jsonl,tune-full.jsonl
# on an NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, Triton 3.6.0), 2026-11-22, at commit 6113f40
# (the CANDIDATES below): per key the config with the smallest geometric mean of (time / that
# case's best) over its cases -- Nemotron-H (H128) and its TP=8 slice (H16), fp32 and fp16 state,
# bf16 activations, T 2, 4, 6, 8, 16 (all pad to 16), batch 1-256; each comment gives that mean,
# the worst case's ratio and the previous (guessed) table's mean ratio. T > 16 (t_pad 32, 64) was
# not swept: lookup falls back to _guess. The split-path keys (4096 and up) were re-swept on the
# issue's GPU after the split path's rework (precompute 16 heads x 2 warps joined the candidates):
#   python -m fastmamba.bench tune --ops replay --cases "nemotron-h T" --batch 32,128,256
# on an NVIDIA H200 (torch 2.11.0+cu130, Triton 3.6.0), 2026-11-22: Nemotron-H batch 32 / 128 / 256,
# fp32 and fp16 state, T 2-16; every case's best is its key's config (the previous split entry
# 32x4 / 8 heads x 4 warps: 1.02x at 4096, 1.06x at 16384 and 32768).
TABLE: dict[tuple[int, int], ReplayConfig] = {
    (16, 16): ReplayConfig(block_p=16, num_warps=1, heads=4, warps_pre=4),  # 10 cases: 1.000x (worst 1.00x), guess 1.02x
    (128, 16): ReplayConfig(block_p=16, num_warps=1, heads=4, warps_pre=4),  # 20 cases: 1.000x (worst 1.00x), guess 1.02x
    (512, 16): ReplayConfig(block_p=64, num_warps=4, heads=4, warps_pre=4),  # 10 cases: 1.004x (worst 1.02x), guess 1.02x
    (1024, 16): ReplayConfig(block_p=32, num_warps=2, heads=8, warps_pre=4),  # 10 cases: 1.022x (worst 1.07x), guess 1.06x
    (2048, 16): ReplayConfig(block_p=32, num_warps=2, heads=8, warps_pre=4),  # 10 cases: 1.030x (worst 1.07x), guess 1.06x
    (4096, 16): ReplayConfig(block_p=64, num_warps=4, heads=8, warps_pre=4, split=True),  # H200, 10 cases: 1.000x (worst 1.00x), previous 1.02x
    (16384, 16): ReplayConfig(block_p=64, num_warps=4, heads=16, warps_pre=4, split=True),  # H200, see below
    (32768, 16): ReplayConfig(block_p=64, num_warps=4, heads=16, warps_pre=4, split=True),  # H200, see below
}
# The two largest keys' precompute went from 16 heads x 2 warps to 16 x 4 when its two small dots
# became 16-bit dots on 16-bit operands (the precompute kernel's NATIVE16: 244 -> 112 registers at 16 x 4):
# H200, 2026-11-22, dev_replay_variants (retired, docs/experiments.md) pre-native, Nemotron-H batch 128, step us
# (TF32 16x2 -> 16-bit 16x4): fp16 state T=2 140.7 -> 137.7, T=6 167.6 -> 163.9, T=16 232.4 -> 229.3;
# fp32 state T=2 234.9 -> 232.6, T=6 263.6 -> 260.3, T=16 318.4 -> 317.5 (16-bit 16x2: within 1 us
# of TF32 16x2; 8x2 and 8x4 in between). Batch 256 (key 32768) follows batch 128 unmeasured.


def _guess(t_pad: int) -> ReplayConfig:
    """For a padded T beyond the table's: the precompute program's [heads, t_pad, t_pad] fp32
    tiles shrink with t_pad (heads = 8 * 16^2 / t_pad^2, at least 1)."""
    return ReplayConfig(block_p=16, num_warps=1, heads=max(1, min(8, 8 * 16 * 16 // (t_pad * t_pad))), warps_pre=4)


def lookup(bucket: int, t_pad: int, table: dict[tuple[int, int], ReplayConfig] | None = None) -> ReplayConfig:
    """TABLE's entry for (bucket, t_pad), else the nearest one: the nearest padded T (a larger
    t_pad than any in the table: ``_guess``), then the nearest bucket (log scale, the larger on a tie)."""
    table = TABLE if table is None else table
    if (bucket, t_pad) in table:
        return table[(bucket, t_pad)]
    t_pads = {t for _, t in table}
    if not t_pads or t_pad > max(t_pads):
        return _guess(t_pad)
    t_near = min(t_pads, key=lambda t: (abs(t.bit_length() - t_pad.bit_length()), -t))
    buckets = [b for b, t in table if t == t_near]
    b_near = min(buckets, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), -b))
    return table[(b_near, t_near)]


def pick_config(
    *, programs_per_block: int, headdim: int, dstate: int, t_pad: int, interpreter: bool, act_bytes: int = 2,
    state_bytes: int = 4,
) -> ReplayConfig:
    """Config for ``programs_per_block`` = requests x heads, head dim P, state size N, the token
    count padded for tl.dot (``t_pad`` >= 16), and the activations' and state's element sizes.

    In order: a forced config (the sweep, tests); under the interpreter the smallest tiles; else
    TABLE's entry for ``table_key(programs_per_block, t_pad)`` (``lookup``: the nearest entry
    when the key is missing), with block_p clamped to the head dim; fp32 activations take the
    one-kernel path with block_p 64 (the only tile whose tf32x3 dots do not spill). The split
    path's output tile comes from OUT_TILES (by state dtype) unless forced. ``dstate`` is not a
    key: every measured shape has N = 128.
    """
    p_cap = next_power_of_2(headdim)
    if _forced.value is not None:
        cfg = _forced.value
    elif interpreter:
        cfg = ReplayConfig(block_p=16, num_warps=1, heads=min(4, _guess(t_pad).heads), warps_pre=1)
    else:
        cfg = lookup(*table_key(programs_per_block=programs_per_block, t_pad=t_pad))
        if act_bytes >= 4:
            cfg = cfg._replace(block_p=64, num_warps=4, split=False)
    out_bp, out_w = OUT_TILES[4 if state_bytes >= 4 else 2]
    return cfg._replace(
        block_p=max(16, min(cfg.block_p, p_cap)),
        out_block_p=max(16, min(cfg.out_block_p or out_bp, p_cap)),
        out_warps=cfg.out_warps or out_w,
    )
