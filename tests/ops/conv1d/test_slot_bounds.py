"""causal_conv1d_update never writes outside its state pool (design decision 2).

(a) indices changed behind the version counter are still range-checked on the host: ValueError,
    pool untouched;
(b) inside ``trusted_inputs()`` (no host check) an index outside [0, S) acts as the pad slot, in
    each of the three kernels (columns, 16-byte rows, vec4) and each mode: the pool is a view of the
    middle rows of a bigger tensor whose guard rows stay bit-identical;
(c) the reference path validates every index before it writes anything.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import fastmamba.ops.conv1d.api as conv1d_api
from fastmamba.ops._common.host_values import trusted_inputs
from fastmamba.ops.conv1d import causal_conv1d_update
from fastmamba.ops.conv1d.ref import causal_conv1d_update_ref
from tests.helpers import nan_like, tol
from tests.ops.conv1d.test_conv1d_update import BASE, make_inputs

GUARD = 4

KERNELS = {
    "columns": BASE,  # fp32 state, state_len 3
    "rows": dataclasses.replace(BASE, dtype=torch.bfloat16, state_dtype=torch.bfloat16),  # 16-bit, state_len 3
    "vec4": dataclasses.replace(BASE, extra_state=1),  # state_len 4, contiguous rows
    "circular": dataclasses.replace(BASE, mode="circular", L=2),
    "accepted": dataclasses.replace(BASE, mode="accepted", L=2, extra_state=2),
}


def _split(inp: dict):
    kw = dict(inp)
    return kw.pop("x"), kw.pop("conv_state"), kw.pop("weight"), kw.pop("bias"), kw


def _pooled(state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    big = torch.randn(state.shape[0] + 2 * GUARD, *state.shape[1:]).to(state.dtype)
    pool = big[GUARD:GUARD + state.shape[0]]
    pool.copy_(state)
    return big, pool


def _kernel_path_only():
    if not conv1d_api.use_triton(torch.empty(1)):
        pytest.skip("the kernel path needs TRITON_INTERPRET=1 on the CPU")


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "reference"])
@pytest.mark.parametrize("change", ["data", "numpy"])
def test_index_changed_behind_version_counter_is_refused(change, reference, monkeypatch):
    if reference:
        monkeypatch.setattr(conv1d_api, "use_triton", lambda t: False)
    else:
        _kernel_path_only()
    x, state, weight, bias, kw = _split(make_inputs(BASE, "cpu", seed=31))
    S = state.shape[0]
    arr = kw["conv_state_indices"].numpy().copy()
    idx = torch.from_numpy(arr) if change == "numpy" else torch.tensor(arr)
    kw["conv_state_indices"] = idx
    causal_conv1d_update(x, state, weight, bias, **kw)  # valid indices first (nothing cached)
    version = idx._version
    if change == "numpy":
        arr[0] = S + 3
    else:
        idx.data[0] = S + 3
    assert idx._version == version
    before = state.clone()
    with pytest.raises(ValueError, match=rf"causal_conv1d_update: `conv_state_indices` values must lie in \[0, {S}\).*\[{S + 3}\]"):
        causal_conv1d_update(x, state, weight, bias, **kw)
    assert torch.equal(state, before)


@pytest.mark.parametrize("bad", ["S+1", "-3", "2**40"])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_trusted_out_of_range_index_writes_nothing_outside_the_pool(kernel, bad):
    _kernel_path_only()
    case = KERNELS[kernel]
    x, state, weight, bias, kw = _split(make_inputs(case, "cpu", seed=32))
    S = state.shape[0]
    big, pool = _pooled(state)
    big_before = big.clone()
    value = {"S+1": S + 1, "-3": -3, "2**40": 2**40}[bad]
    idx = kw["conv_state_indices"].long()
    live = int(idx[0])
    idx[1] = value  # row 1 is the pad row of the base case: now out of range instead
    out = nan_like(x)
    with trusted_inputs():
        causal_conv1d_update(x, pool, weight, bias, **dict(kw, conv_state_indices=idx), out=out)
    ref_state = state.clone()
    y_ref = causal_conv1d_update_ref(x, ref_state, weight, bias, **kw)  # row 1 padded
    assert torch.equal(big[:GUARD], big_before[:GUARD]) and torch.equal(big[GUARD + S:], big_before[GUARD + S:])
    torch.testing.assert_close(out.float(), y_ref.float(), **tol(case.dtype))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(pool.float(), ref_state.float(), **tol(case.state_dtype))
    untouched = [s for s in range(S) if s not in idx.tolist()]
    assert torch.equal(pool[untouched], state[untouched])
    assert not torch.equal(pool[live], state[live])  # the live rows were written


def test_reference_validates_before_writing(monkeypatch):
    """Reference path, even inside trusted_inputs(): ValueError before any row is written."""
    monkeypatch.setattr(conv1d_api, "use_triton", lambda t: False)
    x, state, weight, bias, kw = _split(make_inputs(BASE, "cpu", seed=33))
    S = state.shape[0]
    big, pool = _pooled(state)
    big_before = big.clone()
    idx = kw["conv_state_indices"].clone()
    idx[1] = S + 3  # row 0 is valid and comes first
    with trusted_inputs(), pytest.raises(ValueError, match=rf"`conv_state_indices` values must lie in \[0, {S}\)"):
        causal_conv1d_update(x, pool, weight, bias, **dict(kw, conv_state_indices=idx))
    assert torch.equal(big, big_before)
    idx[1] = -3
    with pytest.raises(ValueError, match=r"causal_conv1d_update_ref: `conv_state_indices`.*\[-3\]"):
        causal_conv1d_update_ref(x, pool, weight, bias, **dict(kw, conv_state_indices=idx))
    assert torch.equal(big, big_before)
