"""Every subpackage imports on its own, first thing in a fresh interpreter (a user may start from
any of them; an import cycle shows only when its module is the first one loaded)."""
import subprocess
import sys

import pytest

ENTRY_MODULES = [
    "fastmamba", "fastmamba.ops", "fastmamba.cache", "fastmamba.models", "fastmamba.layers.mamba2",
    "fastmamba.generation", "fastmamba.generation.cuda_graphs", "fastmamba.bench", "fastmamba.cli",
]


@pytest.mark.parametrize("module", ENTRY_MODULES)
def test_imports_first(module):
    result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"import {module} failed in a fresh interpreter:\n{result.stderr[-2000:]}"
