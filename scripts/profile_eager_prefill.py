"""Where an eager prefill's host time goes (issue 19): wall time of ``model.prefill`` against its
GPU time, then cProfile's top functions by own time.

    python scripts/profile_eager_prefill.py [--model mamba2-2.7b] [--shape 1x16] [--reps 10] [--top 30]

The GPU time is the sum of the kernels' device time in a torch.profiler trace of one prefill; the
wall time is the median of ``--reps`` synchronised calls after three warm-ups. cProfile's figures
are inflated by its own per-call cost, so read them as shares, not microseconds.
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mamba2-2.7b")
    ap.add_argument("--shape", default="1x16")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    import fastmamba

    b, l = (int(v) for v in args.shape.split("x"))
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
    print(f"{torch.cuda.get_device_name()}  {args.model} {args.shape} bf16 eager prefill: "
          f"wall {wall:.2f} ms (median of {args.reps}), GPU kernels {gpu_us / 1e3:.2f} ms, "
          f"host-bound share {max(0.0, 1 - gpu_us / 1e3 / wall):.0%}; {wall / n_layer * 1e3:.0f} us of wall per layer")
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
