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


@pytest.fixture
def device() -> torch.device:
    """CUDA when present, else CPU (kernels then run in the Triton interpreter)."""
    return torch.device("cuda") if HAS_CUDA else torch.device("cpu")

