"""Target ``tune``: sweep launch configs of our decode kernels and print the best per case.

    python -m fastmamba.bench tune [--ops ssu,conv,norm] [--batch 1,8,64,256] [--json PATH]

Each op's ``configs.py`` exposes ``forced_config(**params)`` (a context manager the launcher
honours) and ``CANDIDATES`` (the configs to try). Cases, input sets and byte models are the
``kernels`` target's, timed the same way (CUDA-graph replays over rotating input sets). The
output is a table of (case, heuristic µs, best µs, best config); entries worth keeping are
copied into the op's table by hand, with the run's header in the commit message.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys

import torch

from fastmamba.bench import env
from fastmamba.bench.kernels import GPU_BATCHES, OPS, _int_list, _ops_list, load_benches
from fastmamba.bench.peak import device_name, l2_cache_bytes, measure_copy_bandwidth
from fastmamba.bench.timing import TimingConfig, choose_n_sets, time_graph

CONFIG_MODULES = {
    "ssu": "fastmamba.ops.state_update.configs",
    "conv": "fastmamba.ops.conv1d.configs",
    "norm": "fastmamba.ops.gated_rmsnorm.configs",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", type=_ops_list, default=list(OPS))
    parser.add_argument("--batch", type=_int_list, default=list(GPU_BATCHES))
    parser.add_argument("--json", metavar="PATH", help="write one JSON line per (case, config) here")
    parser.add_argument("--pdl", action="store_true",
                        help="time with programmatic dependent launch on (fastmamba.ops._common.pdl)")


def _time(bench, fn, case, sets, n_sets, pdl: bool) -> float:
    from fastmamba.ops._common.pdl import programmatic_dependent_launch

    with programmatic_dependent_launch(pdl):  # in force while the graph is captured
        return time_graph(lambda i: bench.bind(fn, case, sets[i]), n_sets, TimingConfig.quick()).median_us


def run(args: argparse.Namespace, command: str) -> int:
    if not torch.cuda.is_available():
        print("tune needs a CUDA GPU: it times compiled kernels", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    copy_gbs = measure_copy_bandwidth(device)
    l2 = l2_cache_bytes(device)
    print(f"# tune on {device_name(device)}, copy {copy_gbs:.0f} GB/s, L2 {l2 >> 20} MiB, "
          f"torch {torch.__version__}, triton {env.triton_version()}, PDL {'on' if args.pdl else 'off'}; command: {command}")
    out = open(args.json, "a") if args.json else None
    rows = []
    for key, bench in zip(args.ops, load_benches(args.ops)):
        configs = importlib.import_module(CONFIG_MODULES[key])
        fn = bench.providers(device)[0].fn
        for case in bench.cases(device, args.batch):
            n_sets = choose_n_sets(case.nbytes, l2)
            sets = [bench.make_set(case, device, seed=i) for i in range(n_sets)]
            base = _time(bench, fn, case, sets, n_sets, args.pdl)
            results = []
            for cand in configs.CANDIDATES:
                try:
                    with configs.forced_config(**cand):
                        us = _time(bench, fn, case, sets, n_sets, args.pdl)
                except Exception as exc:  # noqa: BLE001 - a config that fails to compile is skipped
                    print(f"  {case.label} {cand}: {type(exc).__name__}", file=sys.stderr)
                    continue
                results.append((us, cand))
                if out:
                    out.write(json.dumps({"case": case.label, "config": cand, "us": us,
                                          "gbs": case.nbytes / us / 1e3}) + "\n")
            best_us, best = min(results, key=lambda r: r[0])
            pct = 100 * case.nbytes / best_us / 1e3 / copy_gbs
            rows.append((case.label, base, best_us, pct, best))
            print(f"[tune] {case.label}: heuristic {base:.2f} µs, best {best_us:.2f} µs ({pct:.0f}% copy) {best}",
                  file=sys.stderr, flush=True)
        del sets
        torch.cuda.empty_cache()
    if out:
        out.close()
    print(f"{'case':48} {'heuristic µs':>13} {'best µs':>9} {'% copy':>7}  best config")
    for label, base, best_us, pct, best in rows:
        print(f"{label:48} {base:13.2f} {best_us:9.2f} {pct:6.0f}%  {best}")
    return 0
