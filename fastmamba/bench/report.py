"""Rows, the printed table, the markdown table and the JSON lines."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class Row:
    """One (op, shape, dtypes, batch, provider) result. Times are per call, in microseconds."""

    op: str
    title: str
    shape: str
    dims: str
    dtype: str
    batch: int
    provider: str
    kind: str  # ours | peer | ref | copy (the same-size copy, size_copy.py)
    version: str
    bytes: int
    flops: int = 0  # model FLOPs per call (0: no FLOP model, e.g. pure data movement)
    status: str = "ok"  # ok | skipped | error | not run
    mode: str = ""  # graph | eager | cpu
    median_us: float | None = None
    p20_us: float | None = None
    p80_us: float | None = None
    calls: int | None = None
    n_sets: int | None = None
    cold_l2: bool | None = None
    gbps: float | None = None
    pct_copy: float | None = None
    pct_size_copy: float | None = None  # a copy of the same bytes' time / this row's (fastmamba/bench/size_copy.py)
    tflops: float | None = None
    pct_matmul: float | None = None  # of the bf16 matmul rate measured in the same run
    eager_us: float | None = None  # no graph: host time included, L2 flushed (timing.time_eager; --eager)
    host_us: float | None = None  # host time of one call, not waiting for the GPU (timing.time_host; --eager)
    eager_vs: str = ""  # e.g. "0.95x vLLM": best peer's eager µs / ours
    check: str = ""  # ok | FAIL ... | ref | no ref
    vs: str = ""  # e.g. "1.45x mamba_ssm" (fastmamba rows)
    vs_ratio: float | None = None
    note: str = ""
    params: dict = field(default_factory=dict)
    case_id: int = -1

    def to_json(self, header: dict) -> dict:
        d = asdict(self)
        d.pop("case_id")
        d["params"] = {k: _jsonable(v) for k, v in self.params.items()}
        return {**header, **d}


def _jsonable(v: object) -> object:
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    return v


def format_us(v: float | None) -> str:
    if v is None:
        return "—"
    if v < 10:
        return f"{v:.2f}"
    if v < 1000:
        return f"{v:.1f}"
    return f"{v:.0f}"


def _cell_note(row: Row, width: int = 70) -> str:
    if row.status == "ok":
        text = row.check
    else:
        text = f"{row.status}: {row.note}" if row.note else row.status
    return text if len(text) <= width else text[: width - 1] + "…"


# (heading, alignment); the FLOP columns appear only when some row has a FLOP model
COLUMNS = [
    ("op", "<"),
    ("shape", "<"),
    ("dtype", "<"),
    ("B", ">"),
    ("provider", "<"),
    ("mode", "<"),
    ("sets", ">"),
    ("median µs", ">"),
    ("p20–p80 µs", ">"),
    ("GB/s", ">"),
    ("% copy", ">"),
    ("% size copy", ">"),
    ("TFLOP/s", ">"),
    ("% mm", ">"),
    ("vs best peer", ">"),
    ("eager µs", ">"),
    ("host µs", ">"),
    ("eager vs peer", ">"),
    ("check", "<"),
]


FLOP_COLUMNS = ("TFLOP/s", "% mm")
EAGER_COLUMNS = ("eager µs", "host µs", "eager vs peer")
SIZE_COPY_COLUMN = "% size copy"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.0f}%" if v >= 1 else f"{v:.2f}%"


def _columns(rows: list[Row]) -> list[int]:
    """Indices into COLUMNS to show: all but the FLOP columns when no row counts FLOPs, the
    size-copy column only when some row has one, the eager columns only when some row was timed eagerly."""
    with_flops = any(r.flops for r in rows)
    with_size_copy = any(r.pct_size_copy is not None for r in rows)
    with_eager = any(r.eager_us is not None for r in rows)
    return [
        i for i, (name, _) in enumerate(COLUMNS)
        if (with_flops or name not in FLOP_COLUMNS) and (with_size_copy or name != SIZE_COPY_COLUMN)
        and (with_eager or name not in EAGER_COLUMNS)
    ]


def _cells(row: Row, note_width: int) -> list[str]:
    spread = f"{format_us(row.p20_us)}–{format_us(row.p80_us)}" if row.median_us is not None else "—"
    sets = "" if row.n_sets is None else str(row.n_sets) + ("" if row.cold_l2 in (None, True) else " L2")
    return [
        row.op,
        f"{row.shape} {row.dims}",
        row.dtype,
        str(row.batch),
        row.provider,
        row.mode or "—",
        sets,
        format_us(row.median_us),
        spread,
        "—" if row.gbps is None else f"{row.gbps:.0f}" if row.gbps >= 10 else f"{row.gbps:.2f}",
        _pct(row.pct_copy),
        _pct(row.pct_size_copy),
        "—" if row.tflops is None else f"{row.tflops:.1f}" if row.tflops >= 1 else f"{row.tflops:.3f}",
        _pct(row.pct_matmul),
        row.vs,
        format_us(row.eager_us),
        format_us(row.host_us),
        row.eager_vs,
        _cell_note(row, note_width),
    ]


def format_table(rows: list[Row], note_width: int = 70) -> str:
    """Fixed-width table; a blank line between ops."""
    keep = _columns(rows)
    columns = [COLUMNS[i] for i in keep]
    body = [[cells[i] for i in keep] for cells in (_cells(r, note_width) for r in rows)]
    heads = [c for c, _ in columns]
    widths = [max([len(h)] + [len(b[i]) for b in body]) for i, h in enumerate(heads)]

    def line(cells: list[str]) -> str:
        out = []
        for (_, align), w, c in zip(columns, widths, cells):
            out.append(c.ljust(w) if align == "<" else c.rjust(w))
        return "  ".join(out).rstrip()

    lines = [line(heads), "  ".join("-" * w for w in widths)]
    last_op = None
    for row, cells in zip(rows, body):
        if last_op is not None and row.op != last_op:
            lines.append("")
        last_op = row.op
        lines.append(line(cells))
    return "\n".join(lines)


def format_markdown(
    rows: list[Row], header_lines: list[str], notes: list[str], title: str = "fastmamba kernel benchmark"
) -> str:
    keep = _columns(rows)
    columns = [COLUMNS[i] for i in keep]
    heads = [c for c, _ in columns]
    out = [f"# {title}", ""]
    out += [f"- {ln}" for ln in header_lines]
    out += ["", "| " + " | ".join(heads) + " |", "|" + "|".join("---:" if a == ">" else "---" for _, a in columns) + "|"]
    for row in rows:
        cells = _cells(row, note_width=400)
        cells = [cells[i].replace("|", "\\|") for i in keep]
        out.append("| " + " | ".join(cells) + " |")
    if notes:
        out += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def collect_notes(rows: list[Row]) -> list[str]:
    """Notes worth reading once: why a provider ran eagerly, how an op was loaded (deduplicated)."""
    seen: dict[tuple[str, str, str], None] = {}
    for r in rows:
        if r.status == "ok" and r.note:
            seen.setdefault((r.op, r.provider, r.note), None)
    return [f"{op} {prov}: {note}" for op, prov, note in seen]


def write_jsonl(path: str, rows: list[Row], header: dict) -> None:
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row.to_json(header), ensure_ascii=False) + "\n")


def write_text(path: str, text: str) -> None:
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def write_records(path: str, records: list[dict], header: dict) -> None:
    """Append free-form records (a target's summary) after the rows, each with the header fields."""
    if not records:
        return
    with open(path, "a", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps({**header, **record}, ensure_ascii=False, default=_json_default) + "\n")


def _json_default(v: object) -> str:
    return str(v).replace("torch.", "")  # dtypes and anything else json does not know
