"""Benchmark targets and their command line, shared by ``python -m fastmamba.bench`` and
``fastmamba bench``.

To add a target: write a module with
``add_arguments(parser)`` and ``run(args, command) -> int`` (exit status), then add a ``Target``
to ``TARGETS`` and remove its name from ``PLANNED``.
"""
from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    name: str
    module: str  # provides add_arguments(parser) and run(args, command) -> int
    help: str


TARGETS = {
    t.name: t
    for t in (
        Target("kernels", "fastmamba.bench.kernels", "decode kernels (state update, conv update, gated RMSNorm) vs peers"),
        Target("prefill", "fastmamba.bench.prefill", "prefill kernels (causal conv, chunked SSD scan) vs peers"),
        Target("tune", "fastmamba.bench.tune", "sweep the kernels' launch configs (GPU only)"),
        Target("tune-attention", "fastmamba.bench.tune_attention", "sweep paged decode attention's launch configs (GPU only)"),
        Target("host", "fastmamba.bench.host", "host µs per call of every public op (CPU under TRITON_INTERPRET=1, or GPU)"),
        Target("profile", "fastmamba.bench.prefill_profile", "where a step's time goes: a graphed decode step's or prefill's kernels, or eager host time (GPU)"),
        Target("mtp", "fastmamba.bench.mtp", "MTP speculative decoding, cost-faithful oracle: draft / verify / commit vs plain, byte bound"),
        Target("spec", "fastmamba.bench.spec", "speculative verification: replay vs per-position states vs plain decode"),
        Target("e2e", "fastmamba.bench.e2e", "end-to-end prefill and decode tok/s vs the bandwidth roofline"),
        Target("chunked", "fastmamba.bench.chunked", "inter-token latency of running requests while a long prompt arrives, chunked or not"),
        Target("capacity", "fastmamba.bench.capacity", "what the capacity planner admits (max_batch, K/V pages) and, with --startup, the start-up time"),
        Target("serve", "fastmamba.bench.serve", "load test of fastmamba serve on loopback vs the offline engine"),
        Target("ttft", "fastmamba.bench.ttft", "time to first token: warm whole-model prefill (eager and graphed) vs its floor"),
        Target("tp", "fastmamba.bench.tp", "tensor-parallel decode at several TP sizes: speedup, collectives, equal outputs"),
        Target("hf", "fastmamba.bench.hf_provider", "transformers' generate with and without fastmamba as its kernel provider"),
        Target("fp8", "fastmamba.bench.ops.fp8", "FP8 W8A8 projections and MoE vs bf16 and torch._scaled_mm"),
        Target("fp8-error", "fastmamba.bench.fp8_error", "where FP8's logit error comes from: per block, kernels vs references, FP8 vs 16 bits, drift"),
    )
}
PLANNED: tuple[str, ...] = ()


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the target sub-commands to ``parser`` (a top-level parser or a ``bench`` sub-parser)."""
    if PLANNED:
        parser.epilog = f"planned targets, not available yet: {', '.join(PLANNED)}"
    sub = parser.add_subparsers(dest="target", metavar="TARGET", required=True)
    for t in TARGETS.values():
        module = importlib.import_module(t.module)
        sp = sub.add_parser(t.name, help=t.help, description=t.help)
        module.add_arguments(sp)
        sp.set_defaults(_target=t)
    return parser


def check_planned(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """A planned but missing target gets a clear error instead of argparse's generic one."""
    first = next((a for a in argv if not a.startswith("-")), None)
    if first in PLANNED:
        parser.error(f"target {first!r} is planned but not implemented yet; available: {', '.join(TARGETS)}")


def command_line(prog: str, argv: Sequence[str]) -> str:
    """The exact command, with TRITON_INTERPRET in front when it is set (it changes what runs)."""
    prefix = f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET']} " if "TRITON_INTERPRET" in os.environ else ""
    return prefix + " ".join([prog, shlex.join(list(argv))]).strip()


def dispatch(args: argparse.Namespace, command: str) -> int:
    module = importlib.import_module(args._target.module)
    return int(module.run(args, command) or 0)


def main(argv: Sequence[str] | None = None, prog: str = "python -m fastmamba.bench") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = configure(argparse.ArgumentParser(prog=prog, description="fastmamba benchmarks"))
    check_planned(parser, argv)
    args = parser.parse_args(argv)
    return dispatch(args, command_line(prog, argv))
