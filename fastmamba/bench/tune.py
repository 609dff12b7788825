"""Target ``tune``: sweep launch configs of our kernels and print the best per case.

    python -m fastmamba.bench tune [--ops ssu,conv,norm,conv_fn,ssd] [--batch 1,8,64,256]
                                   [--cases SUBSTR,...] [--json PATH] [--pdl]

Each op's ``configs.py`` exposes ``forced_config(**params)`` (a context manager the launcher
honours) and ``CANDIDATES`` (the configs to try; a bench may pick another list per case, e.g. the
channel-first conv kernel's). Cases, input sets and byte models are the ``kernels`` and
``prefill`` targets', timed the same way (CUDA-graph replays over rotating input sets). The
default is the decode ops; the prefill ops (``conv_fn``, ``ssd``) are swept when named, on the
subset of their cases their bench's ``tune_cases`` picks (a few minutes each). ``--cases`` keeps
only the cases whose label contains one of the given substrings. The output is a table of (case, heuristic µs, best µs, best config); entries worth keeping are
copied into the op's table by hand, with the run's header in the commit message. An op whose
kernel or ``configs`` module is missing is reported and skipped (exit status 1).
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import dataclass
from types import ModuleType

import torch

from fastmamba.bench import env
from fastmamba.bench import prefill
from fastmamba.bench.kernels import GPU_BATCHES, OPS, _int_list, load_benches, ops_list
from fastmamba.bench.ops._base import OpBench, Provider, describe
from fastmamba.bench.peak import device_name, l2_cache_bytes, measure_copy_bandwidth
from fastmamba.bench.timing import choose_n_sets, time_graph

TUNE_OPS = {**OPS, **prefill.OPS}
CONFIG_MODULES = {
    "ssu": "fastmamba.ops.state_update.configs",
    "conv": "fastmamba.ops.conv1d.configs",
    "norm": "fastmamba.ops.gated_rmsnorm.configs",
    "conv_fn": "fastmamba.ops.conv1d_fn.configs",
    "ssd": "fastmamba.ops.ssd_scan.configs",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", type=ops_list(TUNE_OPS), default=list(OPS),
                        help=f"comma-separated subset of {','.join(TUNE_OPS)} (default: the decode ops {','.join(OPS)})")
    parser.add_argument("--batch", type=_int_list, default=list(GPU_BATCHES),
                        help="batch sizes of the decode ops (the prefill ops have fixed cases)")
    parser.add_argument("--cases", type=lambda t: [p for p in t.split(",") if p], default=None, metavar="SUBSTR,...",
                        help="only cases whose label contains one of these (e.g. nemotron-h, 'T8192 varlen', channel-last)")
    parser.add_argument("--json", metavar="PATH", help="write one JSON line per (case, config) here")
    parser.add_argument("--pdl", action="store_true",
                        help="time with programmatic dependent launch on (fastmamba.ops._common.pdl)")


@dataclass
class Sweep:
    """One op to sweep, or the reason it cannot be (``reason`` set, the rest possibly None)."""

    key: str
    bench: OpBench | None = None
    configs: ModuleType | None = None
    provider: Provider | None = None
    reason: str = ""


def plan_sweeps(keys: list[str], device: torch.device) -> list[Sweep]:
    """Load each op's bench, configs module and our provider; a missing piece becomes a reason."""
    sweeps = []
    for key in keys:
        sweep = Sweep(key)
        sweeps.append(sweep)
        try:
            sweep.bench = load_benches([key], TUNE_OPS)[0]
        except Exception as exc:  # noqa: BLE001
            sweep.reason = f"bench module {TUNE_OPS[key]} failed to import: {describe(exc)}"
            continue
        try:
            sweep.configs = importlib.import_module(CONFIG_MODULES[key])
            if not (hasattr(sweep.configs, "CANDIDATES") and hasattr(sweep.configs, "forced_config")):
                raise AttributeError("needs CANDIDATES and forced_config")
        except Exception as exc:  # noqa: BLE001
            sweep.reason = f"no sweep hooks in {CONFIG_MODULES[key]} yet ({describe(exc)})"
            continue
        ours = sweep.bench.providers(device)[0]
        if not ours.available:
            sweep.reason = f"fastmamba's kernel is unavailable ({ours.reason})"
            continue
        sweep.provider = ours
    return sweeps


def _time(bench, prov, case, sets, n_sets, pdl: bool) -> float:
    from fastmamba.ops._common.pdl import programmatic_dependent_launch

    with programmatic_dependent_launch(pdl):  # in force while the graph is captured
        return time_graph(lambda i: bench.bind(prov, case, sets[i]), n_sets, bench.quick_timing).median_us


def run(args: argparse.Namespace, command: str) -> int:
    if not torch.cuda.is_available():
        print("tune needs a CUDA GPU: it times compiled kernels", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    copy_gbs = measure_copy_bandwidth(device)
    l2 = l2_cache_bytes(device)
    print(f"# tune on {device_name(device)}, copy {copy_gbs:.0f} GB/s, L2 {l2 >> 20} MiB, "
          f"torch {torch.__version__}, triton {env.triton_version()}, PDL {'on' if args.pdl else 'off'}; command: {command}")
    sweeps = plan_sweeps(args.ops, device)
    for sw in sweeps:
        if sw.reason:
            print(f"[tune] {sw.key}: skipped: {sw.reason}", flush=True)
    out = open(args.json, "a") if args.json else None
    rows = []
    for sw in (s for s in sweeps if not s.reason):
        bench, configs, prov = sw.bench, sw.configs, sw.provider
        cases = bench.tune_cases(device, args.batch)
        if args.cases:
            cases = [c for c in cases if any(sub in c.label for sub in args.cases)]
        for case in cases:
            n_sets = choose_n_sets(case.nbytes, l2)
            sets = [bench.make_set(case, device, seed=i) for i in range(n_sets)]
            try:
                base = _time(bench, prov, case, sets, n_sets, args.pdl)
            except Exception as exc:  # noqa: BLE001 - the heuristic's own config fails: say so, try the rest
                print(f"  {case.label} heuristic: {describe(exc)}", file=sys.stderr)
                base = float("nan")
            results = []
            for cand in bench.tune_candidates(configs, case):
                try:
                    with configs.forced_config(**cand):
                        us = _time(bench, prov, case, sets, n_sets, args.pdl)
                except Exception as exc:  # noqa: BLE001 - a config that fails to compile is skipped
                    print(f"  {case.label} {cand}: {type(exc).__name__}", file=sys.stderr)
                    continue
                results.append((us, cand))
                if out:
                    out.write(json.dumps({"case": case.label, "config": cand, "us": us,
                                          "gbs": case.nbytes / us / 1e3,
                                          "tflops": case.flops / us / 1e6 if case.flops else None}) + "\n")
            del sets
            torch.cuda.empty_cache()
            if not results:
                rows.append((case.label, base, None, None, None, "no candidate ran"))
                print(f"[tune] {case.label}: heuristic {base:.2f} µs, no candidate ran", file=sys.stderr, flush=True)
                continue
            best_us, best = min(results, key=lambda r: r[0])
            pct = 100 * case.nbytes / best_us / 1e3 / copy_gbs
            tflops = case.flops / best_us / 1e6 if case.flops else None
            rows.append((case.label, base, best_us, pct, tflops, best))
            extra = f", {tflops:.1f} TFLOP/s" if tflops else ""
            print(f"[tune] {case.label}: heuristic {base:.2f} µs, best {best_us:.2f} µs ({pct:.0f}% copy{extra}) {best}",
                  file=sys.stderr, flush=True)
    if out:
        out.close()
    print(f"{'case':48} {'heuristic µs':>13} {'best µs':>9} {'% copy':>7} {'TFLOP/s':>8}  best config")
    for label, base, best_us, pct, tflops, best in rows:
        best_cell = "—" if best_us is None else f"{best_us:.2f}"
        pct_cell = "—" if pct is None else f"{pct:.0f}%"
        tflops_cell = "—" if tflops is None else f"{tflops:.1f}"
        print(f"{label:48} {base:13.2f} {best_cell:>9} {pct_cell:>7} {tflops_cell:>8}  {best}")
    return 1 if any(s.reason for s in sweeps) else 0
