"""Which varlen scan path the tests written for the five-kernel path exercise.

``ssd_scan_varlen`` picks the fused one-launch kernel by itself when every sequence is short, which
is true of nearly every CPU test shape; the tests that predate it (tile configs, the
five-kernel launcher's corner cases) would then no longer reach the kernels they were written for.
So outside ``test_ssd_scan_fused.py`` the automatic choice is pinned to the chunked path by default.
``FASTMAMBA_TEST_SCAN_PATH=fused`` runs the same tests on the fused kernel instead (every call that
does not force a path), ``auto`` leaves the automatic choice.
"""
from __future__ import annotations

import os

import pytest

from fastmamba.ops.ssd_scan.fused import configs as fused_configs

_LIMITS = {"chunked": -1, "fused": 1 << 62}


@pytest.fixture(autouse=True)
def _pinned_scan_path(request, monkeypatch):
    if request.node.path.name == "test_ssd_scan_fused.py":
        return
    path = os.environ.get("FASTMAMBA_TEST_SCAN_PATH", "chunked")
    if path not in (*_LIMITS, "auto"):
        raise pytest.UsageError(f"FASTMAMBA_TEST_SCAN_PATH must be chunked, fused or auto, got {path!r}")
    if path in _LIMITS:
        monkeypatch.setattr(fused_configs, "MAX_FUSED_LEN", _LIMITS[path])
