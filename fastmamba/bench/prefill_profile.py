"""Where a step's time goes (GPU): the kernels of a graphed decode step or a graphed prefill, or an eager
prefill's host time.

    python -m fastmamba.bench profile decode  [--model nemotron-3-nano] [--batch 1] [--context 512] [--reps 50]
                                              [--top 30] [--timeline 40] [--no-pdl]
    python -m fastmamba.bench profile graphed [--model mamba2-2.7b] [--shapes 1x64,1x128] [--reps 20] [--norm-pass]
    python -m fastmamba.bench profile eager   [--model mamba2-2.7b] [--shapes 1x16] [--reps 10] [--top 30]
    TRITON_INTERPRET=1 python -m fastmamba.bench profile launches [--model nemotron-3-tiny] [--batch 1] [--context 8]

decode: ``batch`` requests prefilled with ``context`` random tokens, then greedy steps of the engine's
``GraphedDecoder`` (CUDA graph, PDL where the GPU has it, unless --no-pdl): the median wall time of a
step (synchronised, --reps steps), then one step under torch.profiler: kernels per step, their span,
busy and idle time (launch gaps inside the graph), one row per kernel name, and with --timeline N
the first N kernels of the step in order (start, duration, gap before each: one layer's kernels read
as a row of the pattern).

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
from fastmamba.models.quantization import QUANTIZATION_CHOICES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("mode", choices=("decode", "graphed", "eager", "launches"), help="decode: kernels of one "
                        "graphed decode step; graphed: kernels of one graphed prefill replay; eager: wall vs GPU time "
                        "and cProfile of an eager prefill; launches: the kernels one decode step launches, counted on "
                        "the CPU under TRITON_INTERPRET=1 (bench/launches.py)")
    parser.add_argument("--model", default=None, help="preset or checkpoint dir (default: nemotron-3-nano for decode, "
                        "nemotron-3-tiny for launches, mamba2-2.7b otherwise)")
    parser.add_argument("--batch", type=int, default=1, help="decode: requests in the step (default 1)")
    parser.add_argument("--context", type=int, default=None,
                        help="decode / launches: prompt tokens before the step (default 512 / 8)")
    parser.add_argument("--timeline", type=int, default=0, metavar="N",
                        help="decode / launches: also list the step's first N kernels in order")
    parser.add_argument("--no-pdl", action="store_true", help="decode: graphs without programmatic dependent launch")
    parser.add_argument("--shapes", type=_shapes, default=None,
                        help="B x L list (default: 1x64,1x128 graphed, 1x16 eager)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per shape (default: 20 graphed, 10 eager)")
    parser.add_argument("--top", type=int, default=None, help="rows shown (default: 14 kernels, 30 functions)")
    parser.add_argument("--norm-pass", action="store_true", help="graphed: the mixers' norm as its own pass "
                        "(norm_in_scan off)")
    parser.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default=None,
                        help="fp8: quantise the 16-bit model on load (as bench e2e --quantization)")


def kernel_events(trace_path: str) -> list[tuple[str, float, float]]:
    """(name, start µs, duration µs) of every GPU kernel in a chrome trace, in start order."""
    with open(trace_path, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    out = [(e["name"], float(e["ts"]), float(e["dur"])) for e in events
           if e.get("cat") == "kernel" and "dur" in e]
    return sorted(out, key=lambda k: k[1])


def short_name(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def summary(kernels: list[tuple[str, float, float]], top: int) -> list[str]:
    """Markdown lines for ``kernel_events``' events of one replay: kernels, span, busy and idle time,
    then the ``top`` kernel names by total time (calls, total µs, median µs a call, share of busy)."""
    span = max(s + d for _, s, d in kernels) - kernels[0][1]
    busy = sum(d for _, _, d in kernels)
    lines = [f"kernels {len(kernels)}, span {span / 1e3:.3f} ms, busy {busy / 1e3:.3f} ms, idle between kernels "
             f"{(span - busy) / 1e3:.3f} ms ({(span - busy) / max(1, len(kernels) - 1):.2f} µs a gap)",
             "| kernel | calls | total µs | µs a call | share |", "|---|---:|---:|---:|---:|"]
    by_name: dict[str, list[float]] = {}
    for name, _, d in kernels:
        by_name.setdefault(name, []).append(d)
    for name, ds in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"| {short_name(name)} | {len(ds)} | {sum(ds):.1f} | {statistics.median(ds):.2f} | "
                     f"{sum(ds) / busy:.1%} |")
    return lines


def timeline(kernels: list[tuple[str, float, float]], n: int) -> list[str]:
    """Markdown lines for the first ``n`` kernels in start order: start (µs from the first), duration,
    gap since the previous kernel ended."""
    lines = ["| # | kernel | start µs | µs | gap µs |", "|---:|---|---:|---:|---:|"]
    t0, end = kernels[0][1], kernels[0][1]
    for i, (name, s, d) in enumerate(kernels[:n]):
        lines.append(f"| {i} | {short_name(name)} | {s - t0:.1f} | {d:.2f} | {max(0.0, s - end):.2f} |")
        end = max(end, s + d)
    return lines


def profiled_kernels(fn) -> list[tuple[str, float, float]]:
    """The GPU kernels of one synchronised call of ``fn`` under torch.profiler (``kernel_events``)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        return kernel_events(path)


def median_wall_ms(fn, reps: int, warm: int) -> float:
    """``fn()``'s median wall time in ms over ``reps`` synchronised calls, after ``warm`` calls (the
    first of which may capture a graph or compile) and a synchronise."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    walls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(walls)


def profile_decode(model, batch: int, context: int, reps: int, top: int, n_timeline: int, pdl: bool | None) -> None:
    """One graphed greedy decode step of ``batch`` requests after a ``context``-token prefill."""
    from fastmamba.generation.cuda_graphs import GraphedDecoder

    warm = 5
    paged = model.cfg.paged_cache if hasattr(model.cfg, "paged_cache") else False
    if paged:
        cache = model.new_cache(batch, max_seq_len=context + warm + reps + 16)
    else:
        cache = model.new_cache(batch)
    slots = cache.alloc(batch)
    slots_host, ones = slots.tolist(), [1] * batch
    prompts = torch.randint(0, model.cfg.vocab_size, (batch, context), device="cuda")
    tokens = model.prefill(prompts, cache, slots).argmax(-1)
    decoder = GraphedDecoder(model, cache, batch, pdl=pdl)
    state = {"tokens": tokens}

    def step():
        if paged:
            cache.grow(slots_host, ones)  # the engine's host-side step: pages and lengths
        state["tokens"] = decoder.decode(state["tokens"], slots).argmax(-1)

    wall = median_wall_ms(step, reps, warm)  # the first warm-up step captures the graph
    kernels = profiled_kernels(step)
    print(f"\n## decode, batch {batch}, context {context}: step wall {wall:.3f} ms "
          f"(median of {reps}, the host's grow and argmax included), PDL {'on' if decoder.pdl else 'off'}")
    if not kernels:
        print("the trace holds no kernels")
        return
    print("\n".join(summary(kernels, top)))
    if n_timeline:
        print(f"\nthe step's first {n_timeline} kernels in order:")
        print("\n".join(timeline(kernels, n_timeline)))


def profile_graphed(model, shapes, reps: int, top: int) -> None:
    from fastmamba.generation.prefill_graphs import GraphedPrefill

    for b, length in shapes:
        cache = model.new_cache(b)
        slots = cache.alloc(b).tolist()
        prompts = torch.randint(0, model.cfg.vocab_size, (b, length)).tolist()
        gp = GraphedPrefill(model, cache, max_tokens=max(2048, b * length), max_requests=b)
        def replay():
            gp.prefill(prompts, slots, False)

        wall = median_wall_ms(replay, reps, warm=5)
        kernels = profiled_kernels(replay)
        if not kernels:
            print(f"{b}x{length}: the trace holds no kernels")
            continue
        print(f"\n## {b} x {length}: replay wall {wall:.3f} ms (median of {reps})")
        print("\n".join(summary(kernels, top)))
        del gp, cache
        torch.cuda.empty_cache()


def profile_eager(model, name: str, shapes, reps: int, top: int) -> None:
    for b, length in shapes:
        cache = model.new_cache(b + 1)
        ids = torch.randint(0, model.cfg.vocab_size, (b, length), device="cuda")
        slots = torch.arange(b, dtype=torch.int32, device="cuda")

        def once():
            model.prefill(ids, cache, slots)

        wall = median_wall_ms(once, reps, warm=3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            once()
            torch.cuda.synchronize()
        gpu_us = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0 and
                     not e.key.startswith("cuda") and e.device_type == torch.autograd.DeviceType.CUDA)
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
    if args.mode == "launches":  # the CPU mode
        from fastmamba.bench import launches

        args.context = 8 if args.context is None else args.context
        return launches.run(args, command)
    args.context = 512 if args.context is None else args.context
    if not torch.cuda.is_available():
        print("error: bench profile needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    import fastmamba

    if args.batch < 1 or args.context < 1 or args.timeline < 0:
        print("error: --batch and --context must be >= 1, --timeline >= 0", file=sys.stderr)
        return 2
    graphed = args.mode == "graphed"
    name = args.model or ("nemotron-3-nano" if args.mode == "decode" else "mamba2-2.7b")
    shapes = args.shapes or ([(1, 64), (1, 128)] if graphed else [(1, 16)])
    reps = args.reps or (50 if args.mode == "decode" else 20 if graphed else 10)
    top = args.top or (30 if args.mode != "graphed" else 14)
    model = fastmamba.load_model(name, device="cuda", dtype=torch.bfloat16, quantization=args.quantization)
    print(f"# {command}\n# {torch.cuda.get_device_name()}, {name} bf16{', FP8 weights' if args.quantization else ''}, "
          f"torch {torch.__version__}")
    if args.mode == "decode":
        profile_decode(model, args.batch, args.context, reps, top, args.timeline, False if args.no_pdl else None)
    elif graphed:
        if args.norm_pass:
            model.set_decode_tricks(norm_in_scan=False)
        profile_graphed(model, shapes, reps, top)
    else:
        profile_eager(model, name, shapes, reps, top)
    return 0
