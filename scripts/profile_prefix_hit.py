"""Where a prefix-cache hit's time to first token goes (GPU): one engine, a shared 2048-token system
prompt, then requests that hit it; cProfile of the steps that prefill the 64 new tokens, next to
the wall time of the same steps without the profiler.

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
