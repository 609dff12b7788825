"""The package's floors: arrows point down (ops < layers < cache < models < generation < serve /
distributed / bench / integrations < cli, llm) and no two modules import each other in a circle.

Read from the source with ``ast`` (no import runs), deferred imports inside functions included, so a
new upward arrow or circle fails here with the file and line that adds it. At 6625510 this finds the
two circles and the upward arrows issue 49 names.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "fastmamba"

# a room's floor: it may import rooms on lower floors (and its own room) only
FLOORS = {
    "utils": 0, "extras": 0, "presets": 0,   # leaves anyone may read
    "ops": 1, "layers": 2, "cache": 3, "models": 4, "generation": 5,
    "serve": 6, "distributed": 6, "bench": 6, "integrations": 6,
    "cli": 7, "llm": 7,
}
# rooms on one floor that may import each other's rooms (never in a circle: the test below)
SIDEWAYS = {("serve", "distributed"), ("bench", "distributed"), ("bench", "integrations"), ("bench", "serve")}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]):
    """(line, imported fastmamba module) for every import in the file, inside functions too (a
    deferred import is still an arrow); ``from pkg import sub`` names the submodule when ``pkg.sub``
    is a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fastmamba"):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("fastmamba"):
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
            yield from ((node.lineno, m) for m in (subs or [node.module]))


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package root (its public names)


def test_every_room_has_a_floor():
    rooms = {_room(m) for m in _modules()} - {None}
    assert rooms <= set(FLOORS), f"rooms without a floor in this test: {sorted(rooms - set(FLOORS))}"


def test_arrows_point_down():
    modules = _modules()
    bad = []
    for name, path in modules.items():
        src = _room(name)
        if src is None:
            continue
        for line, target in _imports(path, modules):
            dst = _room(target)
            if dst is None or dst == src or (src, dst) in SIDEWAYS:
                continue
            if FLOORS[dst] >= FLOORS[src]:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {src} (floor {FLOORS[src]}) imports "
                           f"{target} ({dst}, floor {FLOORS[dst]})")
    assert not bad, "imports that point up or sideways:\n" + "\n".join(bad)


# the rooms that run (not ``bench``, whose tuners and profilers reach into the ops' configs and kernels)
RUNTIME_ROOMS = {"layers", "cache", "models", "generation", "serve", "distributed", "integrations", "cli", "llm"}


def test_runtime_enters_the_ops_by_their_doors():
    """Outside ``fastmamba/ops`` the runtime imports ``fastmamba.ops``, an op's package (its
    ``__init__``: the op's public names) or ``fastmamba.ops.runtime`` (what the runtime needs from the
    ops' internals), never an op's inner module (kernel, configs, ref, ``_common``, ...)."""
    modules = _modules()
    doors = {"fastmamba.ops", "fastmamba.ops.runtime"} | {m for m in modules if m.count(".") == 2
                                                            and m.startswith("fastmamba.ops.")
                                                            and modules[m].name == "__init__.py"}
    bad = []
    for name, path in modules.items():
        if _room(name) not in RUNTIME_ROOMS:
            continue
        for line, target in _imports(path, modules):
            if _room(target) == "ops" and target not in doors:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: imports {target}")
    assert not bad, "imports of an op's inner modules (use its package or fastmamba.ops.runtime):\n" + "\n".join(bad)


def test_no_import_circles():
    modules = _modules()
    graph = {m: {t for _, t in _imports(p, modules) if t in modules and t != m}
             for m, p in modules.items()}
    # Tarjan's strongly connected components: a component of two or more modules is a circle
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            # a package and the submodules it re-exports import each other by design
            if len(comp) > 1 and not all(c.startswith(min(comp, key=len)) for c in comp):
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


@pytest.mark.parametrize("limit", [600])
def test_no_module_over_the_line_limit(limit):
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > limit}
    assert not long, f"modules over {limit} lines (split them by job): {long}"
