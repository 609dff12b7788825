"""Time to first token of the engine with the prefix cache on, as the server runs it (GPU): prompt
chunks that take prefix-cache snapshots replay CUDA graphs (since 3a66deb; they ran eagerly before),
against the same engine with those chunks forced eager (``GraphedPrefill.fits`` refusing snapshots:
the old behaviour) and against no prefix cache, in one process.

    python scripts/prefix_cache_ttft.py [--model mamba2-2.7b] [--lengths 600,1024,2048,4096,8192]

Engine(max_batch=8, prefill_chunk=2048: the server's default, prefix cache of --cache-gb with its
default snapshot interval, ~512 tokens); one request of L fresh random tokens (no hit), one new token,
wall time of ``generate``; median of --reps after two warm-up requests per length. The "graphed" mode
runs first and last (its two columns: the run-to-run spread).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import fastmamba
from fastmamba.generation import prefill_graphs
from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mamba2-2.7b")
    ap.add_argument("--lengths", default="600,1024,2048,4096,8192")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cache-gb", type=float, default=2.0)
    args = ap.parse_args()
    lengths = [int(v) for v in args.lengths.split(",")]
    model = fastmamba.load_model(args.model, device="cuda", dtype=torch.bfloat16)
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    graphed_fits = prefill_graphs.GraphedPrefill.fits

    def eager_snapshots(self, lengths, snapshots=0):
        return snapshots == 0 and graphed_fits(self, lengths)

    times: dict[int, dict[str, list[float]]] = {}
    for mode in ("graphed", "eager", "off", "graphed"):
        prefill_graphs.GraphedPrefill.fits = eager_snapshots if mode == "eager" else graphed_fits
        engine = Engine(model, max_batch=8, prefill_chunk=2048,
                        prefix_cache_bytes=None if mode == "off" else int(args.cache_gb * (1 << 30)))
        for length in lengths:
            walls = []
            for _ in range(2 + args.reps):
                prompt = torch.randint(0, model.cfg.vocab_size, (length,), generator=gen).tolist()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.generate([prompt], params)
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - t0) * 1e3)
            times.setdefault(length, {}).setdefault(mode, []).append(statistics.median(walls[2:]))
        del engine
        torch.cuda.empty_cache()
    prefill_graphs.GraphedPrefill.fits = graphed_fits
    print(f"# {torch.cuda.get_device_name()}, {args.model} bf16, torch {torch.__version__}; Engine(max_batch=8, "
          f"prefill_chunk=2048, prefix cache {args.cache_gb:g} GiB), one request, one new token, median of {args.reps}")
    print("| prompt tokens | snapshot chunks graphed | snapshot chunks eager (before) | no prefix cache | eager / graphed |")
    print("|---:|---:|---:|---:|---:|")
    for length, t in times.items():
        best = min(t["graphed"])
        print(f"| {length} | {' / '.join(f'{v:.2f}' for v in t['graphed'])} ms | {t['eager'][0]:.2f} ms | "
              f"{t['off'][0]:.2f} ms | {t['eager'][0] / best:.2f}x |")


if __name__ == "__main__":
    main()
