"""Runtime tests run the ops' PyTorch references (``tests.helpers.runtime_reference_ops``)."""
from tests.helpers import runtime_reference_ops  # noqa: F401  (an autouse fixture for this folder)
