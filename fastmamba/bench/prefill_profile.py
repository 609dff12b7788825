"""Where a prefill's time goes (GPU): the kernels of a graphed prefill, or an eager prefill's host time.

    python -m fastmamba.bench profile graphed [--model mamba2-2.7b] [--shapes 1x64,1x128] [--reps 20] [--norm-pass]
    python -m fastmamba.bench profile eager   [--model mamba2-2.7b] [--shapes 1x16] [--reps 10] [--top 30]

graphed: for each shape, one replay of ``GraphedPrefill`` under torch.profiler: the replay's median wall
time (synchronised), the span from the first kernel's start to the last kernel's end, the sum of the
kernels' durations and the idle time between them (span minus busy: launch gaps inside the graph),
then one row per kernel name (calls, total µs, µs a call, share of the busy time). The profiler adds a
little to each node of a graph: read the span against the wall time, and the rows as shares.

eager: ``model.prefill``'s wall time (median of --reps synchronised calls after three warm-ups) against
its GPU time (the kernels' device time in a torch.profiler trace of one prefill), then cProfile's top
functions by own time (inflated by cProfile's own per-call cost: read them as shares).

(Folded in from scripts/profile_graphed_prefill.py and scripts/profile_eager_prefill.py, issue 49.)
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch

from fastmamba.bench.ttft import _shapes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("mode", choices=("graphed", "eager"), help="graphed: kernels of one graph replay; "
                        "eager: wall vs GPU time and cProfile of an eager prefill")
    parser.add_argument("--model", default="mamba2-2.7b", help="preset or checkpoint dir")
    parser.add_argument("--shapes", type=_shapes, default=None,
                        help="B x L list (default: 1x64,1x128 graphed, 1x16 eager)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per shape (default: 20 graphed, 10 eager)")
    parser.add_argument("--top", type=int, default=None, help="rows shown (default: 14 kernels, 30 functions)")
    parser.add_argument("--norm-pass", action="store_true", help="graphed: the mixers' norm as its own pass "
                        "(norm_in_scan off)")


def kernel_events(trace_path: str) -> list[tuple[str, float, float]]:
    """(name, start µs, duration µs) of every GPU kernel in a chrome trace, in start order."""
    with open(trace_path, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    out = [(e["name"], float(e["ts"]), float(e["dur"])) for e in events
           if e.get("cat") == "kernel" and "dur" in e]
    return sorted(out, key=lambda k: k[1])


def short_name(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def profile_graphed(model, shapes, reps: int, top: int) -> None:
    from fastmamba.generation.prefill_graphs import GraphedPrefill

    for b, length in shapes:
        cache = model.new_cache(b)
        slots = cache.alloc(b).tolist()
        prompts = torch.randint(0, model.cfg.vocab_size, (b, length)).tolist()
        gp = GraphedPrefill(model, cache, max_tokens=max(2048, b * length), max_requests=b)
        for _ in range(5):
            gp.prefill(prompts, slots, False)
        torch.cuda.synchronize()
        walls = []
        for _ in range(reps):
            t0 = time.perf_counter()
            gp.prefill(prompts, slots, False)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            gp.prefill(prompts, slots, False)
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            kernels = kernel_events(path)
        if not kernels:
            print(f"{b}x{length}: the trace holds no kernels")
            continue
        span = max(s + d for _, s, d in kernels) - kernels[0][1]
        busy = sum(d for _, _, d in kernels)
        print(f"\n## {b} x {length}: replay wall {statistics.median(walls):.3f} ms (median of {reps}); "
              f"kernels {len(kernels)}, span {span / 1e3:.3f} ms, busy {busy / 1e3:.3f} ms, "
              f"idle between kernels {(span - busy) / 1e3:.3f} ms ({(span - busy) / max(1, len(kernels) - 1):.2f} µs a gap)")
        by_name: dict[str, list[float]] = {}
        for name, _, d in kernels:
            by_name.setdefault(name, []).append(d)
        print("| kernel | calls | total µs | µs a call | share |\n|---|---:|---:|---:|---:|")
        for name, ds in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
            print(f"| {short_name(name)} | {len(ds)} | {sum(ds):.1f} | {statistics.median(ds):.2f} | {sum(ds) / busy:.1%} |")
        del gp, cache
        torch.cuda.empty_cache()


def profile_eager(model, name: str, shapes, reps: int, top: int) -> None:
    for b, length in shapes:
        cache = model.new_cache(b + 1)
        ids = torch.randint(0, model.cfg.vocab_size, (b, length), device="cuda")
        slots = torch.arange(b, dtype=torch.int32, device="cuda")

        def once():
            model.prefill(ids, cache, slots)

        for _ in range(3):
            once()
        torch.cuda.synchronize()
        walls = []
        for _ in range(reps):
            t0 = time.perf_counter()
            once()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            once()
            torch.cuda.synchronize()
        gpu_us = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0 and
                     not e.key.startswith("cuda") and e.device_type == torch.autograd.DeviceType.CUDA)
        wall = statistics.median(walls)
        print(f"\n## {name} {b}x{length} bf16 eager prefill: wall {wall:.2f} ms (median of {reps}), "
              f"GPU kernels {gpu_us / 1e3:.2f} ms, host-bound share {max(0.0, 1 - gpu_us / 1e3 / wall):.0%}")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(reps):
            once()
        torch.cuda.synchronize()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(top)


def run(args: argparse.Namespace, command: str) -> int:
    if not torch.cuda.is_available():
        print("error: bench profile needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    import fastmamba

    graphed = args.mode == "graphed"
    shapes = args.shapes or ([(1, 64), (1, 128)] if graphed else [(1, 16)])
    reps = args.reps or (20 if graphed else 10)
    top = args.top or (14 if graphed else 30)
    model = fastmamba.load_model(args.model, device="cuda", dtype=torch.bfloat16)
    print(f"# {command}\n# {torch.cuda.get_device_name()}, {args.model} bf16, torch {torch.__version__}")
    if graphed:
        if args.norm_pass:
            model.set_decode_tricks(norm_in_scan=False)
        profile_graphed(model, shapes, reps, top)
    else:
        profile_eager(model, args.model, shapes, reps, top)
    return 0
