"""causal_conv1d_varlen never writes outside its state pool, x or out (design decision 2).

Checked indices are read afresh every call, so a value changed behind the version counter still
raises before anything is written. Unchecked ones (``trusted_inputs()``; CUDA-graph capture and
torch.compile skip the same host reads) reach the kernel, which treats a slot outside [0, S) as a
pad slot and clamps cu_seqlens into [0, T]; the reference validates both before writing and raises.
The pool is a view of the middle rows of a bigger tensor so that a write outside it shows up in
guard rows compared bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fastmamba.ops._common.checks as checks_mod
import fastmamba.ops.conv1d_fn.api as conv1d_fn_api
from fastmamba.ops._common.host_values import trusted_inputs
from fastmamba.ops.conv1d_fn import causal_conv1d_varlen
from fastmamba.ops.conv1d_fn.ref import causal_conv1d_varlen_ref
from tests.helpers import nan_like, raises_now_or_at_next_call, seeded, tol

PAD = -1
GUARD = 2  # rows of the bigger tensor on each side of the pool / of x and out
LENS = (5, 9, 3)  # T = 17: two tiles for the second sequence (8-token tiles under the interpreter)
S, D, W = 4, 40, 4


@pytest.fixture(params=["kernel", "reference"])
def path(request, monkeypatch, device):
    """Run the public op on the Triton kernel (interpreter on CPU) or on the PyTorch reference."""
    if request.param == "reference":
        if device.type != "cpu":
            pytest.skip("the reference path is what CPU tensors run without the interpreter")
        monkeypatch.setattr(conv1d_fn_api, "use_triton", lambda t: False)
    elif device.type == "cpu" and not conv1d_fn_api.use_triton(torch.empty(0)):
        pytest.skip("the kernel path needs the interpreter on CPU")
    return request.param


def make(device: torch.device, seed: int = 0, idx_dtype: torch.dtype = torch.int32) -> dict:
    g = seeded(seed)
    T = sum(LENS)
    big = torch.randn(S + 2 * GUARD, D, W - 1, generator=g).to(device)
    x_big = torch.randn(T + 2 * GUARD, D, generator=g).to(device)
    return dict(
        big=big,
        x=x_big[GUARD : GUARD + T],
        weight=(torch.randn(D, W, generator=g) / W**0.5).to(device),
        bias=(0.1 * torch.randn(D, generator=g)).to(device),
        conv_states=big[GUARD : GUARD + S],
        cu_seqlens=torch.tensor([0, *np.cumsum(LENS).tolist()], dtype=idx_dtype, device=device),
        cache_indices=torch.tensor([3, 0, 1], dtype=idx_dtype, device=device),
        has_initial_state=torch.tensor([True, False, True], device=device),
    )


def run(inp: dict, **kw) -> torch.Tensor:
    args = {k: v for k, v in inp.items() if k != "big"}
    return causal_conv1d_varlen(**args, activation="silu", **kw)


@pytest.mark.parametrize("how", ["data", "numpy"])
def test_indices_changed_behind_the_version_counter_raise(how: str, path: str, device):
    """A first call reads the indices; then they change without a version bump: the next call
    reads them again and raises, touching nothing."""
    inp = make(device)
    if how == "numpy":
        if device.type != "cpu":
            pytest.skip("a tensor sharing memory with a numpy array lives on the CPU")
        arr = np.array([3, 0, 1], dtype=np.int32)
        inp["cache_indices"] = torch.from_numpy(arr)
    run(inp)
    version = inp["cache_indices"]._version
    if how == "data":
        inp["cache_indices"].data[0] = S + 3
    else:
        arr[0] = S + 3
    assert inp["cache_indices"]._version == version  # the change is invisible to the version counter
    big_before = inp["big"].clone()
    raises_now_or_at_next_call(device, lambda: run(inp),
                               r"causal_conv1d_varlen: `cache_indices` values must lie in \[0, 4\)")
    assert torch.equal(inp["big"], big_before)


@pytest.mark.parametrize("bad", [S, S + 3, -5, -(2**31)], ids=["S", "S+3", "-5", "int32-min"])
def test_trusted_out_of_range_slot_acts_as_pad(bad: int, path: str, device):
    """Inside trusted_inputs() (no host check) a slot outside [0, S) is a pad slot on the kernel
    path: its sequence gets zeros, no row outside the pool changes, the other sequences are right.
    The reference path validates before writing and raises; nothing changes."""
    inp = make(device)
    inp["cache_indices"][1] = bad
    big_before = inp["big"].clone()
    out = nan_like(torch.empty_like(inp["x"]))
    if path == "reference":
        with trusted_inputs(), pytest.raises(ValueError, match="`cache_indices` values must lie in"):
            run(inp, out=out)
        assert torch.equal(inp["big"], big_before)
        assert out.isnan().all()
        return
    with trusted_inputs():
        y = run(inp, out=out)
    assert torch.equal(inp["big"][:GUARD], big_before[:GUARD])
    assert torch.equal(inp["big"][GUARD + S :], big_before[GUARD + S :])
    # = the same call with that sequence padded
    want_states = big_before[GUARD : GUARD + S].clone()
    args = {k: v for k, v in inp.items() if k not in ("big", "conv_states", "cache_indices")}
    idx = inp["cache_indices"].clone()
    idx[1] = PAD
    y_ref = causal_conv1d_varlen_ref(**args, conv_states=want_states, cache_indices=idx, activation="silu")
    torch.testing.assert_close(y, y_ref, **tol(torch.float32))
    assert (y[LENS[0] : LENS[0] + LENS[1]] == 0).all()
    assert torch.equal(inp["conv_states"], want_states)


@pytest.mark.parametrize(
    "cu", [[0, 5, 40, 17], [0, 14, 5, 17], [-30, 5, 14, 17], [0, 5, 14, 60]],
    ids=["past-T", "decreasing", "negative-start", "end-past-T"],
)
def test_trusted_bad_cu_seqlens_stay_inside_the_tensors(cu: list[int], path: str, device):
    """Unchecked cu_seqlens may give wrong outputs, but no write outside out and the pool (the
    kernel clamps the token ranges into [0, T]); the reference raises before writing."""
    inp = make(device)
    inp["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=device)
    T = sum(LENS)
    out_big = torch.full((T + 2 * GUARD, D), 7.0, device=device)
    out = out_big[GUARD : GUARD + T]
    out_before, big_before = out_big.clone(), inp["big"].clone()
    if path == "reference":
        with trusted_inputs(), pytest.raises(ValueError, match="`cu_seqlens` expected to start at 0"):
            run(inp, out=out)
        assert torch.equal(out_big, out_before) and torch.equal(inp["big"], big_before)
        return
    with trusted_inputs():
        run(inp, out=out)
    assert torch.equal(out_big[:GUARD], out_before[:GUARD]) and torch.equal(out_big[GUARD + T :], out_before[GUARD + T :])
    assert torch.equal(inp["big"][:GUARD], big_before[:GUARD])
    assert torch.equal(inp["big"][GUARD + S :], big_before[GUARD + S :])


def test_reference_validates_before_writing(device):
    """The reference raises on a bad slot before it writes the valid sequences' rows."""
    inp = make(device)
    inp["cache_indices"][2] = S + 1  # the last sequence: the two before it are valid
    big_before = inp["big"].clone()
    args = {k: v for k, v in inp.items() if k != "big"}
    with pytest.raises(ValueError, match=r"`cache_indices` values must lie in \[0, 4\).*got \[5\]"):
        causal_conv1d_varlen_ref(**args, activation="silu")
    assert torch.equal(inp["big"], big_before)


def test_trusted_reads_nothing_on_the_host(path: str, monkeypatch, device):
    """Inside trusted_inputs() the op reads no index value on the host (no tolist, item, int or
    host_list), and still equals the checked call."""
    if path == "reference":
        pytest.skip("the reference reads the indices on the host by design (CPU only)")
    inp = make(device)
    states_checked = inp["conv_states"].clone()
    y_checked = run({**inp, "conv_states": states_checked})

    def no_read(*args, **kwargs):
        raise AssertionError("host read of an index tensor inside trusted_inputs()")

    for mod in (conv1d_fn_api, checks_mod):
        monkeypatch.setattr(mod, "host_list", no_read)
    for name in ("tolist", "item", "__int__", "__index__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, no_read)
    with trusted_inputs():
        y = run(inp)
    monkeypatch.undo()
    assert torch.equal(y, y_checked)
    assert torch.equal(inp["conv_states"], states_checked)
