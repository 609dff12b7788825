"""Test-wide fixtures: the `gpu` marker, the device fixture, NaN-poisoned allocation.

CPU runs need ``TRITON_INTERPRET=1`` in the environment *before* Python starts (Triton reads it
when a function is decorated); `make test` sets it. GPU-marked tests skip with a reason when no
CUDA device is present.
"""
from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Under pytest-xdist each worker takes its share of the cores for PyTorch's CPU threads (and passes it
# to the servers and ranks it starts): 14 workers at 16 threads each on a 16-core GPU machine made the
# CPU tests' tiny ops a thousand times slower (0.25 s here, a 200 s timeout there)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))


def pytest_configure(config):
    # FASTMAMBA_TEST_PLAIN_CPU=1: run without the interpreter anyway, so CPU tensors take the plain
    # PyTorch paths, as the CPU-device tests do on a GPU machine (where TRITON_INTERPRET is off)
    if not HAS_CUDA and not INTERPRET and os.environ.get("FASTMAMBA_TEST_PLAIN_CPU") != "1":
        raise pytest.UsageError(
            "No CUDA GPU and the Triton interpreter is off: run `make test`, or set "
            "TRITON_INTERPRET=1 in the environment before starting pytest."
        )


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (full shapes, bf16 arithmetic, CUDA graphs)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_runtest_logreport(report):
    # FASTMAMBA_FAILURE_LOG=FILE: append each failure (test id and traceback) to FILE as it happens,
    # so a suite cut at a device call's time limit still tells which tests failed and why
    path = os.environ.get("FASTMAMBA_FAILURE_LOG")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:  # once: the controller's copy
        with open(path, "a") as log:
            log.write(f"=== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n")


@pytest.fixture
def device() -> torch.device:
    """CUDA when present, else CPU (kernels then run in the Triton interpreter)."""
    return torch.device("cuda") if HAS_CUDA else torch.device("cpu")

