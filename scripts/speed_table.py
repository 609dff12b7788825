"""One markdown table of HEAD's speed against a base commit's, from the benches' JSON lines.

    python3 scripts/speed_table.py --base base.jsonl [more.jsonl ...] --head head.jsonl [...] [--tolerance 0.03]

The files are what ``python -m fastmamba.bench e2e | ttft | serve --json PATH`` append (one side's rows
may span several files, e.g. one per device call of ``scripts/speed_vs_base.sh``). Rows are told apart
by their keys; per side, rows of the same measurement (several rounds) are reduced to their median.
Measurements compared (issue 49, "speed unchanged"):

- e2e:   decode ms/step of the plain ``fastmamba`` row, per model and batch (lower is better)
- ttft:  graphed time to first token in ms, per model and B x L shape (lower is better)
- serve: the load test's server and offline output tok/s (higher is better), TTFT and ITL p50 / p99
         in ms (lower is better), per model and traffic shape

"within ±3%?" reads yes when HEAD is no worse than the tolerance allows (ratio <= 1 + tol where lower
is better, >= 1 - tol where higher is better), "yes (faster)" past the tolerance on the good side,
"NO (slower)" past it on the bad side, and "missing" where one side has no row. Plain Python, no
fastmamba import: it reads the files of either version.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

SERVE_METRICS = (  # (key, label, lower is better)
    ("server_tok_per_s", "server output tok/s", False),
    ("offline_tok_per_s", "offline output tok/s", False),
    ("ttft_p50_ms", "server TTFT p50 ms", True),
    ("ttft_p99_ms", "server TTFT p99 ms", True),
    ("itl_p50_ms", "server ITL p50 ms", True),
    ("itl_p99_ms", "server ITL p99 ms", True),
)


def measurements(row: dict) -> list[tuple[str, float | None, bool]]:
    """The (label, value, lower is better) measurements one JSON row carries; [] for rows not compared
    (peers, speculative, 16-bit state, drift and ablation rows of ``e2e``)."""
    if "ms_per_step" in row and "batch" in row:  # bench e2e
        if row.get("provider") != "fastmamba" or row.get("speculate"):
            return []
        return [(f"e2e {row.get('model')} decode ms/step, batch {row['batch']}", row["ms_per_step"], True)]
    if "graphed_ms" in row and "length" in row:  # bench ttft
        return [(f"ttft {row.get('model')} graphed ms, {row['batch']} x {row['length']}", row["graphed_ms"], True)]
    if "server_tok_per_s" in row:  # bench serve (the load test; not --shared-prefix)
        shape = (f"{row.get('requests')} req, {row.get('concurrency')} conc, "
                 f"{row.get('prompt_len')}/{row.get('output_len')} tok")
        return [(f"serve {row.get('model')} {label} ({shape})", row.get(key), lower)
                for key, label, lower in SERVE_METRICS]
    return []


def read_side(paths: list[str]) -> tuple[dict[str, list[float]], dict[str, bool], list[str]]:
    """Values per measurement label (in first-seen order), lower-is-better per label, the labels."""
    values: dict[str, list[float]] = {}
    lower: dict[str, bool] = {}
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as exc:
            raise SystemExit(f"speed_table: cannot read {path}: {exc}")
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SystemExit(f"speed_table: {path}:{i} is not a JSON line: {exc}")
            if not isinstance(row, dict):
                raise SystemExit(f"speed_table: {path}:{i}: expected a JSON object, got {type(row).__name__}")
            for label, value, low in measurements(row):
                values.setdefault(label, [])
                lower[label] = low
                if value is not None:
                    values[label].append(float(value))
    return values, lower, list(values)


def verdict(ratio: float | None, lower_is_better: bool, tol: float) -> str:
    if ratio is None:
        return "missing"
    worse = ratio - 1 if lower_is_better else 1 - ratio  # > 0: HEAD is slower
    if worse > tol:
        return "NO (slower)"
    if worse < -tol:
        return "yes (faster)"
    return "yes"


def _fmt(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:.4g}" if abs(v) < 1000 else f"{v:.0f}"


def table(base_paths: list[str], head_paths: list[str], tol: float = 0.03) -> tuple[str, int, int]:
    """The markdown table, the count of measurements within the tolerance (or better), and of all."""
    base, lower_b, order_b = read_side(base_paths)
    head, lower_h, order_h = read_side(head_paths)
    labels = order_b + [k for k in order_h if k not in base]
    if not labels:
        raise SystemExit("speed_table: no e2e, ttft or serve rows in the files given")
    lines = [f"| metric | base | head | head/base | within ±{100 * tol:g}%? |", "|---|---:|---:|---:|---|"]
    ok = 0
    for label in labels:
        b = statistics.median(base[label]) if base.get(label) else None
        h = statistics.median(head[label]) if head.get(label) else None
        ratio = h / b if b and h is not None else None
        v = verdict(ratio, lower_b.get(label, lower_h.get(label, True)), tol)
        ok += v.startswith("yes")
        n = max(len(base.get(label, [])), len(head.get(label, [])))
        name = label + (f" (median of {n})" if n > 1 else "")
        lines.append(f"| {name} | {_fmt(b)} | {_fmt(h)} | {'—' if ratio is None else f'{ratio:.3f}'} | {v} |")
    return "\n".join(lines), ok, len(labels)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", nargs="+", required=True, metavar="JSONL", help="the base commit's JSON lines")
    parser.add_argument("--head", nargs="+", required=True, metavar="JSONL", help="HEAD's JSON lines")
    parser.add_argument("--tolerance", type=float, default=0.03, help="noise band as a fraction (default 0.03)")
    args = parser.parse_args(argv)
    if not 0 <= args.tolerance < 1:
        parser.error(f"--tolerance expects a fraction in [0, 1), got {args.tolerance}")
    text, ok, total = table(args.base, args.head, args.tolerance)
    print(text)
    print(f"\n{ok} of {total} measurements within ±{100 * args.tolerance:g}% or better")
    return 0


if __name__ == "__main__":
    sys.exit(main())
