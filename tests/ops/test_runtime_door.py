"""The runtime reaches the ops only through their doors: ``fastmamba.ops``, ``fastmamba.ops.<op>``
(an op's ``__init__``), ``fastmamba.ops.runtime``, and an op's reference (``fastmamba.ops.<op>.ref``).
An import of ``ops/_common`` or of an op's kernel / api / configs file from anywhere else in the
package fails here (benchmarks of an op's internal pieces are the one exception: ``fastmamba/bench``)."""
from __future__ import annotations

import ast
import pathlib

import fastmamba
import fastmamba.ops.runtime as runtime

PACKAGE = pathlib.Path(fastmamba.__file__).parent
OPS = PACKAGE / "ops"


def _door(module: str) -> bool:
    parts = module.split(".")
    if parts[:2] != ["fastmamba", "ops"] or len(parts) == 2:
        return True
    if parts[2] == "runtime":
        return len(parts) == 3
    if parts[2].startswith("_"):
        return False
    return len(parts) == 3 or (len(parts) == 4 and parts[3] == "ref")


def _imports(path: pathlib.Path):
    """(line, module) of every absolute import in ``path``; ``from fastmamba.ops[.<op>] import name``
    also as ``...<op>.name`` (the name may be a module: ``from fastmamba.ops.gemv import configs``)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in ("fastmamba.ops",) or (node.module.startswith("fastmamba.ops.") and node.module.count(".") == 2):
                for alias in node.names:
                    yield node.lineno, f"{node.module}.{alias.name}"
            else:
                yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def test_no_op_internals_imported_outside_ops():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if OPS in path.parents or (PACKAGE / "bench") in path.parents:
            continue
        for line, module in _imports(path):
            if not _door(module) and not (module.count(".") == 3 and _names_a_public_symbol(module)):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module}")
    assert not bad, "op internals imported outside fastmamba/ops (use fastmamba.ops.runtime):\n" + "\n".join(bad)


def _names_a_public_symbol(module: str) -> bool:
    """``from fastmamba.ops.<op> import name`` where ``name`` is what the op's __init__ exports."""
    import importlib

    package, _, name = module.rpartition(".")
    return name in getattr(importlib.import_module(package), "__all__", ())


def test_runtime_exports_what_it_lists():
    for name in runtime.__all__:
        assert getattr(runtime, name) is not None, name
        assert name in runtime.__doc__, f"{name} is exported but not described in the module docstring"
