"""Where an eager prefill's host time goes (issue 19): wall time of ``model.prefill`` against its
GPU time, then cProfile's top functions by own time.

    python scripts/profile_eager_prefill.py [--model mamba2-2.7b] [--shape 1x16] [--reps 10] [--top 30]

The GPU time is the sum of the kernels' device time in a torch.profiler trace of one prefill; the
wall time is the median of ``--reps`` synchronised calls after three warm-ups. Then the host time
of each op a layer calls, per layer: the functions are wrapped with a clock (no synchronize: the
launches return at once while the host is the bottleneck). cProfile's figures at the end are
inflated by its own per-call cost, so read them as shares, not microseconds.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from fastmamba.bench.ttft import parse_shape  # noqa: E402


def print_op_times(model, once, reps: int) -> None:
    """Host µs per layer of each op of a prefill layer (wrapped in place, then restored)."""
    import fastmamba.layers.mamba2 as layer_mod
    import fastmamba.models.mamba2_lm as lm_mod

    spent: dict[str, float] = {}

    def timed(name, fn):
        def inner(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return inner

    saved = [(layer_mod, n, getattr(layer_mod, n)) for n in ("causal_conv1d_varlen", "ssd_scan_varlen")]
    saved.append((lm_mod, "add_rmsnorm", lm_mod.add_rmsnorm))
    mixers = [layer.mixer for layer in model.backbone.layers]
    mods = [(m, n, getattr(m, n)) for m in mixers for n in ("in_proj", "out_proj", "norm")]
    fwd = [(m, "forward_varlen", m.forward_varlen) for m in mixers]
    for mod, name, fn in saved:
        setattr(mod, name, timed(name, fn))
    for m, name, fn in mods:
        m.__dict__[name] = timed(name, fn)  # found before the module's _modules entry
    for m, name, fn in fwd:
        setattr(m, name, timed("mixer.forward_varlen (all)", fn))
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            once()
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
        for m, name, _ in mods + fwd:
            m.__dict__.pop(name, None)
    per = reps * len(mixers)
    print(f"host µs per layer (wrapped calls; whole prefill {total / reps * 1e3:.2f} ms):")
    for name, sec in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:32s} {sec / per * 1e6:8.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mamba2-2.7b")
    ap.add_argument("--shape", default="1x16", type=parse_shape, help="B x L, e.g. 1x16")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    import fastmamba

    b, l = args.shape
    model = fastmamba.load_model(args.model, device="cuda", dtype=torch.bfloat16)
    cache = model.new_cache(b + 1)
    ids = torch.randint(0, model.cfg.vocab_size, (b, l), device="cuda")
    slots = torch.arange(b, dtype=torch.int32, device="cuda")

    def once():
        model.prefill(ids, cache, slots)

    for _ in range(3):
        once()
    torch.cuda.synchronize()
    walls = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        once()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        once()
        torch.cuda.synchronize()
    gpu_us = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0 and
                 not e.key.startswith("cuda") and e.device_type == torch.autograd.DeviceType.CUDA)
    n_layer = model.cfg.n_layer
    wall = statistics.median(walls)
    print(f"{torch.cuda.get_device_name()}  {args.model} {b}x{l} bf16 eager prefill: "
          f"wall {wall:.2f} ms (median of {args.reps}), GPU kernels {gpu_us / 1e3:.2f} ms, "
          f"host-bound share {max(0.0, 1 - gpu_us / 1e3 / wall):.0%}; {wall / n_layer * 1e3:.0f} us of wall per layer")
    print_op_times(model, once, args.reps)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.reps):
        once()
    torch.cuda.synchronize()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
