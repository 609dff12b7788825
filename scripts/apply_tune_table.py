"""Write the paste-ready TABLE that ``python -m fastmamba.bench tune`` printed into the op's configs
module, in place of its TABLE (on the GPU machine, so that later steps of the same call run the
tuned configs; the same block is then pasted here by hand, with its comment lines).

    python3 scripts/apply_tune_table.py TUNE_OUTPUT.txt

The block starts at the line ``# paste-ready TABLE for <module> ...`` and ends at the first line that
is ``}``; the module's own ``TABLE: ... = {...}`` (one line, or up to its first line that is ``}``) is
replaced, keeping its annotation. Exits 1 when the output holds no block."""
from __future__ import annotations

import importlib.util
import re
import sys


def blocks(text: str) -> list[tuple[str, list[str]]]:
    """(module, entry lines) of each paste-ready block in ``text``."""
    out, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"# paste-ready TABLE for (\S+) ", line)
        if not m:
            continue
        end = next(j for j in range(i + 2, len(lines)) if lines[j] == "}")
        out.append((m.group(1), lines[i + 2:end]))
    return out


def apply(module: str, entries: list[str]) -> str:
    path = importlib.util.find_spec(module).origin
    src = open(path).read().splitlines()
    start = next(i for i, ln in enumerate(src) if ln.startswith("TABLE:"))
    if src[start].rstrip().endswith("= {}"):
        end = start
    else:
        end = next(j for j in range(start, len(src)) if src[j] == "}")
    head = src[start].split("=", 1)[0].rstrip() + " = {"
    src[start:end + 1] = [head, *entries, "}"]
    with open(path, "w") as f:
        f.write("\n".join(src) + "\n")
    return path


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python3 scripts/apply_tune_table.py TUNE_OUTPUT.txt", file=sys.stderr)
        return 2
    try:
        text = open(argv[1]).read()
    except OSError as exc:
        print(f"apply_tune_table: cannot read {argv[1]}: {exc.strerror}", file=sys.stderr)
        return 1
    found = blocks(text)
    if not found:
        print(f"apply_tune_table: no paste-ready TABLE in {argv[1]} (did the tune step fail?)", file=sys.stderr)
        return 1
    for module, entries in found:
        print(f"{apply(module, entries)}: TABLE of {len(entries)} lines from {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
