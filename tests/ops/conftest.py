"""Shared by the op tests: every test starts without remembered launch plans (every op's
``PlanCache``), so a test that swaps a kernel-choice hook (use_rows_kernel, STORE_EARLY...) is not
served a plan an earlier test made, and without a pending slot-index error
(fastmamba.ops._common.slot_errors): a bad index one test left to the device check must not be
reported by the next test's first call of the op. And ``compiled``: an sm_90 compile test module's
variants, compiled in one subprocess."""
import os

import pytest

from fastmamba.ops._common import slot_errors
from fastmamba.ops._common.plans import clear_plans


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    clear_plans()
    slot_errors.clear_pending_slot_errors()
    yield
    clear_plans()
    slot_errors.clear_pending_slot_errors()  # synchronizes first: a kernel still running records before the clear


@pytest.fixture(scope="module")
def compiled(request) -> dict:
    """Every variant of an sm_90 compile test module, compiled in one subprocess (the module's own
    ``__main__`` with the argument "all", printing {variant: result}): one Triton import (~2 s of a
    CPU) instead of one per variant. A failed compile fails each test of the module with the
    subprocess's traceback."""
    from tests.helpers import compile_in_subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return compile_in_subprocess(request.module.__file__, "all", root)
