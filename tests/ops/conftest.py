"""Shared by the op tests: every test starts without remembered launch plans (every op's
``PlanCache``), so a test that swaps a kernel-choice hook (use_rows_kernel, STORE_EARLY...) is not
served a plan an earlier test made, and without a pending slot-index error
(fastmamba.ops._common.slot_errors): a bad index one test left to the device check must not be
reported by the next test's first call of the op."""
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
