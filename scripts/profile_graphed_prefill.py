"""Where a graphed short prefill's GPU time goes (issues 19 and 23): the kernels of one replay of
``GraphedPrefill`` from a torch.profiler trace, grouped by kernel name, against the replay's wall time.

    python scripts/profile_graphed_prefill.py [--model mamba2-2.7b] [--shapes 1x64,1x128] [--reps 20]

For each shape: the replay's median wall time (synchronised), the span from the first kernel's start
to the last kernel's end, the sum of the kernels' durations, and the idle time between them (span
minus busy time: launch gaps inside the graph, PDL waits not included). Then one row per kernel name:
calls, total µs, µs per call, share of the busy time. The profiler adds a little to each node of a
graph, so read the span against the wall time, and the rows as shares.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from fastmamba.bench.ttft import _shapes  # noqa: E402


def kernel_events(trace_path: str) -> list[tuple[str, float, float]]:
    """(name, start µs, duration µs) of every GPU kernel in a chrome trace, in start order."""
    with open(trace_path, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    out = [(e["name"], float(e["ts"]), float(e["dur"])) for e in events
           if e.get("cat") == "kernel" and "dur" in e]
    return sorted(out, key=lambda k: k[1])


def short_name(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mamba2-2.7b")
    ap.add_argument("--shapes", default="1x64,1x128", type=_shapes)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--norm-pass", action="store_true", help="the mixers' norm as its own pass (norm_in_scan off)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    import fastmamba
    from fastmamba.generation.prefill_graphs import GraphedPrefill

    model = fastmamba.load_model(args.model, device="cuda", dtype=torch.bfloat16)
    if args.norm_pass:
        model.set_decode_tricks(norm_in_scan=False)
    print(f"# {torch.cuda.get_device_name()}, {args.model} bf16, torch {torch.__version__}")
    for b, length in args.shapes:
        cache = model.new_cache(b)
        slots = cache.alloc(b).tolist()
        prompts = torch.randint(0, model.cfg.vocab_size, (b, length)).tolist()
        gp = GraphedPrefill(model, cache, max_tokens=max(2048, b * length), max_requests=b)
        for _ in range(5):
            gp.prefill(prompts, slots, False)
        torch.cuda.synchronize()
        walls = []
        for _ in range(args.reps):
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
        print(f"\n## {b} x {length}: replay wall {statistics.median(walls):.3f} ms (median of {args.reps}); "
              f"kernels {len(kernels)}, span {span / 1e3:.3f} ms, busy {busy / 1e3:.3f} ms, "
              f"idle between kernels {(span - busy) / 1e3:.3f} ms ({(span - busy) / max(1, len(kernels) - 1):.2f} µs a gap)")
        by_name: dict[str, list[float]] = {}
        for name, _, d in kernels:
            by_name.setdefault(name, []).append(d)
        print("| kernel | calls | total µs | µs a call | share |\n|---|---:|---:|---:|---:|")
        for name, ds in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[: args.top]:
            print(f"| {short_name(name)} | {len(ds)} | {sum(ds):.1f} | {statistics.median(ds):.2f} | {sum(ds) / busy:.1%} |")
        del gp, cache
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
