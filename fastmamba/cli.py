"""The ``fastmamba`` command (declared in pyproject.toml as ``fastmamba = "fastmamba.cli:main"``).

    fastmamba bench kernels [--ops ssu,conv,norm] [--batch 1,8,64,256] [--quick] [--json P] [--markdown P]
                            [--device auto|cuda|cpu]

Each sub-command is an argparse sub-parser; ``generate`` (decode with a model) will be added the
same way as ``bench``.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fastmamba.bench import targets as bench_targets


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and its sub-command parsers by name."""
    parser = argparse.ArgumentParser(prog="fastmamba", description="fastmamba: Mamba-2 inference kernels and runtime")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    bench = sub.add_parser(
        "bench", help="run a benchmark (same as python -m fastmamba.bench)", description="fastmamba benchmarks"
    )
    bench_targets.configure(bench)
    bench.set_defaults(_handler=_bench)
    # later: generate = sub.add_parser("generate", ...); generate.set_defaults(_handler=_generate)
    return parser, {"bench": bench}


def _bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    return bench_targets.dispatch(args, bench_targets.command_line("fastmamba", argv))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, commands = build_parser()
    if argv[:1] == ["bench"]:
        bench_targets.check_planned(commands["bench"], argv[1:])
    args = parser.parse_args(argv)
    return args._handler(args, argv)


if __name__ == "__main__":
    sys.exit(main())
