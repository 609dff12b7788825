"""Every public op refuses a non-tensor where a tensor goes with a TypeError that names the argument.

A list, a number or a numpy array passed as ``x`` (or as any other tensor argument) used to fail
deep inside with ``AttributeError: 'list' object has no attribute 'device'``, naming nothing. Each
case below is a valid small call (checked first: it must run), then the same call with one tensor
argument replaced by a list; the error must be a TypeError that names that argument, raised before
anything is written (the call's output and state buffers are compared before and after).
"""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops import (
    add_rmsnorm,
    causal_conv1d_fn,
    causal_conv1d_update,
    causal_conv1d_varlen,
    mamba_chunk_scan_combined,
    rmsnorm_fn,
    selective_state_update,
    ssd_scan_varlen,
)

T, H, P, G, N, D, W = 8, 2, 16, 1, 16, 32, 4


def _scan_dense():
    args = dict(x=torch.randn(1, T, H, P), dt=torch.rand(1, T, H), A=-torch.rand(H), B=torch.randn(1, T, G, N),
                C=torch.randn(1, T, G, N))
    kwargs = dict(D=torch.randn(H), z=torch.randn(1, T, H, P), dt_bias=torch.rand(H),
                  initial_states=torch.zeros(1, H, P, N))
    return mamba_chunk_scan_combined, args, dict(chunk_size=4, **kwargs), ()


def _scan_varlen():
    states = torch.zeros(2, H, P, N)
    args = dict(x=torch.randn(T, H, P), dt=torch.rand(T, H), A=-torch.rand(H), B=torch.randn(T, G, N),
                C=torch.randn(T, G, N), ssm_states=states, cu_seqlens=torch.tensor([0, 3, T], dtype=torch.int32))
    kwargs = dict(D=torch.randn(H), z=torch.randn(T, H, P), dt_bias=torch.rand(H),
                  cache_indices=torch.tensor([0, 1], dtype=torch.int32),
                  has_initial_state=torch.tensor([False, True]), out=torch.empty(T, H, P))
    return ssd_scan_varlen, args, dict(chunk_size=4, **kwargs), (states,)


def _conv_fn():
    args = dict(x=torch.randn(1, D, T), weight=torch.randn(D, W))
    return causal_conv1d_fn, args, dict(bias=torch.randn(D), initial_states=torch.randn(1, D, W - 1)), ()


def _conv_varlen():
    states = torch.zeros(2, D, W - 1)
    args = dict(x=torch.randn(T, D), weight=torch.randn(D, W), bias=torch.randn(D), conv_states=states,
                cu_seqlens=torch.tensor([0, 3, T], dtype=torch.int32))
    kwargs = dict(cache_indices=torch.tensor([0, 1], dtype=torch.int32),
                  has_initial_state=torch.tensor([False, True]), out=torch.empty(T, D))
    return causal_conv1d_varlen, args, kwargs, (states,)


def _conv_update():
    states = torch.zeros(2, D, W - 1)
    args = dict(x=torch.randn(2, D), conv_state=states, weight=torch.randn(D, W))
    kwargs = dict(bias=torch.randn(D), conv_state_indices=torch.tensor([1, 0], dtype=torch.int32))
    return causal_conv1d_update, args, kwargs, (states,)


def _state_update():
    states = torch.zeros(2, H, P, N)
    args = dict(state=states, x=torch.randn(2, H, P), dt=torch.rand(2, H, P), A=-torch.rand(H, P, N),
                B=torch.randn(2, G, N), C=torch.randn(2, G, N))
    kwargs = dict(D=torch.randn(H, P), z=torch.randn(2, H, P), dt_bias=torch.rand(H, P),
                  state_batch_indices=torch.tensor([1, 0], dtype=torch.int32))
    return selective_state_update, args, kwargs, (states,)


def _rmsnorm():
    args = dict(x=torch.randn(T, D), weight=torch.rand(D), bias=None)
    return rmsnorm_fn, args, dict(z=torch.randn(T, D), group_size=D // 2), ()


def _add_rmsnorm():
    args = dict(x=torch.randn(T, D), residual=torch.randn(T, D), weight=torch.rand(D))
    return add_rmsnorm, args, {}, ()


CASES = {
    "mamba_chunk_scan_combined": _scan_dense,
    "ssd_scan_varlen": _scan_varlen,
    "causal_conv1d_fn": _conv_fn,
    "causal_conv1d_varlen": _conv_varlen,
    "causal_conv1d_update": _conv_update,
    "selective_state_update": _state_update,
    "rmsnorm_fn": _rmsnorm,
    "add_rmsnorm": _add_rmsnorm,
}


def _tensor_args(case) -> list[str]:
    _, args, kwargs, _ = case()
    return [k for k, v in {**args, **kwargs}.items() if isinstance(v, torch.Tensor)]


PARAMS = [(op, name) for op, case in CASES.items() for name in _tensor_args(case)]


@pytest.mark.parametrize("op", list(CASES))
def test_the_valid_call_runs(op):
    fn, args, kwargs, _ = CASES[op]()
    fn(*args.values(), **kwargs)


@pytest.mark.parametrize("op,name", PARAMS, ids=[f"{op}-{name}" for op, name in PARAMS])
def test_a_list_for_a_tensor_is_a_type_error_naming_it(op, name):
    fn, args, kwargs, buffers = CASES[op]()
    before = [b.clone() for b in buffers]
    if name in args:
        args[name] = [1.0, 2.0]
    else:
        kwargs[name] = [1.0, 2.0]
    with pytest.raises(TypeError, match=f"`{name}`"):
        fn(*args.values(), **kwargs)
    for b, b0 in zip(buffers, before):
        assert torch.equal(b, b0), f"{op}: a state buffer was written before the error"
