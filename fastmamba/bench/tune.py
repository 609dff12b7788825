"""Target ``tune``: sweep launch configs of our kernels and print the best per case.

    python -m fastmamba.bench tune [--ops ssu,conv,norm,conv_fn,ssd,replay] [--batch 1,8,64,256]
                                   [--cases SUBSTR,...] [--json PATH] [--pdl] [--device auto|cuda|cpu]
    python -m fastmamba.bench tune --ops replay --table-from A.jsonl,B.jsonl

Each op's ``configs.py`` exposes ``forced_config(**params)`` (a context manager the launcher
honours) and ``CANDIDATES`` (the configs to try; a bench may pick another list per case, e.g. the
channel-first conv kernel's). Cases, input sets and byte models are the ``kernels``, ``prefill``
and ``spec`` targets', timed the same way (CUDA-graph replays over rotating input sets, the short
timing config). The default is the decode ops; the prefill ops (``conv_fn``, ``ssd``) are swept
when named, on the subset of their cases their bench's ``tune_cases`` picks (a few minutes each);
``replay`` (the speculative-verification kernels, timed as ``bench spec``'s replay provider: op +
commit) on ``bench spec``'s cases: Nemotron-H and its TP=8 slice, fp32 and fp16 state, T 2, 4, 6,
8, 16 (all padded to 16 for tl.dot), batch 1, 8, 32, 128, 256 (its default ``--batch``). ``--cases`` keeps
only the cases whose label contains one of the given substrings (e.g. ``nemotron-h-tp8``,
``"nemotron-h T"`` for the full shape alone, ``T16``, ``fp16``, ``b=128``). The whole replay sweep
(100 cases x 24 configs) takes longer than one 10-minute command: split it (by shape with
``--cases``, by batch with ``--batch``), each part with ``--json``, then ``--table-from`` those
files prints the table of all of them (the parts share table keys: (128, 16) is both the TP=8
slice at batch 8 and Nemotron-H at batch 1).

The output is a table of (case, default config's µs, best µs, best config). Entries worth keeping
are copied into the op's table by hand, with the run's header in the commit message. An op whose
bench also names the table key of a case (``tune_table_key``; ``replay``: (requests x heads
bucket, padded T)) gets, at the end, its whole table in paste-ready Python: per key the config
with the smallest geometric mean of (time / that case's best) over the key's cases; its JSON lines
carry the key, so ``--table-from`` rebuilds that table from the files of several runs. An op whose
kernel or ``configs`` module is missing is reported and skipped (exit status 1).

A GPU is needed to time anything. Without one, ``--ops replay`` alone runs a smoke sweep under
the Triton interpreter (``TRITON_INTERPRET=1``; tiny shape, T=2, batch 1, two configs): every
config reaches the launcher and the table is printed; the times are not speed.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from dataclasses import dataclass
from types import ModuleType

import torch

from fastmamba.bench import env
from fastmamba.bench import prefill
from fastmamba.bench.kernels import GPU_BATCHES, OPS, _int_list, load_benches, ops_list
from fastmamba.bench.ops import spec_verify
from fastmamba.bench.ops._base import Case, OpBench, Provider, describe
from fastmamba.bench.peak import device_name, l2_cache_bytes, measure_copy_bandwidth
from fastmamba.bench.timing import choose_n_sets, time_cpu, time_graph
from fastmamba.ops.runtime import interpreter_enabled

TUNE_OPS = {**OPS, **prefill.OPS, "replay": "fastmamba.bench.ops.spec_verify",
            "gemv": "fastmamba.bench.ops.gemv", "fp8": "fastmamba.bench.ops.fp8"}
CONFIG_MODULES = {
    "ssu": "fastmamba.ops.state_update.configs",
    "conv": "fastmamba.ops.conv1d.configs",
    "norm": "fastmamba.ops.gated_rmsnorm.configs",
    "conv_fn": "fastmamba.ops.conv1d_fn.configs",
    "ssd": "fastmamba.ops.ssd_scan.chunked.configs",
    "replay": "fastmamba.ops.replay.configs",
    "moe": "fastmamba.ops.moe.configs",  # swept when named: --ops moe
    "gemv": "fastmamba.ops.gemv.configs",  # swept when named: --ops gemv
    "fp8": "fastmamba.ops.fp8.configs",  # swept when named: --ops fp8 (the FP8 decode GEMVs)
}
DEFAULT_BATCHES = {"replay": spec_verify.GPU_BATCHES, "fp8": (1, 8)}  # others: kernels.GPU_BATCHES
CPU_SMOKE_OPS = ("replay",)  # ops with a sweep small enough for the interpreter
CPU_BATCHES = (1,)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    decode_ops = [k for k in OPS if k in CONFIG_MODULES and k != "moe"]  # the decode ops with launch configs (not attn)
    parser.add_argument("--ops", type=ops_list(TUNE_OPS), default=decode_ops,
                        help=f"comma-separated subset of {','.join(TUNE_OPS)} (default: the decode ops "
                             f"{','.join(decode_ops)})")
    parser.add_argument("--batch", type=_int_list, default=None,
                        help=f"batch sizes of the decode ops (default {','.join(map(str, GPU_BATCHES))}; replay "
                        f"{','.join(map(str, spec_verify.GPU_BATCHES))}; the prefill ops have fixed cases)")
    parser.add_argument("--cases", type=lambda t: [p for p in t.split(",") if p], default=None, metavar="SUBSTR,...",
                        help="only cases whose label contains one of these (e.g. nemotron-h, 'T8192 varlen', channel-last)")
    parser.add_argument("--json", metavar="PATH", help="write one JSON line per (case, config) here")
    parser.add_argument("--pdl", action="store_true",
                        help="time with programmatic dependent launch on (fastmamba.ops._common.pdl)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: CUDA when present; cpu: a smoke run of --ops replay under TRITON_INTERPRET=1")
    parser.add_argument("--table-from", metavar="PATH,...", type=lambda t: [p for p in t.split(",") if p],
                        help="no timing: print the paste-ready table of the one op in --ops from the --json files of "
                        "earlier sweeps (e.g. one per split of a sweep too long for one command)")


@dataclass
class Sweep:
    """One op to sweep, or the reason it cannot be (``reason`` set, the rest possibly None)."""

    key: str
    bench: OpBench | None = None
    configs: ModuleType | None = None
    provider: Provider | None = None
    reason: str = ""


@dataclass
class CaseResult:
    """One case's sweep: the default config's time, and (µs, config) for every config that ran."""

    label: str
    base_us: float
    results: list[tuple[float, dict]]
    key: object = None  # the op's table key for the case (its bench's tune_table_key), or None
    nbytes: int = 0
    flops: int = 0

    @property
    def best(self) -> tuple[float, dict] | None:
        return min(self.results, key=lambda r: r[0]) if self.results else None


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


def _time(bench, prov, case, sets, n_sets, pdl: bool, device: torch.device | None = None) -> float:
    """Median µs per call of ``prov`` on ``case`` (short timing config): CUDA-graph replays, or
    the CPU wall clock (interpreter smoke run)."""
    make_call = lambda i: bench.bind(prov, case, sets[i])  # noqa: E731
    if device is not None and device.type != "cuda":
        return time_cpu(make_call, n_sets, bench.quick_timing).median_us
    from fastmamba.ops.runtime import programmatic_dependent_launch

    with programmatic_dependent_launch(pdl):  # in force while the graph is captured
        return time_graph(make_call, n_sets, bench.quick_timing).median_us


def _device(args: argparse.Namespace) -> tuple[torch.device | None, str]:
    """The device to sweep on, or None and why not."""
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            return None, "error: --device cuda, but torch sees no CUDA device"
        return torch.device("cuda"), ""
    others = [k for k in args.ops if k not in CPU_SMOKE_OPS]
    if others:
        return None, (f"tune needs a CUDA GPU: it times compiled kernels (without one, only a smoke run of "
                      f"--ops {','.join(CPU_SMOKE_OPS)} under TRITON_INTERPRET=1; not {','.join(others)})")
    if not interpreter_enabled():
        return None, "tune on the CPU is a smoke run through the Triton interpreter: set TRITON_INTERPRET=1 before python starts"
    return torch.device("cpu"), ""


def run(args: argparse.Namespace, command: str) -> int:
    if getattr(args, "table_from", None):
        return table_from_json(args, command)
    device, why = _device(args)
    if device is None:
        print(why, file=sys.stderr)
        return 2
    cuda = device.type == "cuda"
    copy_gbs = measure_copy_bandwidth(device)
    l2 = l2_cache_bytes(device)
    print(f"# tune on {device_name(device)}, copy {copy_gbs:.0f} GB/s, L2 {l2 >> 20} MiB, "
          f"torch {torch.__version__}, triton {env.triton_version()}, PDL {'on' if args.pdl else 'off'}, "
          f"{time.strftime('%Y-%m-%d')}; command: {command}")
    if not cuda:
        print("# no GPU: a smoke run under the Triton interpreter; the times below are not speed")
    sweeps = plan_sweeps(args.ops, device)
    for sw in sweeps:
        if sw.reason:
            print(f"[tune] {sw.key}: skipped: {sw.reason}", flush=True)
    out = open(args.json, "a") if args.json else None
    done: list[tuple[Sweep, list[CaseResult]]] = []
    try:
        for sw in (s for s in sweeps if not s.reason):
            batches = args.batch or list(DEFAULT_BATCHES.get(sw.key, GPU_BATCHES) if cuda else CPU_BATCHES)
            cases = sw.bench.tune_cases(device, batches)
            if args.cases:
                cases = [c for c in cases if any(sub in c.label for sub in args.cases)]
            results: list[CaseResult] = []
            done.append((sw, results))
            for case in cases:
                results.append(_sweep_case(sw, case, device, l2, copy_gbs, args.pdl, out))
    except KeyboardInterrupt:  # `timeout -s INT` (gpu_session.sh): the cases finished so far still make a table
        print("[tune] interrupted: the tables below hold the cases finished before it", file=sys.stderr, flush=True)
    finally:
        if out:
            out.close()
    print(f"{'case':48} {'default µs':>11} {'best µs':>9} {'% copy':>7} {'TFLOP/s':>8}  best config")
    for _, results in done:
        for res in results:
            print(_table_row(res, copy_gbs))
    for sw, results in done:
        if getattr(sw.bench, "tune_table_key", None) is not None and results:
            print()
            print("\n".join(paste_ready_table(sw, results, command)))
    return 1 if any(s.reason for s in sweeps) else 0


def table_from_json(args: argparse.Namespace, command: str) -> int:
    """``--table-from``: the paste-ready table from the JSON lines of earlier sweeps of one op
    (lines without a table key are ignored; a (case, config) timed twice keeps its last time)."""
    if len(args.ops) != 1:
        print(f"--table-from needs exactly one op in --ops, got {','.join(args.ops)}", file=sys.stderr)
        return 2
    key = args.ops[0]
    try:
        sw = Sweep(key, load_benches([key], TUNE_OPS)[0], importlib.import_module(CONFIG_MODULES[key]))
    except Exception as exc:  # noqa: BLE001
        print(f"--table-from: cannot load {key}'s bench or configs: {describe(exc)}", file=sys.stderr)
        return 2
    cases: dict[str, dict] = {}
    for path in args.table_from:
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if rec.get("key") is None:
                    continue
                case = cases.setdefault(rec["case"], dict(key=tuple(rec["key"]), times={}))
                case["base_us"] = rec.get("default_us", float("nan"))
                case["times"][json.dumps(rec["config"], sort_keys=True)] = rec["us"]
    if not cases:
        print(f"--table-from: no lines with a table key in {', '.join(args.table_from)}", file=sys.stderr)
        return 1
    results = [
        CaseResult(label, c["base_us"] if c["base_us"] is not None else float("nan"),
                   [(us, json.loads(cfg)) for cfg, us in c["times"].items()], key=c["key"])
        for label, c in cases.items()
    ]
    print("\n".join(paste_ready_table(sw, results, command)))
    return 0


def _sweep_case(sw: Sweep, case: Case, device: torch.device, l2: int, copy_gbs: float, pdl: bool, out) -> CaseResult:
    """Time the default config and every candidate on ``case``; progress on stderr, JSON to ``out``."""
    bench, configs, prov = sw.bench, sw.configs, sw.provider
    key_of = getattr(bench, "tune_table_key", None)
    key = key_of(configs, case) if key_of is not None else None
    n_sets = choose_n_sets(case.nbytes, l2) if device.type == "cuda" else 1
    sets = [bench.make_set(case, device, seed=i) for i in range(n_sets)]
    try:
        base = _time(bench, prov, case, sets, n_sets, pdl, device)
    except Exception as exc:  # noqa: BLE001 - the default config fails: say so, try the rest
        print(f"  {case.label} default: {describe(exc)}", file=sys.stderr)
        base = float("nan")
    results = []
    for cand in bench.tune_candidates(configs, case):
        try:
            with configs.forced_config(**cand):
                us = _time(bench, prov, case, sets, n_sets, pdl, device)
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile is skipped
            print(f"  {case.label} {cand}: {type(exc).__name__}", file=sys.stderr)
            continue
        results.append((us, cand))
        if out:
            out.write(json.dumps({"case": case.label, "config": cand, "us": us, "default_us": base, "key": key,
                                  "gbs": case.nbytes / us / 1e3,
                                  "tflops": case.flops / us / 1e6 if case.flops else None}) + "\n")
    del sets
    if device.type == "cuda":
        torch.cuda.empty_cache()
    res = CaseResult(case.label, base, results, key=key, nbytes=case.nbytes, flops=case.flops)
    if res.best is None:
        print(f"[tune] {case.label}: default {base:.2f} µs, no candidate ran", file=sys.stderr, flush=True)
    else:
        best_us, best = res.best
        pct = 100 * case.nbytes / best_us / 1e3 / copy_gbs
        extra = f", {case.flops / best_us / 1e6:.1f} TFLOP/s" if case.flops else ""
        print(f"[tune] {case.label}: default {base:.2f} µs, best {best_us:.2f} µs ({pct:.0f}% copy{extra}) {best}",
              file=sys.stderr, flush=True)
    return res


def _table_row(res: CaseResult, copy_gbs: float) -> str:
    base = res.base_us
    if res.best is None:
        return f"{res.label:48} {base:11.2f} {'—':>9} {'—':>7} {'—':>8}  no candidate ran"
    best_us, best = res.best
    pct = f"{100 * res.nbytes / best_us / 1e3 / copy_gbs:.0f}%"
    tflops = f"{res.flops / best_us / 1e6:.1f}" if res.flops else "—"
    return f"{res.label:48} {base:11.2f} {best_us:9.2f} {pct:>7} {tflops:>8}  {best}"


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def paste_ready_table(sw: Sweep, results: list[CaseResult], command: str) -> list[str]:
    """``sw.configs.TABLE`` as Python to paste into the configs module: per table key (each result's
    ``key``, from the bench's ``tune_table_key``), the config with the smallest geometric mean of (µs / that case's best µs)
    over the key's cases, among the configs that ran on all of them. Each entry's comment gives
    the cases, that mean, the worst case's ratio and the default config's mean ratio."""
    configs = sw.configs
    table = getattr(configs, "TABLE", None) or {}
    entry_type = type(next(iter(table.values()))) if table else dict
    groups: dict[object, list[CaseResult]] = {}
    for res in results:
        if res.best is not None and res.key is not None:
            groups.setdefault(res.key, []).append(res)
    lines = [
        f"# paste-ready TABLE for {CONFIG_MODULES.get(sw.key, sw.key)} from the sweep's results "
        f"({time.strftime('%Y-%m-%d')}; command: {command}); per key the config with the smallest geometric mean "
        "of (time / that case's best) over the key's cases",
        f"TABLE: dict[tuple[int, int], {entry_type.__name__}] = {{",
    ]
    for key in sorted(groups, key=lambda k: tuple(reversed(k)) if isinstance(k, tuple) else k):
        cases = groups[key]
        slowdown: dict[str, list[float]] = {}
        for res in cases:
            best_us = res.best[0]
            for us, cand in res.results:
                slowdown.setdefault(json.dumps(cand, sort_keys=True), []).append(us / best_us)
        common = {c: r for c, r in slowdown.items() if len(r) == len(cases)}
        if not common:
            lines.append(f"    # {key!r}: no config ran on all {len(cases)} cases")
            continue
        choice = min(common, key=lambda c: _geomean(common[c]))
        defaults = [res.base_us / res.best[0] for res in cases if math.isfinite(res.base_us)]
        default_text = f"default config {_geomean(defaults):.2f}x" if defaults else "default config failed"
        labels = ", ".join(res.label.split(" ", 1)[-1] for res in cases)  # without the op
        lines.append(f"    {key!r}: {entry_type(**json.loads(choice))!r},  # {len(cases)} cases: "
                     f"{_geomean(common[choice]):.3f}x of each case's best (worst {max(common[choice]):.2f}x), "
                     f"{default_text}; {labels}")
    lines.append("}")
    return lines
