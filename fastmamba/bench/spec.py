"""Target ``spec``: speculative verification kernels side by side, and the batch-adaptive choice.

    python -m fastmamba.bench spec [--tokens 2,6,16] [--batch 1,8,32,128,256] [--accept-rate 0.6]
                                   [--quick] [--json PATH] [--markdown PATH] [--device auto|cuda|cpu]

For T = K+1 tokens per step (default 6), the mamba2-2.7b (H80 P64 N128 G1) and Nemotron-H (H128
P64 N128 G8) shapes, fp32 and fp16 state, bf16 activations, batch 1, 8, 32, 128, 256: ``replay``
(replay_selective_state_update, T//2 tokens replayed), ``legacy`` (multi-token
selective_state_update writing T states + the copy of the accepted one), ``legacy-no-copy`` and
``plain`` (single-token decode: a step with nothing drafted). See fastmamba/bench/ops/spec_verify.py
for the inputs, the byte models and the check.

The runner is the ``kernels`` target's (``fastmamba.bench.kernels.run_suite``): rotating input
sets, CUDA-graph replays, one check per provider. After the table, the batch-adaptive choice: per
(shape, state dtype, T) the smallest batch from which replay beats legacy (with its copy) at every
larger measured batch, and whether plain decode is cheaper per token at batch 1 than the path
``choose_verify_path`` picks, given ``--accept-rate`` (expected tokens per step sum_{i=0..K} rate^i;
SSM-kernel time only: the drafter and the rest of the model are not in it). The same goes into the
JSON file as ``"record": "spec_choice"`` lines, and per (shape, state dtype) a ``"spec_crossover"``
line whose ``table`` is what ``fastmamba.generation.spec_policy.choose_verify_path`` takes.
Without a GPU: a tiny shape through the Triton interpreter (plumbing, not speed).
"""
from __future__ import annotations

import argparse

from fastmamba.bench import report
from fastmamba.bench.kernels import Suite, Summary, _int_list, add_device_arguments, run_suite
from fastmamba.bench.ops import spec_verify
from fastmamba.bench.ops.spec_verify import LEGACY, LEGACY_NO_COPY, PLAIN, REPLAY
from fastmamba.generation.spec_policy import choose_verify_path, expected_tokens_per_step

OPS = {"spec": "fastmamba.bench.ops.spec_verify"}
ACCEPT_RATE = 0.6


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=_tokens_list, default=list(spec_verify.TOKENS),
                        help="T = K+1 tokens verified per step, comma-separated (default "
                        f"{','.join(map(str, spec_verify.TOKENS))}; the sweep is 2,6,16)")
    parser.add_argument(
        "--batch",
        type=_int_list,
        default=None,
        help=f"batch sizes; default {','.join(map(str, spec_verify.GPU_BATCHES))} on a GPU, "
        f"{','.join(map(str, spec_verify.CPU_BATCHES))} on the CPU",
    )
    parser.add_argument("--accept-rate", type=_rate, default=ACCEPT_RATE,
                        help=f"per-draft acceptance rate for the batch-1 plain-vs-speculative line (default {ACCEPT_RATE})")
    parser.set_defaults(ops=list(OPS))
    add_device_arguments(parser, "spec")


# --- the batch-adaptive choice ------------------------------------------------------------------
def _usable(row: report.Row) -> bool:
    return row.status == "ok" and row.median_us is not None and not row.check.startswith("FAIL")


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
        records.append(dict(
            record="spec_choice", shape=shape, dims=dims, dtype=dtype, state_dtype=state, tokens=T,
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
    return Summary(lines, records)


SPEC = Suite("spec", "fastmamba speculative verification benchmark", OPS, spec_verify.GPU_BATCHES,
             spec_verify.CPU_BATCHES, summarize=summarize)


def run(args: argparse.Namespace, command: str) -> int:
    return run_suite(SPEC, args, command)
