"""Tensor-parallel tests run the ops' PyTorch references (``tests.helpers.runtime_reference_ops``);
the spawned ranks inherit TRITON_INTERPRET=0 from the test's environment, so no rank runs the
Triton interpreter."""
from tests.helpers import runtime_reference_ops  # noqa: F401  (an autouse fixture for this folder)
