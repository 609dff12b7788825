"""Where a prefix-cache hit's time to first token goes (GPU): one engine, a shared 2048-token system
prompt, then requests that hit it. Printed: the hit TTFT; its phases (host time and the GPU's
position at the entry and exit of add_request, admission, prefix match, restore, the graphed
prefill, the graph replay and sampling: ``phases``); the restore and the graphed prefill alone;
the host time of each part (no CUDA events: ``host_parts``); the graph launch alone; the kernels of one graphed prefill; cProfile of the steps; with --trace a
CPU + CUDA Chrome trace (the profiler inflates graph launches: read host gaps from the phases).

    python scripts/profile_prefix_hit.py [--model mamba2-2.7b] [--system 2048] [--suffix 64]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import fastmamba
from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import SamplingParams


def first_token(engine: Engine, prompt: list[int], params: SamplingParams) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, params)
    while not any(o.rid == rid for o in engine.step()):
        pass
    dt = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    return dt


def phases(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> None:
    """Where a hit's time goes, without a profiler (which inflates graph launches to ~1 ms): the
    host time and the GPU's position (a CUDA event recorded there) at the entry and exit of the
    engine's parts, from add_request, median over ``prompts``. A GPU event equal to its host time
    means the GPU had run dry and waited for the host there."""
    from fastmamba.cache.prefix_cache import PrefixCache
    from fastmamba.generation import engine as engine_module
    from fastmamba.generation.prefill_graphs import GraphedPrefill

    marks: list = []
    parts = [(engine_module.Engine, "add_request", "add"), (engine_module.Engine, "_admit", "admit"),
             (PrefixCache, "match", "match"), (PrefixCache, "restore", "restore"),
             (GraphedPrefill, "prefill", "graphed prefill"), (torch.cuda.CUDAGraph, "replay", "replay"),
             (engine_module.Engine, "_emit", "sample")]
    saved = [(cls, name, getattr(cls, name)) for cls, name, _ in parts]

    def mark(what: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((what, time.perf_counter(), event))

    def wrapped(orig, label):
        def call(*a, **k):
            mark(label + " >")
            out = orig(*a, **k)
            mark(label + " <")
            return out
        return call

    for cls, name, label in parts:
        setattr(cls, name, wrapped(getattr(cls, name), label))
    runs = []
    try:
        for prompt in prompts:
            torch.cuda.synchronize()
            marks.clear()
            mark("start")
            first_token(engine, prompt, params)
            torch.cuda.synchronize()
            runs.append(list(marks))
    finally:
        for cls, name, orig in saved:
            setattr(cls, name, orig)
    print("phases of a hit (median over the hits; ms from add_request):   host    GPU there")
    table: dict = {}
    for run in runs:
        t0, e0 = run[0][1], run[0][2]
        seen: dict = {}
        for what, t, e in run[1:]:
            seen[what] = seen.get(what, 0) + 1
            if seen[what] == 1:  # the first time: the hit's own step
                table.setdefault(what, []).append((1e3 * (t - t0), e0.elapsed_time(e)))
    for what, vals in sorted(table.items(), key=lambda kv: statistics.median(v[0] for v in kv[1])):
        print(f"  {what:20s} {statistics.median(v[0] for v in vals):7.3f}  {statistics.median(v[1] for v in vals):7.3f}")



def host_parts(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> None:
    """Host time of each part of a hit (inclusive, summed over its calls in the hit, median over
    ``prompts``), from ``perf_counter`` alone: no CUDA events, so the marks cost ~0.2 us each and
    the small parts read true. The request goes in as the server's engine process adds it
    (``add_validated_request``)."""
    from fastmamba.cache import prefix_cache as pc_module
    from fastmamba.generation import engine as engine_module
    from fastmamba.generation import staging
    from fastmamba.generation.prefill_graphs import GraphedPrefill
    from fastmamba.generation.sampling import Sampler

    E, P = engine_module.Engine, pc_module.PrefixCache
    parts = [(E, "add_validated_request"), (E, "step"), (E, "_plan_chunk"), (E, "_admit"), (P, "match"),
             (type(engine.cache), "take"), (P, "restore"), (pc_module, "copy_rows"), (E, "_prefill_chunk"),
             (E, "_run_prefill"), (E, "_plan_snapshots"), (GraphedPrefill, "prefill"), (GraphedPrefill, "_validate"),
             (staging.StagedInputs, "set"), (staging.StagedInputs, "upload"), (torch.cuda.CUDAGraph, "replay"),
             (E, "_emit"), (Sampler, "sample"), (E, "_emit_runs")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in parts]
    spent: dict[str, float] = {}
    calls: dict[str, int] = {}

    def wrapped(orig, label):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0
                calls[label] = calls.get(label, 0) + 1
        return call

    for owner, name in parts:
        setattr(owner, name, wrapped(getattr(owner, name), name))
    runs, walls = [], []
    try:
        for prompt in prompts:
            spent.clear()
            calls.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            rid = engine.add_validated_request(prompt, params)
            while not any(o.rid == rid for o in engine.step()):
                pass
            walls.append(time.perf_counter() - t0)
            runs.append((dict(spent), dict(calls)))
            while engine.has_unfinished():
                engine.step()
    finally:
        for owner, name, orig in saved:
            setattr(owner, name, orig)
    print(f"host parts of a hit (add_validated_request to its first token: median {1e3 * statistics.median(walls):.3f} "
          "ms; inclusive us, median over the hits; calls)")
    for _, name in parts:
        vals = [r[0].get(name, 0.0) for r in runs]
        n = statistics.median(r[1].get(name, 0) for r in runs)
        print(f"  {name:24s} {1e6 * statistics.median(vals):9.1f}  {n:4.0f}")

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mamba2-2.7b")
    ap.add_argument("--system", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--trace", metavar="PATH", help="also write a torch.profiler (CPU + CUDA) Chrome trace of two hits")
    args = ap.parse_args()
    model = fastmamba.load_model(args.model)
    g = torch.Generator().manual_seed(0)
    system = torch.randint(0, 50000, (args.system,), generator=g).tolist()
    suffixes = torch.randint(0, 50000, (12, args.suffix), generator=g).tolist()
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    engine = Engine(model, max_batch=64, prefill_chunk=2048, prefix_cache_bytes=4 << 30)
    for s in suffixes[:3]:  # fills the cache, captures the graphs
        first_token(engine, system + s, params)
    walls = [first_token(engine, system + s, params) for s in suffixes[3:8]]
    print(f"hit TTFT without profiler: median {1e3 * statistics.median(walls):.2f} ms "
          f"({', '.join(f'{1e3 * w:.2f}' for w in walls)})")
    phases(engine, [system + s for s in suffixes[3:8]], params)
    host_parts(engine, [system + s for s in suffixes[3:8]], params)
    # the hit's parts alone, synchronised: the state restore, the graphed prefill of the new tokens
    entry = engine.prefix.match(system + suffixes[3])
    slot = engine.cache.take(1)[0]

    def timed(fn, n=20):
        ts = []
        for _ in range(n):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(ts)

    restore = timed(lambda: engine.prefix.restore(entry, engine.cache, slot))
    prefill = timed(lambda: engine.prefiller.prefill([suffixes[3]], [slot], True))
    print(f"parts: restore {restore:.2f} ms, graphed prefill of {args.suffix} tokens {prefill:.2f} ms "
          f"(bucket {engine.prefiller.buckets([args.suffix])})")
    # the graph launch alone: host time of replay(), GPU time between events around it, wall time
    # to completion (wall - GPU = what the GPU waited for the launch)
    graph, _ = engine.prefiller.graphs[engine.prefiller.buckets([args.suffix])]
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host, gpu, wall = [], [], []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        e0.record()
        graph.replay()
        t1 = time.perf_counter()
        e1.record()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append(t1 - t0)
        wall.append(t2 - t0)
        gpu.append(e0.elapsed_time(e1) / 1e3)
    med = lambda v: 1e3 * statistics.median(v)  # noqa: E731
    print(f"graph launch: replay() host {med(host):.3f} ms, GPU (events) {med(gpu):.3f} ms, wall to done {med(wall):.3f} ms")
    # the same with the GPU kept busy while the host launches (a 2 ms sleep kernel first)
    gpu_busy = []
    for _ in range(20):
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize()
        gpu_busy.append(e0.elapsed_time(e1) / 1e3)
    print(f"graph launch behind a busy GPU: GPU (events) {med(gpu_busy):.3f} ms")
    # restore variants: one copy_ per tensor, and index_copy_ over the whole pool
    pairs = list(zip(engine.cache.conv + engine.cache.ssm, engine.prefix.conv + engine.prefix.ssm))
    per_tensor = timed(lambda: [d[slot].copy_(s[entry.index]) for d, s in pairs])
    nbytes = sum(d[slot].numel() * d.element_size() for d, _ in pairs)
    print(f"restore: {nbytes / 1e6:.1f} MB of states; one copy_ per tensor {per_tensor:.2f} ms; "
          f"dtypes {sorted({str(d.dtype) for d, _ in pairs})}")
    # the kernels of one graphed prefill of the new tokens (CUPTI sees the graph's kernels)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.prefiller.prefill([suffixes[3]], [slot], True)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    engine.cache.free([slot])
    prof = cProfile.Profile()
    prof.enable()
    for s in suffixes[8:]:
        first_token(engine, system + s, params)
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    if args.trace:  # the host and GPU timelines of two whole hits (where the GPU waits for the host)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for s in suffixes[3:5]:
                with torch.profiler.record_function("hit"):
                    first_token(engine, system + s, params)
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
