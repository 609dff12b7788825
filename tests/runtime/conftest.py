"""Runtime tests check scheduling, sampling, caches and bookkeeping, not kernels (tests/ops does):
the ops run as their PyTorch references here (TRITON_INTERPRET=0 while a module runs, its
module-scoped fixtures included), several times faster on a CPU than the Triton interpreter. A module
that needs the kernels' path (the interpreter on a CPU) sets ``pytestmark = pytest.mark.kernels``."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")
def _reference_ops(request):
    if request.node.get_closest_marker("kernels") is not None:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        yield
