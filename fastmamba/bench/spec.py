"""Target ``spec``: speculative verification kernels side by side, and the batch-adaptive choice.

    python -m fastmamba.bench spec [--shapes nemotron-h,nemotron-h-tp8] [--tokens 2,4,6,8,16]
                                   [--batch 1,8,32,128,256] [--state fp32,fp16] [--providers ...]
                                   [--accept-rate 0.6] [--write-table [PATH]]
                                   [--quick] [--json PATH] [--markdown PATH] [--device auto|cuda|cpu]

Re-measure the verify-path crossover table on this GPU and merge it into the package's table file
(fastmamba/generation/verify_crossover.json, which ``Engine(verify_table=None)`` reads):

    python -m fastmamba.bench spec --shapes mamba2-2.7b,nemotron-h --tokens 2,4,6,8,16 --state fp32,fp16 --write-table

For T = K+1 tokens per step (default 2, 4, 6, 8, 16), the Nemotron-H (H128 P64 N128 G8) and
Nemotron-H TP=8 slice (H16 P64 N128 G1) shapes (``--shapes`` also takes mamba2-2.7b, H80 P64 N128
G1), fp32 and fp16 state, bf16 activations, batch 1, 8, 32, 128, 256, accepted counts drawn at
random (uniform in 1..T per request): ``replay`` (replay_selective_state_update + its commit, the
cache evolving through its steady state), ``legacy`` (multi-token selective_state_update writing T
states + the copy of the accepted one), ``legacy-no-copy`` and ``plain`` (single-token decode: a
step with nothing drafted). See fastmamba/bench/ops/spec_verify.py for the inputs, the byte models
and the check.

The runner is the ``kernels`` target's (``fastmamba.bench.kernels.run_suite``): rotating input
sets, CUDA-graph replays, one check per provider. After the table:

- the batch-adaptive choice: per (shape, state dtype, T) the smallest batch from which replay beats
  legacy (with its copy) at every larger measured batch, and whether plain decode is cheaper per
  token at batch 1 than the path ``choose_verify_path`` picks, given ``--accept-rate`` (expected
  tokens per step sum_{i=0..K} rate^i; SSM-kernel time only: the drafter and the rest of the model
  are not in it). The same goes into the JSON file as ``"record": "spec_choice"`` lines, and per
  (shape, state dtype) a ``"spec_crossover"`` line whose ``table`` is what
  ``fastmamba.generation.spec_policy.choose_verify_path`` takes.
- issue 5's acceptance lines, per (shape, state dtype) (JSON ``"record": "spec_acceptance"``):
  legacy / replay at batch 128, T=6 (target >= 3x); replay at T=16 / T=2, batch 128 (target
  <= 1.5x; flashinfer's checkpointing_ssu: 2.0x); at batch 1, whether the adaptive choice as
  shipped (``spec_policy.lookup_table`` for the shape, as the engine finds it) is never slower than legacy;
  and, for Nemotron-H, our
  batch-128 T=6 time beside flashinfer's (PEERS.md, measured on an H200: compared only when this
  run's GPU is an H200 too).

``--write-table [PATH]`` (crossover mode): times replay and legacy only (``--providers`` to
change), at batch 1, 2, 4, 8, 16, 32 (``TABLE_BATCHES``; ``--batch`` to change: the crossover
sits at small batches, and replay led legacy 2.7-10x from batch 32 up on every measured shape),
with a shorter timing (``TABLE_TIMING``: 50 replays or 50 ms, at most 300 ms per row; ``--quick``
shorter still), then, if every row was timed and checked, merges one row per (shape, state dtype,
T) with this run's GPU, date, commit and command into the table file: PATH, or without one the
package's file (``fastmamba.generation.spec_policy``: rows of the same GPU and key are replaced).
Work for the command above: 2 shapes x 2 state dtypes x 5 T x 6 batches = 120 cases x 2
providers = 240 timed rows (+ one check each), about 0.2-0.8 s a row with the Triton compiles
(estimated, not yet timed: well under 4 minutes on an H100). Interpreter (CPU) times are no
measurement: the package's file refuses them (a PATH takes them, marked ``timing_mode: cpu``).
This lives in ``bench spec`` rather than ``bench tune``: the crossover needs both paths timed and
checked on the same input sets, which is what this target does; ``tune`` sweeps one kernel's
launch configs.

Without a GPU: a tiny shape through the Triton interpreter (plumbing, not speed).
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

import torch

from fastmamba.bench import env, report
from fastmamba.bench.kernels import Suite, Summary, _int_list, add_device_arguments, run_suite
from fastmamba.bench.ops import spec_verify
from fastmamba.bench.ops.spec_verify import LEGACY, LEGACY_NO_COPY, PLAIN, PROVIDERS, REPLAY
from fastmamba.bench.timing import TimingConfig
from fastmamba.generation import spec_policy
from fastmamba.generation.spec_policy import choose_verify_path, expected_tokens_per_step, lookup_table

OPS = {"spec": "fastmamba.bench.ops.spec_verify"}
ACCEPT_RATE = 0.6

# issue 5's targets ("Done when")
TARGET_BATCH, TARGET_T = 128, 6
TARGET_LEGACY_OVER_REPLAY = 3.0  # replay >= 3x faster than legacy (state writes + copy) at batch 128, T=6
FLAT_T = (2, 16)  # replay at T=16 within 1.5x of T=2 at batch 128
TARGET_FLAT = 1.5
# flashinfer 0.7.2 checkpointing_ssu, best algorithm (/work/shared/PEERS.md), measured on an NVIDIA
# H200: Nemotron-H, batch 128, T=6, per state dtype, in µs; its T=16 / T=2 ratio at batch 128, fp32
FLASHINFER_GPU = "H200"
FLASHINFER_SHAPE = "nemotron-h"
FLASHINFER_US = {"fp32": 246.0, "fp16": 165.0}
FLASHINFER_FLAT = 2.0

# --write-table: what the crossover needs, and no more (see the module docstring)
TABLE_BATCHES = (1, 2, 4, 8, 16, 32)
TABLE_PROVIDERS = (REPLAY, LEGACY)
TABLE_TIMING = TimingConfig(warmup_ms=10.0, rep_ms=50.0, min_reps=50, max_rep_ms=300.0)


def _tokens_list(text: str) -> list[int]:
    values = _int_list(text)
    if any(v < 2 for v in values):
        raise argparse.ArgumentTypeError(f"T = K+1 tokens per step must be >= 2 (at least one draft), got {text!r}")
    return list(dict.fromkeys(values))


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def _shapes_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in spec_verify.SHAPES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown shape(s) {', '.join(bad) or '(none)'}; choose from {','.join(spec_verify.SHAPES)}")
    return list(dict.fromkeys(names))


def _names_list(choices: tuple[str, ...], what: str):
    def parse(text: str) -> list[str]:
        names = [t.strip() for t in text.split(",") if t.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad) or '(none)'}; choose from {','.join(choices)}")
        return list(dict.fromkeys(names))

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", type=_shapes_list, default=None,
                        help=f"comma-separated subset of {','.join(spec_verify.SHAPES)}; default "
                        f"{','.join(spec_verify.DEFAULT_SHAPES)} on a GPU, tiny on the CPU")
    parser.add_argument("--tokens", type=_tokens_list, default=None,
                        help="T = K+1 tokens verified per step, comma-separated; default "
                        f"{','.join(map(str, spec_verify.GPU_TOKENS))} on a GPU, "
                        f"{','.join(map(str, spec_verify.CPU_TOKENS))} on the CPU")
    parser.add_argument(
        "--batch",
        type=_int_list,
        default=None,
        help=f"batch sizes; default {','.join(map(str, spec_verify.GPU_BATCHES))} on a GPU, "
        f"{','.join(map(str, spec_verify.CPU_BATCHES))} on the CPU",
    )
    parser.add_argument("--state", type=_names_list(tuple(spec_verify.STATE_NAMES), "state dtype(s)"), default=None,
                        help="SSM state dtypes, comma-separated subset of "
                        f"{','.join(spec_verify.STATE_NAMES)} (default fp32,fp16)")
    parser.add_argument("--providers", type=_names_list(PROVIDERS, "provider(s)"), default=None,
                        help=f"comma-separated subset of {','.join(PROVIDERS)} (default: all; with --write-table "
                        f"{','.join(TABLE_PROVIDERS)})")
    parser.add_argument("--write-table", nargs="?", const="", default=None, metavar="PATH",
                        help="crossover mode: time replay and legacy at batch "
                        f"{','.join(map(str, TABLE_BATCHES))} and merge the crossover per (shape, state dtype, T) "
                        "into the table file PATH (default: the package's, which the engine reads)")
    parser.add_argument("--accept-rate", type=_rate, default=ACCEPT_RATE,
                        help=f"per-draft acceptance rate for the batch-1 plain-vs-speculative line (default {ACCEPT_RATE})")
    parser.set_defaults(ops=list(OPS))
    add_device_arguments(parser, "spec")


# --- the batch-adaptive choice ------------------------------------------------------------------
def _usable(row: report.Row) -> bool:
    return row.status == "ok" and row.median_us is not None and not row.check.startswith("FAIL")


def _dims(dims: str) -> dict[str, int]:
    """{"H": .., "P": .., "N": .., "G": ..} from a case's dims ("H128 P64 N128 G8 T6"); absent letters left out."""
    return {k: int(v) for k, v in re.findall(r"\b([HPNG])(\d+)\b", dims)}


def _ratio_text(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def summarize(rows: list[report.Row], args: argparse.Namespace) -> Summary:
    """The batch-adaptive choice from the measured rows (see the module docstring)."""
    rate = getattr(args, "accept_rate", ACCEPT_RATE)
    times: dict[tuple[str, str, str, int], dict[int, dict[str, float]]] = {}
    modes: set[str] = set()
    for r in rows:
        if r.op != "spec" or not _usable(r):
            continue
        key = (r.shape, r.dims, r.dtype, int(r.params["T"]))
        times.setdefault(key, {}).setdefault(r.batch, {})[r.provider] = r.median_us
        modes.add(r.mode)
    if not times:
        return Summary(["Batch-adaptive choice: no usable rows"], [])

    records: list[dict] = []
    tables: dict[tuple[str, str], dict[int, int | None]] = {}
    body: list[list[str]] = []
    for (shape, dims, dtype, T), by_batch in times.items():  # in the order of the cases
        batches = sorted(by_batch)
        both = [b for b in batches if REPLAY in by_batch[b] and LEGACY in by_batch[b]]
        wins = {b: by_batch[b][REPLAY] < by_batch[b][LEGACY] for b in both}
        # smallest batch from which replay wins at every larger measured batch
        crossover = None
        for b in reversed(both):
            if not wins[b]:
                break
            crossover = b
        state = dtype.split("/")[0]
        tables.setdefault((shape, state), {})[T] = crossover
        ratio = {b: by_batch[b][LEGACY] / by_batch[b][REPLAY] for b in both}
        ratio_nc = {b: by_batch[b][LEGACY_NO_COPY] / by_batch[b][REPLAY]
                    for b in batches if REPLAY in by_batch[b] and LEGACY_NO_COPY in by_batch[b]}

        expected = expected_tokens_per_step(T, rate)
        b1 = batches[0]
        path = choose_verify_path(b1, T, {T: crossover})
        spec_us = by_batch[b1].get(path)
        plain_us = by_batch[b1].get(PLAIN)
        plain_cheaper = None if spec_us is None or plain_us is None else plain_us < spec_us / expected
        if plain_cheaper is None:
            verdict = "— (missing rows)"
        else:
            verdict = (f"plain {report.format_us(plain_us)} vs {path} {report.format_us(spec_us)}/{expected:.2f} = "
                       f"{report.format_us(spec_us / expected)} µs/token -> {'plain' if plain_cheaper else path}")
        body.append([
            shape, state, str(T),
            f"B>={crossover}" if crossover is not None else "never",
            " ".join(f"{b}:{_ratio_text(ratio.get(b))}" for b in batches),
            " ".join(f"{b}:{_ratio_text(ratio_nc.get(b))}" for b in batches),
            f"B={b1}: {verdict}",
        ])
        d = _dims(dims)
        records.append(dict(
            record="spec_choice", shape=shape, dims=dims, dtype=dtype, state_dtype=state, tokens=T,
            heads=d.get("H"), head_dim=d.get("P"), state_size=d.get("N"), groups=d.get("G"), batches=both,
            crossover_batch=crossover, legacy_over_replay=ratio, legacy_no_copy_over_replay=ratio_nc,
            accept_rate=rate, expected_tokens_per_step=expected, batch1=dict(
                batch=b1, path=path, spec_us=spec_us, plain_us=plain_us,
                spec_us_per_token=None if spec_us is None else spec_us / expected,
                plain_cheaper=plain_cheaper,
            ),
        ))
    for (shape, state), table in tables.items():
        records.append(dict(record="spec_crossover", shape=shape, state_dtype=state, table=table))

    heads = ["shape", "state", "T", "replay beats legacy", "legacy/replay by batch", "legacy-no-copy/replay",
             "per token at the smallest batch"]
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(heads)]
    lines = [
        f"Batch-adaptive choice (fastmamba.generation.spec_policy.choose_verify_path), accept rate {rate:g}: "
        f"expected tokens per step = sum_(i=0..K) {rate:g}^i; per-token times count the SSM verification kernel only",
    ]
    if modes & {"cpu"}:
        lines.append("(no GPU: interpreter wall-clock times, so the choice below shows the plumbing, not a measurement)")
    lines += ["  ".join(h.ljust(w) for h, w in zip(heads, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in body]
    lines.append("crossover tables for choose_verify_path (T -> batch; None: legacy at every batch): " + "; ".join(
        f"{shape} {state} {table}" for (shape, state), table in tables.items()))
    more_lines, more_records = acceptance(times, modes, getattr(args, "device_name", None))
    return Summary(lines + [""] + more_lines, records + more_records)


# --- issue 5's acceptance lines -----------------------------------------------------------------
def _device_label(modes: set[str], given: str | None) -> str:
    if given:
        return given
    if not modes or modes & {"cpu"}:
        return "CPU (no CUDA device)"
    try:
        import torch

        return torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001
        return "unknown GPU"


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("PASS" if ok else "FAIL")


def acceptance(times: dict, modes: set[str], device: str | None = None) -> tuple[list[str], list[dict]]:
    """Issue 5's "Done when" lines from ``summarize``'s ``times`` ((shape, dims, dtype, T) -> batch ->
    provider -> median µs): per (shape, state dtype), in the order of the cases."""
    device = _device_label(modes, device)
    same_gpu = FLASHINFER_GPU.lower() in device.lower()
    by_shape: dict[tuple[str, str], dict[int, dict[int, dict[str, float]]]] = {}
    dims_of: dict[str, dict[str, int]] = {}
    for (shape, dims, dtype, T), by_batch in times.items():
        by_shape.setdefault((shape, dtype.split("/")[0]), {})[T] = by_batch
        dims_of[shape] = _dims(dims)

    def us(at: dict, T: int, batch: int, provider: str) -> float | None:
        return at.get(T, {}).get(batch, {}).get(provider)

    lines = [f"Issue 5 acceptance on {device} (medians of this run; replay = op + commit, legacy = states + copy):"]
    if not modes or modes & {"cpu"}:
        lines.append("(no GPU: interpreter wall-clock times, so the verdicts below show the plumbing, not a measurement)")
    records = []
    for (shape, state), at in by_shape.items():
        name = f"  {shape} {state}:"
        rec: dict = dict(record="spec_acceptance", shape=shape, state_dtype=state, device_name=device)

        # 1. legacy / replay at batch 128, T=6
        leg, rep = us(at, TARGET_T, TARGET_BATCH, LEGACY), us(at, TARGET_T, TARGET_BATCH, REPLAY)
        ratio = leg / rep if leg is not None and rep is not None else None
        ok = None if ratio is None else ratio >= TARGET_LEGACY_OVER_REPLAY
        rec.update(legacy_us=leg, replay_us=rep, legacy_over_replay=ratio, legacy_over_replay_ok=ok)
        lines.append(f"{name} legacy/replay at B={TARGET_BATCH} T={TARGET_T}: "
                     + (f"{report.format_us(leg)} / {report.format_us(rep)} µs = {ratio:.2f}x" if ratio else "—")
                     + f" (target >= {TARGET_LEGACY_OVER_REPLAY:g}x): {_verdict(ok)}")

        # 2. replay T=16 / T=2 at batch 128
        lo, hi = (us(at, T, TARGET_BATCH, REPLAY) for T in FLAT_T)
        flat = hi / lo if lo is not None and hi is not None else None
        ok = None if flat is None else flat <= TARGET_FLAT
        rec.update(replay_t2_us=lo, replay_t16_us=hi, t16_over_t2=flat, t16_over_t2_ok=ok)
        lines.append(f"{name} replay T={FLAT_T[1]} / T={FLAT_T[0]} at B={TARGET_BATCH}: "
                     + (f"{report.format_us(hi)} / {report.format_us(lo)} µs = {flat:.2f}x" if flat else "—")
                     + f" (target <= {TARGET_FLAT:g}x; flashinfer {FLASHINFER_FLAT:.1f}x on an {FLASHINFER_GPU}): "
                     + _verdict(ok))

        # 3. batch 1: the shipped adaptive choice (the table file's entry for this shape, as the
        # engine looks it up on this GPU) is never slower than legacy
        per_t, parts = {}, []
        d = dims_of[shape]
        entry = lookup_table(d.get("H", 1), d.get("P", 1), d.get("N", 1), state, device_name=device)
        table = entry.table
        for T in sorted(at):
            path = choose_verify_path(1, T, table)
            mine, legacy = us(at, T, 1, path), us(at, T, 1, LEGACY)
            fine = None if mine is None or legacy is None else mine <= legacy
            per_t[T] = dict(path=path, path_us=mine, legacy_us=legacy, ok=fine)
            other = (f"replay {report.format_us(us(at, T, 1, REPLAY))}" if path == LEGACY
                     else f"legacy {report.format_us(legacy)}")
            parts.append(f"T={T} {path} {report.format_us(mine)} (vs {other})" + (" SLOWER" if fine is False else ""))
        known = [v["ok"] for v in per_t.values() if v["ok"] is not None]
        ok = None if not known else all(known)
        rec.update(batch1=per_t, batch1_ok=ok, batch1_table=entry.describe())
        lines.append(f"{name} B=1, adaptive choice (spec_policy.lookup_table) never slower than legacy: "
                     + "; ".join(parts) + f": {_verdict(ok)}")

        # 4. flashinfer's checkpointing_ssu (Nemotron-H, batch 128, T=6), measured on an H200
        if shape == FLASHINFER_SHAPE and state in FLASHINFER_US:
            theirs = FLASHINFER_US[state]
            rec.update(flashinfer_us=theirs, flashinfer_gpu=FLASHINFER_GPU, flashinfer_comparable=same_gpu,
                       flashinfer_over_replay=theirs / rep if rep and same_gpu else None)
            text = (f"{name} flashinfer checkpointing_ssu at B={TARGET_BATCH} T={TARGET_T}: {theirs:g} µs "
                    f"(PEERS.md, measured on an NVIDIA {FLASHINFER_GPU}); ours {report.format_us(rep)} µs on {device}")
            if rep is None:
                text += ": not measured"
            elif same_gpu:
                text += f" -> {theirs / rep:.2f}x flashinfer (same GPU): {_verdict(rep < theirs)}"
            else:
                text += f" -> not comparable (different GPU; compare only on an {FLASHINFER_GPU})"
            lines.append(text)
        records.append(rec)
    return lines, records


SPEC = Suite("spec", "fastmamba speculative verification benchmark", OPS, spec_verify.GPU_BATCHES,
             spec_verify.CPU_BATCHES, summarize=summarize)


# --- --write-table -------------------------------------------------------------------------------
def table_rows(records: list[dict]) -> list[dict]:
    """The table file's rows (``spec_policy``'s format) from ``summarize``'s ``spec_choice`` records:
    one per (shape, state dtype, T) where replay and legacy were both timed at some batch."""
    rows = []
    for r in records:
        if r.get("record") != "spec_choice" or not r.get("batches"):
            continue  # no batch with both paths timed: no crossover to report (None would mean "legacy always")
        missing = [k for k in ("heads", "head_dim", "state_size") if not r.get(k)]
        if missing:
            raise ValueError(f"bench spec --write-table: case {r.get('shape')} {r.get('dims')!r} has no {missing}")
        rows.append(dict(heads=r["heads"], head_dim=r["head_dim"], state_size=r["state_size"],
                         state_dtype=r["state_dtype"], tokens=r["tokens"], crossover_batch=r["crossover_batch"],
                         batches=list(r["batches"]), shape=r["shape"], groups=r.get("groups")))
    return rows


def write_crossover_table(records: list[dict], header: dict, modes: set[str], path: str | Path | None = None) -> Path:
    """Merge this run's crossover rows (``table_rows(records)``) with the run's provenance
    (``header``: device, date, git_commit, command, torch, triton) into the table file at ``path``
    (None: the package's). ``modes``: the timing modes of the rows; CPU (interpreter wall-clock)
    times never go into the package's file."""
    rows = table_rows(records)
    if not rows:
        raise ValueError("bench spec --write-table: no (shape, state dtype, T) has both replay and legacy timed")
    if "cpu" in modes and path is None:
        raise ValueError("bench spec --write-table: CPU (interpreter) times are no measurement; the package's table "
                         "file takes GPU runs only (give a PATH to write them elsewhere)")
    timed = "CUDA-graph medians" if modes <= {"graph"} else f"timing modes {','.join(sorted(modes))}"
    new = spec_policy.new_set(
        rows, gpu=header["device"], commit=header.get("git_commit") or "unknown", command=header["command"],
        date=header.get("date"), torch=header.get("torch"), triton=header.get("triton"),
        timing_mode=",".join(sorted(modes)),
        note=f"bench spec --write-table: replay = op + commit, legacy = per-position states + copy; {timed}")
    return spec_policy.write_table(new, path)


def _use_cuda(args: argparse.Namespace) -> bool:
    return args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())


def run(args: argparse.Namespace, command: str) -> int:
    if getattr(args, "write_table", None) is None:
        return run_suite(SPEC, args, command)
    # crossover mode: the providers, batches and timing the table needs (the module docstring)
    cuda = _use_cuda(args)
    path = Path(args.write_table) if args.write_table else None
    if path is None and not cuda:
        print("error: bench spec --write-table: no GPU, and CPU (interpreter) times are no measurement; the "
              "package's table file takes GPU runs only (give a PATH to write them elsewhere)", file=sys.stderr)
        return 2
    args.batch = args.batch or list(TABLE_BATCHES if cuda else spec_verify.CPU_BATCHES)
    args.providers = args.providers or list(TABLE_PROVIDERS)
    if not args.quick:
        args.spec_timing = TABLE_TIMING
    seen: dict = {}

    def summarize(rows: list[report.Row], a: argparse.Namespace) -> Summary:
        summary = SPEC.summarize(rows, a)
        seen.update(records=summary.records, modes={r.mode for r in rows if _usable(r)})
        return summary

    rc = run_suite(dataclasses.replace(SPEC, summarize=summarize), args, command)
    where = path or spec_policy.default_table_path()
    if rc != 0 or "records" not in seen:
        print(f"crossover table NOT written to {where}: the run had failed checks, errors or stopped early")
        return rc or 1
    header = env.collect(torch.device("cuda" if cuda else "cpu"), command)
    try:
        written = write_crossover_table(seen["records"], header, seen["modes"], path)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    entries = {}
    for r in table_rows(seen["records"]):
        entries.setdefault((r["shape"], r["state_dtype"]), {})[r["tokens"]] = r["crossover_batch"]
    print(f"crossover table: merged {sum(map(len, entries.values()))} row(s) measured on {header['device']} into "
          f"{written}: " + "; ".join(f"{shape} {state} {table}" for (shape, state), table in entries.items()))
    return 0
