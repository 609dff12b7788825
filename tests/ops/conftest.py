"""Shared by the op tests: every test starts without cached launch plans, so a test that swaps a
kernel-choice hook (use_rows_kernel, STORE_EARLY...) is not served a plan an earlier test made."""
import pytest

from fastmamba.ops.conv1d import api as conv1d_api
from fastmamba.ops.state_update import api as ssu_api


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    conv1d_api.clear_plans()
    ssu_api.clear_plans()
    yield
    conv1d_api.clear_plans()
    ssu_api.clear_plans()
