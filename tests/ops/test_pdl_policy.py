"""Which launches use programmatic dependent launch (fastmamba.ops._common.pdl), on a pretend GPU.

The policy needs no GPU to check: the device lookup is replaced by a fixed (sm_90+?, SM count).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from fastmamba.ops._common import pdl

CUDA_TENSOR = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))
CPU_TENSOR = SimpleNamespace(is_cuda=False, device=SimpleNamespace(index=None))


@pytest.fixture
def hopper(monkeypatch):
    """PDL switched on, a 132-SM sm_90 device."""
    monkeypatch.setattr(pdl, "_device_sm_info", lambda t: (True, 132))
    monkeypatch.setattr(pdl, "_enabled", True)


def test_one_wave_rule(hopper):
    # at most 32 programs and 64 warps per SM
    assert pdl.fits_one_wave(CUDA_TENSOR, 132 * 32, 1)
    assert not pdl.fits_one_wave(CUDA_TENSOR, 132 * 32 + 1, 1)
    assert pdl.fits_one_wave(CUDA_TENSOR, 132 * 16, 4)
    assert not pdl.fits_one_wave(CUDA_TENSOR, 132 * 16 + 1, 4)
    assert pdl.pdl_active(CUDA_TENSOR, 132 * 8, 8)
    assert not pdl.pdl_active(CUDA_TENSOR, 132 * 8 + 1, 8)


def test_pdl_launch_one_wave_triggers_early(hopper):
    assert pdl.pdl_launch(CUDA_TENSOR, 100, 4) == (True, True)


def test_pdl_launch_multi_wave_triggers_at_exit(hopper):
    assert pdl.pdl_launch(CUDA_TENSOR, 132 * 32 + 1, 1) == (True, False)
    assert not pdl.pdl_active(CUDA_TENSOR, 132 * 32 + 1, 1)  # the other ops launch those plainly


def test_pdl_launch_early_triggers_early_on_any_grid(hopper, monkeypatch):
    assert pdl.pdl_launch_early(CUDA_TENSOR) == (True, True)  # the grid's size does not enter
    assert pdl.pdl_launch_early(CPU_TENSOR) == (False, True)
    monkeypatch.setattr(pdl, "_device_sm_info", lambda t: (False, 108))  # an A100
    assert pdl.pdl_launch_early(CUDA_TENSOR)[0] is False
    monkeypatch.setattr(pdl, "_device_sm_info", lambda t: (True, 132))
    with pdl.programmatic_dependent_launch(False):
        assert pdl.pdl_launch_early(CUDA_TENSOR)[0] is False


def test_off_unless_switched_on_cuda_and_sm90(hopper, monkeypatch):
    assert pdl.pdl_launch(CPU_TENSOR, 1, 1) == (False, True)
    assert not pdl.pdl_active(CPU_TENSOR, 1, 1)
    monkeypatch.setattr(pdl, "_device_sm_info", lambda t: (False, 108))  # an A100
    assert pdl.pdl_launch(CUDA_TENSOR, 1, 1)[0] is False
    assert pdl.pdl_launch(CUDA_TENSOR, 10**6, 1)[0] is False
    monkeypatch.setattr(pdl, "_device_sm_info", lambda t: (True, 132))
    with pdl.programmatic_dependent_launch(False):
        assert pdl.pdl_launch(CUDA_TENSOR, 1, 1) == (False, True)
        assert not pdl.pdl_active(CUDA_TENSOR, 1, 1)


def test_chained_kernels_take_pdl_on_one_wave_grids_even_when_switched_off(hopper, monkeypatch):
    monkeypatch.setattr(pdl, "_enabled", False)
    assert not pdl.pdl_active(CUDA_TENSOR, 100, 4)  # an op's first kernel: plain
    assert pdl.pdl_chained(CUDA_TENSOR, 100, 4)  # the kernels after it in the same op
    assert pdl.pdl_chained(CUDA_TENSOR, 132 * 16, 4)
    assert not pdl.pdl_chained(CUDA_TENSOR, 132 * 16 + 1, 4)  # multi-wave grids launch plainly
    assert not pdl.pdl_chained(CPU_TENSOR, 1, 4)
    monkeypatch.setattr(pdl, "_device_sm_info", lambda t: (False, 108))  # an A100
    assert not pdl.pdl_chained(CUDA_TENSOR, 1, 4)
    monkeypatch.setattr(pdl, "_device_sm_info", lambda t: (True, 132))
    with pdl.programmatic_dependent_launch():
        assert pdl.pdl_chained(CUDA_TENSOR, 100, 4)
        assert not pdl.pdl_chained(CUDA_TENSOR, 132 * 16 + 1, 4)


def test_the_retired_experiment_switches_change_nothing(hopper, monkeypatch):
    """FASTMAMBA_PDL_WAVES / _TRIGGER / _CHAIN (issue 49) no longer exist: the policy is the one they
    defaulted to, whatever the environment holds when the module loads."""
    import importlib

    for name, value in (("FASTMAMBA_PDL_WAVES", "all"), ("FASTMAMBA_PDL_TRIGGER", "exit"), ("FASTMAMBA_PDL_CHAIN", "off")):
        monkeypatch.setenv(name, value)
    fresh = importlib.reload(pdl)
    try:
        monkeypatch.setattr(fresh, "_device_sm_info", lambda t: (True, 132))
        monkeypatch.setattr(fresh, "_enabled", True)
        assert not fresh.pdl_active(CUDA_TENSOR, 10**6, 8)  # multi-wave grids launch plainly
        assert fresh.TRIGGER_EARLY and fresh.pdl_launch_early(CUDA_TENSOR) == (True, True)
        monkeypatch.setattr(fresh, "_enabled", False)
        assert fresh.pdl_chained(CUDA_TENSOR, 100, 4)
    finally:
        monkeypatch.undo()
        importlib.reload(pdl)
