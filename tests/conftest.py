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


_LOGS_HERE = [True]  # False in an xdist worker: the controller writes the logs below, once per test


def pytest_configure(config):
    _LOGS_HERE[0] = not hasattr(config, "workerinput")
    # FASTMAMBA_TEST_PLAIN_CPU=1: run without the interpreter anyway, so CPU tensors take the plain
    # PyTorch paths, as the CPU-device tests do on a GPU machine (where TRITON_INTERPRET is off)
    if not HAS_CUDA and not INTERPRET and os.environ.get("FASTMAMBA_TEST_PLAIN_CPU") != "1":
        raise pytest.UsageError(
            "No CUDA GPU and the Triton interpreter is off: run `make test`, or set "
            "TRITON_INTERPRET=1 in the environment before starting pytest."
        )


def pytest_collection_modifyitems(config, items):
    # FASTMAMBA_RESUME_FROM=FILE (a FASTMAMBA_DONE_LOG of an earlier run): deselect the tests it lists,
    # so a GPU suite cut at a device call's limit goes on where it stopped in the next call
    done_path = os.environ.get("FASTMAMBA_RESUME_FROM")
    if done_path and os.path.isfile(done_path):
        with open(done_path) as f:
            done = {line.strip() for line in f if line.strip()}
        gone = [item for item in items if item.nodeid in done]
        if gone:
            items[:] = [item for item in items if item.nodeid not in done]
            config.hook.pytest_deselected(items=gone)
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (full shapes, bf16 arithmetic, CUDA graphs)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_runtest_logreport(report):
    # FASTMAMBA_FAILURE_LOG=FILE: append each failure (test id and traceback) to FILE as it happens,
    # so a suite cut at a device call's time limit still tells which tests failed and why;
    # FASTMAMBA_DONE_LOG=FILE: append the id of each test that passed or was skipped (what a resumed
    # run, FASTMAMBA_RESUME_FROM, leaves out). Both from the controller only (xdist's workers report to it)
    if not _LOGS_HERE[0]:
        return
    path = os.environ.get("FASTMAMBA_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as log:
            log.write(f"=== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n")
    done = os.environ.get("FASTMAMBA_DONE_LOG")
    if done and (report.skipped or (report.passed and report.when == "call")):
        with open(done, "a") as log:
            log.write(report.nodeid + "\n")


@pytest.fixture
def device() -> torch.device:
    """CUDA when present, else CPU (kernels then run in the Triton interpreter)."""
    return torch.device("cuda") if HAS_CUDA else torch.device("cpu")

