"""The conv launchers' host path: the launch plan (config, ALIGN, grid) is computed once per call
shape and reused; a new shape or a forced tuning config gets its own plan (issue 19 item 0)."""
from __future__ import annotations

import torch

from fastmamba.ops.conv1d_fn import causal_conv1d_fn, causal_conv1d_varlen, configs
from fastmamba.ops.conv1d_fn import kernel as conv_kernel
from fastmamba.ops.conv1d_fn import varlen_kernel
from fastmamba.ops.conv1d_fn.ref import causal_conv1d_fn_ref, causal_conv1d_varlen_ref
from tests.helpers import tol


def counting(monkeypatch, name: str, module=conv_kernel) -> list:
    calls = []
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return calls


def test_fn_plan_is_cached_per_shape(monkeypatch, device):
    calls = counting(monkeypatch, "pick_rows_config")
    w = torch.randn(40, 4, device=device)
    for L in (9, 9, 5, 9):
        x = torch.randn(1, L, 40, device=device).transpose(1, 2)
        torch.testing.assert_close(causal_conv1d_fn(x, w), causal_conv1d_fn_ref(x, w), **tol(torch.float32))
    assert len(calls) == 2  # L=9 once, L=5 once
    with configs.forced_config(16, 64, 1):  # the tuning hook is part of the key
        x = torch.randn(1, 9, 40, device=device).transpose(1, 2)
        torch.testing.assert_close(causal_conv1d_fn(x, w), causal_conv1d_fn_ref(x, w), **tol(torch.float32))
    assert len(calls) == 3
    assert any(key[-1] == configs.ConvFnConfig(16, 64, 1) for key in conv_kernel._fn_plans)


def test_varlen_plan_is_cached_per_shape(monkeypatch, device):
    calls = counting(monkeypatch, "pick_rows_config", varlen_kernel)
    w = torch.randn(40, 4, device=device)
    x = torch.randn(10, 40, device=device)
    for cu in ([0, 4, 10], [0, 7, 10], [0, 10, 10]):  # same shapes, other values: one plan
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        s_op, s_ref = torch.randn(2, 40, 3, device=device).repeat(2, 1, 1).chunk(2)
        s_op, s_ref = s_op.clone(), s_ref.clone()
        y = causal_conv1d_varlen(x, w, None, s_op, cu_t)
        torch.testing.assert_close(y, causal_conv1d_varlen_ref(x, w, None, s_ref, cu_t), **tol(torch.float32))
        assert torch.equal(s_op, s_ref)
    assert len(calls) == 1
