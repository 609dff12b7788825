"""Target ``kernels``: the decode kernels against their peers and the PyTorch reference.

    python -m fastmamba.bench kernels [--ops ssu,conv,norm] [--batch 1,8,64,256] [--quick]
                                      [--json PATH] [--markdown PATH] [--device auto|cuda|cpu]

For every (op, shape, dtypes, batch) case it allocates K rotating input sets (enough for a cold
L2), times each provider on them through the same call, then checks each provider once against
the reference on input set 0. It prints a header, progress on stderr, and a table at the end, and
appends one JSON line per row (row fields plus the header fields) to
``bench_results/kernels-YYYYmmdd-HHMMSS.jsonl`` or ``--json PATH``.

``run_suite`` is that runner for any ``Suite`` (a map of op benches and a title); the ``prefill``
and ``spec`` targets (``fastmamba.bench.prefill``, ``fastmamba.bench.spec``) run their ops through
it too.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from fastmamba.bench import env, report, size_copy
from fastmamba.bench.ops._base import Case, OpBench, Provider, describe
from fastmamba.ops.runtime import interpreter_enabled
from fastmamba.bench.peak import (
    device_name,
    l2_cache_bytes,
    matmul_description,
    measure_copy_bandwidth,
    measure_matmul_tflops,
)
from fastmamba.bench.timing import TimingConfig, choose_n_sets, is_cold_l2, time_calls, time_eager, time_host

OPS = {
    "ssu": "fastmamba.bench.ops.state_update",
    "conv": "fastmamba.bench.ops.conv1d",
    "norm": "fastmamba.bench.ops.gated_rmsnorm",
    "attn": "fastmamba.bench.ops.paged_attention",  # hybrid models' paged decode attention
    "moe": "fastmamba.bench.ops.moe",  # Nemotron-3's router and routed experts (tokens 1-4096 by default)
}
GPU_BATCHES = (1, 8, 64, 256)
CPU_BATCHES = (1, 2)


class Summary(NamedTuple):
    """What a suite's ``summarize`` adds to a run: lines printed after the table (and appended to
    the markdown), and JSON records appended after the rows, each with the header fields; a
    record names its kind in a ``"record"`` key, which rows do not have."""

    lines: list[str]
    records: list[dict]


@dataclass(frozen=True)
class Suite:
    """What one target times with ``run_suite``: its op benches and how its outputs are named."""

    name: str  # the target: default JSON file bench_results/<name>-<time>.jsonl
    title: str  # markdown heading
    ops: Mapping[str, str]  # --ops key -> module with a BENCH
    gpu_batches: tuple[int, ...] = ()  # default --batch (benches whose cases ignore it leave these empty)
    cpu_batches: tuple[int, ...] = ()
    matmul: bool = False  # also measure the bf16 matmul rate (for ops with a FLOP model)
    size_copy: bool = False  # on a GPU, a copy row per case moving the case's bytes (size_copy.py)
    # lines printed after the table (and put in the markdown) and extra JSON records, from the rows
    summarize: Callable[[list[report.Row], argparse.Namespace], Summary] | None = None


KERNELS = Suite("kernels", "fastmamba kernel benchmark", OPS, GPU_BATCHES, CPU_BATCHES, size_copy=True)


# --- command line -------------------------------------------------------------------------------
def ops_list(ops: Mapping[str, str]) -> Callable[[str], list[str]]:
    """An argparse ``type`` for a comma-separated subset of ``ops``' keys."""

    def parse(text: str) -> list[str]:
        names = [t.strip() for t in text.split(",") if t.strip()]
        bad = [n for n in names if n not in ops]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown op(s) {', '.join(bad) or '(none)'}; choose from {','.join(ops)}")
        return list(dict.fromkeys(names))

    return parse


_ops_list = ops_list(OPS)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", type=_ops_list, default=[k for k in OPS if k != "moe"],  # moe: when named
                        help=f"comma-separated subset of {','.join(OPS)} (default: all but moe)")
    parser.add_argument(
        "--batch",
        type=_int_list,
        default=None,
        help=f"batch sizes (rows for norm); default {','.join(map(str, GPU_BATCHES))} on a GPU, "
        f"{','.join(map(str, CPU_BATCHES))} on the CPU",
    )
    add_device_arguments(parser, KERNELS.name)


def add_device_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """--device, --quick, --json, --markdown: shared by every target built on ``run_suite``."""
    parser.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="auto: CUDA when present, else the CPU (small shapes; Triton interpreter if TRITON_INTERPRET=1)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (shorter, noisier)")
    parser.add_argument(
        "--eager",
        action="store_true",
        help="also time every provider without a CUDA graph (host time included, L2 flushed: what a direct "
        "caller of the op pays) and its host time per call; adds the 'eager µs', 'host µs' and 'eager vs peer' "
        "columns (GPU only)",
    )
    parser.add_argument("--json", metavar="PATH", help=f"JSON-lines file to append to (default bench_results/{name}-<time>.jsonl)")
    parser.add_argument("--markdown", metavar="PATH", help="also write the table as markdown here")


# --- the run ------------------------------------------------------------------------------------
def load_benches(keys: Sequence[str], ops: Mapping[str, str] = OPS) -> list[OpBench]:
    return [importlib.import_module(ops[k]).BENCH for k in keys]


def _timing_method(device: torch.device, configs: Sequence[TimingConfig]) -> str:
    if device.type == "cuda":
        min_calls = "/".join(str(n) for n in sorted({c.min_calls for c in configs})) or "?"
        return (
            "median of CUDA-graph replays (triton.testing.do_bench, quantiles 0.2/0.5/0.8, L2 flushed between "
            f"replays); each graph holds >= {min_calls} calls cycling over K rotating input sets "
            "(column `sets`), K = clamp(ceil(3 x L2 / bytes per call), 2, 64), so every call reads cold "
            "(rows marked 'L2' are not); per-call time = replay time / calls; 'eager' rows are timed without a "
            "graph, launch overhead included"
        )
    what = (
        "Triton interpreter on the CPU (TRITON_INTERPRET=1)"
        if interpreter_enabled()
        else "TRITON_INTERPRET is off, so the PyTorch reference ran on the CPU (fastmamba ops dispatch to it)"
    )
    reps = "/".join(str(n) for n in sorted({c.cpu_reps for c in configs})) or "?"
    return f"no GPU: {what} — correctness demo, timings are not speed (wall-clock median of {reps} passes)"


def header_lines(
    header: dict,
    providers: dict[str, list[Provider]],
    oracles: dict[str, Provider | None] | None = None,
    notes: Sequence[str] = (),
) -> list[str]:
    """The report's header. ``oracles`` by op key: a check oracle that is not one of the timed
    providers gets its own line; ``notes`` are the benches' descriptions of their cases."""
    dev = header["device"]
    if "gpu_sms" in header:
        dev += (
            f" ({header['gpu_sms']} SMs, {header['gpu_memory_gib']} GiB, sm_{header['compute_capability'].replace('.', '')},"
            f" driver {header.get('driver') or '?'}, CUDA {header.get('cuda') or '?'})"
        )
    copy_what = "2 GiB device-to-device copy" if "gpu_sms" in header else "64 MiB host copy"
    lines = [
        f"device: {dev}",
        f"copy bandwidth: {header['copy_gbps']:.0f} GB/s ({copy_what}, bytes read + written; '% copy' is relative to this)",
    ]
    if "matmul_tflops" in header:
        lines.append(
            f"matmul: {header['matmul_tflops']:.1f} TFLOP/s ({header['matmul_what']}, median; '% mm' is relative to this)"
        )
    lines += [
        f"L2: {header['l2_bytes'] / (1 << 20):.1f} MiB" if header["l2_bytes"] else "L2: n/a (CPU)",
        f"torch {header['torch']}, triton {header['triton']}, python {header['python']}, fastmamba {header['fastmamba']}, "
        f"git {header['git_commit'] or 'unknown'}",
        f"date: {header['date']}",
        f"command: {header['command']}",
        f"timing: {header['timing_method']}",
        "GB/s counts the minimum bytes (fastmamba/bench/bytes.py): state rows touched read + written once, inputs "
        "read once, outputs written once, stride-0 operands once",
    ]
    lines += list(notes)
    for key, provs in providers.items():
        parts = []
        for p in provs:
            where = f" [{p.source}]" if p.source else ""
            if p.available:
                parts.append(f"{p.name} {p.version}{where}" + (f" ({p.note})" if p.note else ""))
            else:
                parts.append(f"{p.name} {p.version}: unavailable: {p.reason}{where}")
        lines.append(f"providers [{key}]: " + "; ".join(parts))
        oracle = (oracles or {}).get(key)
        if oracle is not None and not any(p is oracle for p in provs):
            what = f"{oracle.name} ({oracle.note})" if oracle.note else oracle.name
            lines.append(f"check [{key}]: against {what}" if oracle.available else f"check [{key}]: unavailable: {oracle.reason}")
    return lines


def _cuda_alive() -> bool:
    try:
        torch.cuda.synchronize()
        torch.empty(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001
        return False


def _base_row(bench: OpBench, case: Case, prov: Provider) -> report.Row:
    nbytes = bench.provider_bytes(prov, case)
    return report.Row(
        op=case.op,
        title=bench.title,
        shape=case.shape,
        dims=case.dims,
        dtype=case.dtype,
        batch=case.batch,
        provider=prov.name,
        kind=prov.kind,
        version=prov.version,
        bytes=nbytes,
        flops=case.flops,
        params=dict(case.params),
        case_id=id(case),
    )


def _fill_ratios(rows: list[report.Row]) -> None:
    """On fastmamba rows: best peer's median / ours (e.g. '1.45x mamba_ssm'); the reference if no peer ran."""
    by_case: dict[int, list[report.Row]] = {}
    for r in rows:
        by_case.setdefault(r.case_id, []).append(r)
    for group in by_case.values():
        timed = [r for r in group if r.status == "ok" and r.median_us and not r.check.startswith("FAIL")]
        timed = [r for r in timed if r.mode != "cpu"]  # interpreter and wall-clock times are no speed
        ours = [r for r in timed if r.kind == "ours"]
        if not ours:
            continue
        peers = [r for r in timed if r.kind == "peer"] or [r for r in timed if r.kind == "ref"]
        if not peers:
            continue
        best = min(peers, key=lambda r: r.median_us)
        for r in ours:
            r.vs_ratio = best.median_us / r.median_us
            r.vs = f"{r.vs_ratio:.2f}x {best.provider}"
        eager_peers = [r for r in peers if r.eager_us]
        if eager_peers:
            best_eager = min(eager_peers, key=lambda r: r.eager_us)
            for r in ours:
                if r.eager_us:
                    r.eager_vs = f"{best_eager.eager_us / r.eager_us:.2f}x {best_eager.provider}"


def run(args: argparse.Namespace, command: str) -> int:
    return run_suite(KERNELS, args, command)


def run_suite(suite: Suite, args: argparse.Namespace, command: str) -> int:
    """Time and check ``args.ops`` of ``suite``; print the header and table, write JSON (and markdown).

    ``args`` carries ops, device, quick, json, markdown, and optionally batch and oracle.
    Returns the exit status: 1 if a check failed, a provider errored or the run stopped early.
    """
    t_start = time.perf_counter()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    cuda = device.type == "cuda"
    batches = getattr(args, "batch", None) or list(suite.gpu_batches if cuda else suite.cpu_batches)
    json_path = args.json or time.strftime(f"bench_results/{suite.name}-%Y%m%d-%H%M%S.jsonl")

    def progress(msg: str, end: str = "\n") -> None:
        print(msg, end=end, file=sys.stderr, flush=True)

    benches = [b.configure(args) for b in load_benches(args.ops, suite.ops)]
    configs = {b.key: (b.quick_timing if args.quick else b.timing) for b in benches}
    oracle_mode = getattr(args, "oracle", "auto")
    plan = []
    for b in benches:
        provs = b.providers(device)
        if suite.size_copy and cuda:
            provs = [*provs, *size_copy.copy_providers(device)]
        plan.append((b, provs, b.oracle(device, provs, oracle_mode), b.cases(device, batches)))

    progress(f"measuring copy bandwidth on {device_name(device)} ...")
    header = env.collect(device, command)
    header["copy_gbps"] = measure_copy_bandwidth(device)
    if suite.matmul and any(c.flops for _, _, _, cases in plan for c in cases):
        progress("measuring the matmul rate ...")
        header["matmul_tflops"] = measure_matmul_tflops(device)
        header["matmul_what"] = matmul_description(device)
    header["l2_bytes"] = l2_cache_bytes(device)
    header["timing_method"] = _timing_method(device, list(configs.values()))
    header["quick"] = bool(args.quick)
    notes = [n for b in benches for n in b.header_notes(device)]
    if suite.size_copy and cuda:
        notes.append(size_copy.HEADER_NOTE)
    lines = header_lines(header, {b.key: provs for b, provs, _, _ in plan}, {b.key: o for b, _, o, _ in plan}, notes)
    print("\n".join(lines), flush=True)
    print(flush=True)

    total = sum(len(provs) * len(cases) for _, provs, _, cases in plan)
    rows: list[report.Row] = []
    fatal = ""
    k = 0
    try:
        for bench, provs, oracle, cases in plan:
            config = configs[bench.key]
            for case in cases:
                n_sets = choose_n_sets(case.nbytes, header["l2_bytes"]) if cuda else 1
                sets, set_error = None, ""
                if not fatal and any(p.available for p in provs):
                    try:
                        sets = [bench.make_set(case, device, seed=i) for i in range(n_sets)]
                    except Exception as exc:  # noqa: BLE001 - e.g. out of memory: this case only
                        set_error = f"could not allocate inputs: {describe(exc)}"
                for prov in provs:
                    k += 1
                    row = _base_row(bench, case, prov)
                    rows.append(row)
                    if fatal:
                        row.status, row.note = "not run", fatal
                        continue
                    skip = prov.reason if not prov.available else bench.skip_reason(prov, case)
                    if skip:
                        row.status, row.note = "skipped", skip
                        progress(f"[{k}/{total}] {case.label} {prov.name}: skipped ({skip})")
                        continue
                    if sets is None:
                        row.status, row.note = "error", set_error
                        progress(f"[{k}/{total}] {case.label} {prov.name}: {set_error}")
                        continue
                    progress(f"[{k}/{total}] {case.label} {prov.name}", end="")
                    row.status = "not run"  # until it has a time (an interrupt may land mid-way)
                    fatal = _run_one(bench, case, prov, oracle, sets, n_sets, device, config, header, row,
                                     eager=bool(getattr(args, "eager", False)))
                    if row.status == "ok":
                        progress(f" -> {report.format_us(row.median_us)} µs ({row.mode}) {row.check}")
                    else:
                        progress(f" -> {row.status}: {row.note}")
                del sets
                gc.collect()
                if cuda and not fatal:
                    torch.cuda.empty_cache()
    except KeyboardInterrupt:
        progress("interrupted: writing the rows measured so far")
    finally:
        _fill_ratios(rows)
        size_copy.fill_size_copy(rows)
        row_notes = report.collect_notes(rows)
        table = report.format_table(rows)
        print(table)
        if row_notes:
            print("\nNotes:\n" + "\n".join(f"- {n}" for n in row_notes))
        summary = Summary([], [])
        if suite.summarize:
            try:
                summary = suite.summarize(rows, args)
            except Exception as exc:  # noqa: BLE001 - the rows are still worth writing
                summary = Summary([f"summary failed: {describe(exc)}"], [])
                fatal = fatal or f"summary failed: {describe(exc)}"
        if summary.lines:
            print("\n" + "\n".join(summary.lines))
        n_ok = sum(r.status == "ok" for r in rows)
        n_fail = sum(r.check.startswith("FAIL") for r in rows)
        n_err = sum(r.status == "error" for r in rows)
        n_skip = sum(r.status in ("skipped", "not run") for r in rows)
        report.write_jsonl(json_path, rows, header)
        report.write_records(json_path, summary.records, header)
        written = [json_path]
        if args.markdown:
            text = report.format_markdown(rows, lines, row_notes, title=suite.title)
            if summary.lines:
                text += "\n" + "\n".join(summary.lines) + "\n"
            report.write_text(args.markdown, text)
            written.append(args.markdown)
        print(
            f"\n{len(rows)} rows: {n_ok} timed, {n_fail} FAIL, {n_err} errors, {n_skip} skipped; "
            f"{time.perf_counter() - t_start:.0f} s; wrote {', '.join(written)}"
        )
        if fatal:
            print(f"stopped early: {fatal}")
    return 1 if (n_fail or n_err or fatal) else 0


def _run_one(
    bench: OpBench,
    case: Case,
    prov: Provider,
    ref: Provider | None,
    sets: list[dict],
    n_sets: int,
    device: torch.device,
    config: TimingConfig,
    header: dict,
    row: report.Row,
    *,
    eager: bool = False,
) -> str:
    """Time and check one provider on one case, filling ``row``; ``ref`` is the check's oracle.
    With ``eager`` (CUDA only) the provider is also timed without a graph and its host time per
    call measured (``row.eager_us``, ``row.host_us``). Returns a fatal reason or ''."""
    try:
        if prov.kind == size_copy.KIND:  # its own buffers, as many sets as the op's
            make_call = size_copy.copy_calls(bench.provider_bytes(prov, case), n_sets, device,
                                             pdl=prov.name.endswith(size_copy.PDL))
        else:
            def make_call(i: int):
                return bench.bind(prov, case, sets[i])
        t = time_calls(
            make_call,
            n_sets,
            device=device,
            config=config,
            preflight_sync=prov.preflight_sync,
        )
        if eager and device.type == "cuda" and prov.kind in ("ours", "peer"):  # not the reference's loops
            row.eager_us = t.median_us if t.mode == "eager" else time_eager(make_call, n_sets, config).median_us
            row.host_us = time_host(make_call, n_sets, calls=config.host_calls)
    except Exception as exc:  # noqa: BLE001 - a failing provider is a row, not the end of the run
        row.status, row.note = "error", describe(exc)
        if device.type == "cuda" and not _cuda_alive():
            return f"CUDA context lost during {case.label} {prov.name}: {describe(exc)}"
        return ""
    row.status = "ok"
    row.mode, row.calls, row.n_sets = t.mode, t.calls, t.n_sets
    row.median_us, row.p20_us, row.p80_us = t.median_us, t.p20_us, t.p80_us
    row.gbps = row.bytes / (t.median_us * 1e-6) / 1e9
    row.pct_copy = 100.0 * row.gbps / header["copy_gbps"] if header["copy_gbps"] else None
    if case.flops:
        row.tflops = case.flops / (t.median_us * 1e-6) / 1e12
        rate = header.get("matmul_tflops")
        row.pct_matmul = 100.0 * row.tflops / rate if rate else None
    row.cold_l2 = is_cold_l2(row.bytes, t.n_sets, header["l2_bytes"], t.calls) if device.type == "cuda" else None
    row.note = "; ".join(n for n in (prov.note, bench.row_note(prov, case), t.note) if n)
    if prov is ref:
        row.check = "ref"
    elif prov.kind == size_copy.KIND:
        row.check = "same-size copy"
    elif ref is None or not ref.available:
        row.check = "no ref"
    else:
        try:
            row.check = bench.check(prov, ref, case, sets[0])
        except Exception as exc:  # noqa: BLE001
            row.check = f"FAIL check crashed: {describe(exc)}"
        if device.type == "cuda" and not _cuda_alive():
            return f"CUDA context lost while checking {case.label} {prov.name}"
    return ""
