"""Tune and validate ``paged_decode_attention``'s launch configs on one GPU (a few minutes).

    python -m fastmamba.bench tune-attention [--quick] [--batches 1,8,32,64,256] [--contexts 1024,8192,32768]
                                             [--budget-s 150]

Nemotron-H's attention shape (32 query / 8 KV heads of 128), bf16, pages of 16 tokens handed out
in a shuffled order, every request at the same context L; B x L <= 2^21. Per shape:
1. the launcher's own choice (``configs.pick_config``, through the public op) -- "auto";
2. split counts swept at the default tile, then every candidate tile (``configs.CANDIDATE_TILES``,
   those whose pipelined K/V buffers fit in shared memory) at the best split and its two
   neighbours. Every config is checked once against the fp32 reference (two requests' rows)
   before it is timed; a config that fails the check or does not compile is reported, not timed.
Timing as ``python -m fastmamba.bench kernels``: median of CUDA-graph replays over rotating input
sets (cold L2; triton.testing.do_bench), next to a same-size copy (a Triton copy kernel moving the
case's byte model, half read, half written, same timing) measured in this run. '% copy' = copy
time / our time.

Prints a markdown table (auto and best config per shape, µs and % of the same-size copy), a
ranking of the tiles, and the verdict on issue 21's bar (>= 80% of copy at batch >= 32, 8k
context). With $OUT set, writes paged_attention_tune.md and paged_attention_tune.json (every
timed row and the best config per shape) there. ``--budget-s`` bounds the sweeps: once spent,
the remaining shapes get the auto config and the copy only.

(Folded in from scripts/tune_paged_attention.py, issue 49.)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from fastmamba.bench.ops.paged_attention import attention_bytes
from fastmamba.bench.peak import device_name, l2_cache_bytes, measure_copy_bandwidth
from fastmamba.bench.size_copy import copy_calls
from fastmamba.bench.timing import TimingConfig, choose_n_sets, time_graph
from fastmamba.ops.attention import configs, paged_decode_attention
from fastmamba.ops.attention.api import _launch_config
from fastmamba.ops.attention.kernel import launch_paged_decode_attention
from fastmamba.ops.attention.ref import paged_decode_attention_ref

HQ, HKV, DH, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16
MAX_TOKENS = 1 << 21
TIMING = TimingConfig(warmup_ms=5.0, rep_ms=25.0, min_reps=8, max_rep_ms=120.0, min_calls=4)
CHECK_ROWS = 2
BAR = 80.0  # % of copy, batch >= 32 at 8k (issue 21)
DEVICE = "cuda"


def cfg_name(c: configs.DecodeConfig) -> str:
    return f"n{c.block_n} w{c.num_warps} st{c.num_stages} x{c.num_splits}"


class Shape:
    """n_sets rotating input sets of one (B, L): one pool, each set's requests on shuffled pages."""

    def __init__(self, B: int, L: int, l2: int):
        self.B, self.L = B, L
        self.nbytes = attention_bytes(B, L, HQ, HKV, DH, PAGE, DTYPE)
        self.n_sets = choose_n_sets(self.nbytes, l2)
        per = -(-L // PAGE)
        pages = self.n_sets * B * per
        g = torch.Generator(device=DEVICE).manual_seed(B * 100003 + L)
        self.k = torch.randn(pages + 1, PAGE, HKV, DH, generator=g, device=DEVICE, dtype=DTYPE)
        self.v = torch.randn(pages + 1, PAGE, HKV, DH, generator=g, device=DEVICE, dtype=DTYPE)
        order = torch.randperm(pages, generator=g, device=DEVICE).int()
        self.bts = list(order.view(self.n_sets, B, per))
        self.qs = [torch.randn(B, HQ, DH, generator=g, device=DEVICE).to(DTYPE) for _ in range(self.n_sets)]
        self.lens = torch.full((B,), L, dtype=torch.int32, device=DEVICE)
        self.slots = torch.arange(B, dtype=torch.int32, device=DEVICE)
        self.outs = [torch.empty_like(q) for q in self.qs]
        rows = slice(0, min(B, CHECK_ROWS))
        self.want = paged_decode_attention_ref(self.qs[0][rows], self.k, self.v, self.bts[0], self.lens,
                                               self.slots[rows])

    def call(self, i: int, config: configs.DecodeConfig | None):
        q, bt, out = self.qs[i], self.bts[i], self.outs[i]
        if config is None:  # the public op, its own config
            return lambda: paged_decode_attention(q, self.k, self.v, bt, self.lens, self.slots, out=out)
        return lambda: launch_paged_decode_attention(q, self.k, self.v, bt, self.lens, self.slots, out, DH ** -0.5,
                                                     config)

    def check(self, config: configs.DecodeConfig | None) -> str:
        """'' if set 0's first rows match the reference, else why not."""
        self.outs[0].fill_(float("nan"))
        self.call(0, config)()
        torch.cuda.synchronize()
        got = self.outs[0][: self.want.shape[0]].float()
        try:
            torch.testing.assert_close(got, self.want, atol=5e-2, rtol=1e-2)
        except AssertionError as exc:
            worst = [ln for ln in str(exc).splitlines() if "absolute difference" in ln]
            return "WRONG: " + (worst[0].strip() if worst else str(exc)[:100])
        return ""

    def time(self, config: configs.DecodeConfig | None) -> float:
        return time_graph(lambda i: self.call(i, config), self.n_sets, TIMING).median_us


def run_config(shape: Shape, config, rows: list, copy_us: float, tag: str) -> float | None:
    """Check, then time one config; appends its row; returns µs (None: failed)."""
    name = "auto " + cfg_name(config or _auto(shape)) if config is None else cfg_name(config)
    row = dict(B=shape.B, L=shape.L, config=name, tag=tag, us=None, pct_copy=None, error="")
    try:
        row["error"] = shape.check(config)
        if not row["error"]:
            row["us"] = shape.time(config)
            row["pct_copy"] = 100.0 * copy_us / row["us"]
    except Exception as exc:  # noqa: BLE001 -- a config that does not compile (shared memory) is a result
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        torch.cuda.synchronize()
    if config is not None:
        row.update(block_n=config.block_n, num_warps=config.num_warps, num_stages=config.num_stages,
                   num_splits=config.num_splits)
    rows.append(row)
    status = f"{row['us']:9.1f} us {row['pct_copy']:5.1f}%" if row["us"] else row["error"][:100]
    print(f"  B{shape.B:<4} L{shape.L:<6} {name:<26} {status}", flush=True)
    return row["us"]


def _auto(shape: Shape) -> configs.DecodeConfig:
    return _launch_config(shape.qs[0], shape.B * HKV, shape.bts[0].shape[1] * PAGE, DH, 2)


def _compile_worker(tiles: list[tuple[int, int, int]]) -> list[str]:
    """Launch every tile once, split and not, on a tiny problem with the sweep's argument
    specialisation (contiguous pools, block-table rows a multiple of 16 entries): Triton's disk
    cache then holds the binaries, and the sweep loads them instead of compiling one at a time."""
    q = torch.randn(2, HQ, DH, device=DEVICE, dtype=DTYPE)
    k = torch.randn(65, PAGE, HKV, DH, device=DEVICE, dtype=DTYPE)
    bt = torch.randperm(64, device=DEVICE).int().view(2, 32)
    lens = torch.full((2,), 32 * PAGE - 3, dtype=torch.int32, device=DEVICE)
    slots = torch.arange(2, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    errors = []
    for tile in tiles:
        for splits in (1, 2):
            try:
                launch_paged_decode_attention(q, k, k, bt, lens, slots, out, 1.0, configs.DecodeConfig(*tile, splits))
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 -- reported, the sweep shows it again
                errors.append(f"{tile} x{splits}: {type(exc).__name__}")
    return errors


def precompile(tiles: list[tuple[int, int, int]], workers: int) -> None:
    """Compile the candidate tiles in ``workers`` processes (one CUDA context each)."""
    import concurrent.futures
    import multiprocessing

    t = time.time()
    chunks = [tiles[i::workers] for i in range(workers)]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        errors = [e for errs in pool.map(_compile_worker, [c for c in chunks if c]) for e in errs]
    print(f"precompiled {len(tiles)} tiles x 2 variants in {time.time() - t:.0f} s"
          + (f"; failed: {', '.join(errors)}" if errors else ""), flush=True)


def splits_for(shape: Shape, block_n: int, sms: int) -> list[int]:
    return [s for s in configs.CANDIDATE_SPLITS
            if s == 1 or (shape.L // s >= 2 * block_n and shape.B * HKV * s <= 32 * sms)]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--batches", default="1,8,32,64,256")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop sweeping (auto + copy only) after this")
    ap.add_argument("--quick", action="store_true", help="batch 32 and 64 at 8k only")
    ap.add_argument("--compile-workers", type=int, default=min(8, max(1, (os.cpu_count() or 2) - 2)),
                    help="processes compiling the candidate tiles up front (0: compile as the sweep goes)")


def run(args: argparse.Namespace, command: str) -> int:
    if not torch.cuda.is_available():
        print("error: bench tune-attention needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    print(f"# {command}")
    t0 = time.time()
    dev = torch.device(DEVICE)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    l2 = l2_cache_bytes(dev)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    shapes = [(b, c) for c in contexts for b in batches if b * c <= MAX_TOKENS]
    if args.quick:
        shapes = [(32, 8192), (64, 8192)]
    # the issue's bar first, then the rest: if the budget runs out, the rest get auto only
    shapes.sort(key=lambda s: (not (s[0] >= 32 and s[1] == 8192), s[1], s[0]))
    copy_gbs = measure_copy_bandwidth(dev)
    import triton

    head = (f"{device_name(dev)}, {sms} SMs, torch {torch.__version__}, Triton {triton.__version__}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, 2 GiB copy {copy_gbs:.0f} GB/s; "
            f"Hq {HQ} Hkv {HKV} Dh {DH}, {PAGE}-token pages shuffled, bf16")
    print(head, flush=True)
    if args.compile_workers > 0:
        default_tile_ = configs.TILES.get((DH, 2)) or configs.fallback_tile(DH, 2)
        try:
            precompile(sorted({default_tile_, *configs.CANDIDATE_TILES}), args.compile_workers)
        except Exception as exc:  # noqa: BLE001 -- a broken worker pool only costs compile time in the sweep
            print(f"precompile failed ({type(exc).__name__}: {exc}); the sweep compiles as it goes", flush=True)
    default_tile = configs.TILES.get((DH, 2)) or configs.fallback_tile(DH, 2)
    rows: list[dict] = []
    timed: dict[tuple[int, int], dict[configs.DecodeConfig, float]] = {}
    summary: dict[tuple[int, int], dict] = {}
    # pass 1, every shape: the copy, the auto config, the split counts at the default tile
    for B, L in shapes:
        shape = Shape(B, L, l2)
        copy_us = time_graph(copy_calls(shape.nbytes, shape.n_sets, dev), shape.n_sets, TIMING).median_us
        print(f"B{B} L{L}: {shape.nbytes / 1e6:.1f} MB, copy {copy_us:.1f} us, {shape.n_sets} sets", flush=True)
        auto = _auto(shape)
        auto_us = run_config(shape, None, rows, copy_us, "auto")
        summary[B, L] = dict(B=B, L=L, mbytes=shape.nbytes / 1e6, copy_us=copy_us, auto=cfg_name(auto),
                             auto_config=auto._asdict(), auto_us=auto_us,
                             auto_pct=100 * copy_us / auto_us if auto_us else None)
        t = timed.setdefault((B, L), {})
        if time.time() - t0 < args.budget_s:
            for sp in splits_for(shape, default_tile[0], sms):
                c = configs.DecodeConfig(*default_tile, sp)
                t[c] = run_config(shape, c, rows, copy_us, "splits") or math.inf
        del shape
        torch.cuda.empty_cache()
    # pass 2, the issue's shapes first, while the budget lasts: every tile at the best split so far
    # and its two neighbours
    for B, L in shapes:
        if time.time() - t0 >= args.budget_s:
            print("(budget spent: tile sweep cut short)", flush=True)
            break
        t = timed[B, L]
        if not any(us < math.inf for us in t.values()):
            continue
        shape = Shape(B, L, l2)
        copy_us = summary[B, L]["copy_us"]
        best_s = min(t, key=t.get).num_splits
        near = sorted({best_s, max(1, best_s // 2), min(configs.MAX_SPLITS, best_s * 2)})
        for tile in configs.CANDIDATE_TILES:
            if time.time() - t0 >= args.budget_s:
                break
            for sp in near:
                c = configs.DecodeConfig(*tile, sp)
                if c not in t and sp in splits_for(shape, tile[0], sms):
                    t[c] = run_config(shape, c, rows, copy_us, "tiles") or math.inf
        del shape
        torch.cuda.empty_cache()
    for key, s in summary.items():
        ok = {c: us for c, us in timed[key].items() if us < math.inf}
        best = min(ok, key=ok.get) if ok else None
        s.update(best=cfg_name(best) if best else None, best_config=best._asdict() if best else None,
                 best_us=ok.get(best), best_pct=100 * s["copy_us"] / ok[best] if best else None)
    summary = list(summary.values())

    lines = [head, "",
             "| B | L | MB | copy µs | auto config | auto µs | auto % copy | best config | best µs | best % copy |",
             "|---:|---:|---:|---:|---|---:|---:|---|---:|---:|"]
    fmt = lambda x, f: (f % x) if x is not None else "-"  # noqa: E731
    for s in sorted(summary, key=lambda s: (s["L"], s["B"])):
        lines.append(f"| {s['B']} | {s['L']} | {s['mbytes']:.0f} | {s['copy_us']:.1f} | {s['auto']} | "
                     f"{fmt(s['auto_us'], '%.1f')} | {fmt(s['auto_pct'], '%.0f%%')} | {s['best'] or '-'} | "
                     f"{fmt(s['best_us'], '%.1f')} | {fmt(s['best_pct'], '%.0f%%')} |")
    # each tile's standing: per shape, its best time over the splits tried / the shape's best time
    lines += ["", "Tiles (block_n, warps, stages), over the shapes the tile sweep reached: "
              "mean of the shape's best µs / the tile's best µs",
              "", "| tile | shapes | mean of best / tile |", "|---|---:|---:|"]
    by_shape: dict[tuple[int, int], dict[tuple[int, int, int], float]] = {}
    for r in rows:
        if r.get("block_n") and r["us"]:
            t = (r["block_n"], r["num_warps"], r["num_stages"])
            d = by_shape.setdefault((r["B"], r["L"]), {})
            d[t] = min(d.get(t, math.inf), r["us"])
    score: dict[tuple[int, int, int], list[float]] = {}
    for d in by_shape.values():
        if len(d) < 2:  # the tile sweep did not reach this shape
            continue
        top = min(d.values())
        for t, us in d.items():
            score.setdefault(t, []).append(top / us)
    ranked = sorted(score.items(), key=lambda kv: (-len(kv[1]), -sum(kv[1]) / len(kv[1])))
    for t, v in ranked:
        lines.append(f"| {t} | {len(v)} | {sum(v) / len(v):.3f} |")
    if ranked:
        top = ranked[0][0]
        lines += ["", f"suggested: configs.TILES[({DH}, 2)] = {top} (now {default_tile}); the split counts: compare "
                      "the auto and best configs' xN above with configs.pick_splits"]
    bar = [s for s in summary if s["B"] >= 32 and s["L"] == 8192]
    lines.append("")
    for s in bar:
        verdict = "MEETS" if (s["auto_pct"] or 0) >= BAR else "misses"
        lines.append(f"issue 21 bar (>= {BAR:.0f}% of copy), batch {s['B']} at 8k: auto {fmt(s['auto_pct'], '%.0f%%')} "
                     f"({verdict}), best {fmt(s['best_pct'], '%.0f%%')} ({s['best']})")
    lines.append(f"(wall time {time.time() - t0:.0f} s)")
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "paged_attention_tune.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(out_dir, "paged_attention_tune.json"), "w") as f:
            json.dump(dict(header=head, best=summary, rows=rows), f, indent=1, default=str)
        print(f"wrote {out_dir}/paged_attention_tune.md and .json")
    return 0
