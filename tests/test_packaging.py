"""Packaging as a user meets it: the extras (``hf``, ``serve`` including it, transformers' supported
range), the LICENSE that pyproject declares, ``from fastmamba import LLM, SamplingParams`` with a
light ``import fastmamba``, the version, no numpy warning without numpy, the install hint when an
extra is missing, and the static preset table the CLI's help reads (checked against the registries)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]


def names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].strip().lower() for r in requirements}


def python(*args: str, path: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """A fresh interpreter (optionally with ``path`` in front of sys.path: modules that hide packages)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([*([str(path)] if path else []), str(ROOT)])
    env["FASTMAMBA_PROGRESS"] = "0"
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)


def hide(tmp_path: Path, *modules: str) -> Path:
    """A directory whose modules make ``import <module>`` fail as if the package were not installed."""
    d = tmp_path / "hidden"
    d.mkdir(exist_ok=True)
    for m in modules:
        (d / f"{m}.py").write_text(f"raise ModuleNotFoundError(\"No module named '{m}'\", name='{m}')\n")
    return d


# ---------------------------------------------------------------------------------------------
# pyproject and LICENSE


def test_hf_extra_and_serve_includes_it():
    assert {"tokenizers", "safetensors", "numpy"} <= names(EXTRAS["hf"])
    serve = EXTRAS["serve"]
    assert "fastmamba[hf]" in serve and {"transformers", "fastapi", "uvicorn"} <= names(serve)
    transformers = next(r for r in serve if r.startswith("transformers"))
    assert ">=5.17" in transformers and "<6" in transformers  # the range the tests run on
    assert "fastmamba[serve]" in EXTRAS["test"]  # the tests use every extra
    assert names(PYPROJECT["project"]["dependencies"]) == {"torch", "triton"}  # the core stays small


def test_every_extra_module_is_in_its_extra():
    from fastmamba.extras import EXTRA_OF

    dist = {"prometheus_client": "prometheus-client"}
    for module, extra in EXTRA_OF.items():
        reqs = names(EXTRAS[extra]) | (names(EXTRAS["hf"]) if extra == "serve" else set())
        assert dist.get(module, module) in reqs | {"jinja2"}, (module, extra)  # jinja2 comes with transformers


def test_license_file_is_the_declared_apache_2():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_version_matches_pyproject():
    import fastmamba

    assert fastmamba.__version__ == PYPROJECT["project"]["version"]


# ---------------------------------------------------------------------------------------------
# the package's top level


def test_top_level_exports_are_lazy():
    code = ("import sys, fastmamba; assert 'torch' not in sys.modules, 'import fastmamba imported torch'; "
            "from fastmamba import LLM, SamplingParams, Completion, Engine; "
            "from fastmamba.llm import LLM as L; from fastmamba.generation.sampling import SamplingParams as S; "
            "assert LLM is L and SamplingParams is S; print('ok')")
    proc = python("-c", code)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    proc = python("-X", "importtime", "-c", "import fastmamba")
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert not {"torch", "triton", "numpy"} & imported, sorted(imported)
    proc = python("-c", "import fastmamba; fastmamba.Nope")
    assert "module 'fastmamba' has no attribute 'Nope'" in proc.stderr


def test_no_numpy_warning_without_numpy(tmp_path):
    """torch warns "Failed to initialize NumPy" when numpy is absent; every command showed it."""
    proc = python("-m", "fastmamba.cli", "generate", "--model", "mamba2-tiny", "--prompt-ids", "1,2",
                  "--max-new-tokens", "1", "--device", "cpu", path=hide(tmp_path, "numpy"))
    assert proc.returncode == 0, proc.stderr
    assert "NumPy" not in proc.stderr and "numpy" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("hidden,argv,extra", [
    ("fastapi", ["serve", "--model", "mamba2-tiny", "--device", "cpu"], "serve"),
    ("safetensors", ["generate", "--model", "CKPT", "--prompt-ids", "1", "--device", "cpu"], "hf"),
    ("tokenizers", ["generate", "--model", "CKPT", "--prompt", "w1", "--device", "cpu"], "hf"),
], ids=["serve-without-fastapi", "checkpoint-without-safetensors", "tokenizer-without-tokenizers"])
def test_missing_extra_is_one_line_with_the_install_hint(tmp_path, hidden, argv, extra):
    from tests.test_cli import tiny_checkpoint

    ckpt = tiny_checkpoint(tmp_path / "ckpt", tokenizer=True)
    argv = [str(ckpt) if a == "CKPT" else a for a in argv]
    proc = python("-m", "fastmamba.cli", *argv, path=hide(tmp_path, hidden))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert re.match(r"fastmamba( serve)?: error: ", lines[0]) and f"pip install 'fastmamba[{extra}]'" in lines[0], lines


def test_a_broken_serve_dependency_is_named_not_called_missing(tmp_path):
    """fastapi present but failing on a dependency of its own: the error names that failure, not the extra."""
    d = tmp_path / "broken"
    d.mkdir()
    (d / "fastapi.py").write_text("raise ModuleNotFoundError(\"No module named 'some_dep'\", name='some_dep')\n")
    proc = python("-m", "fastmamba.cli", "serve", "--model", "mamba2-tiny", "--device", "cpu", path=d)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "fastapi is installed but importing it failed: No module named 'some_dep'" in lines[0], lines
    assert "pip install" not in lines[0], lines


# ---------------------------------------------------------------------------------------------
# the static preset table of the CLI's help


def test_preset_table_matches_the_registries():
    import torch

    from fastmamba.models import NEMOTRON_H_PRESETS, PRESETS, Mamba2LM, NemotronHLM
    from fastmamba.presets import PRESET_INFO, PresetInfo

    want = []
    for name, c in PRESETS.items():
        n = sum(p.numel() for p in Mamba2LM(c, device="meta", dtype=torch.float32).parameters())
        want.append(PresetInfo(name, "mamba2", c.n_layer, c.d_model, c.vocab_size, n))
    for name, c in NEMOTRON_H_PRESETS.items():
        n = sum(p.numel() for p in NemotronHLM(c, device="meta", dtype=torch.float32).parameters())
        family = "nemotron_3" if "E" in c.pattern else "nemotron_h"
        want.append(PresetInfo(name, family, c.n_layer, c.d_model, c.vocab_size, n))
    rows = "\n".join(f"    PresetInfo({p.name!r}, {p.family!r}, {p.n_layer}, {p.d_model}, {p.vocab_size:_}, "
                     f"{p.params:_})," for p in want)
    assert sorted(PRESET_INFO) == sorted(want), f"fastmamba/presets.py is out of date; its rows should be:\n{rows}"
