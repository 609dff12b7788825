"""selective_state_update never writes outside its state pool (design decision 2).

(a) indices changed behind the version counter are still range-checked on the host: ValueError,
    pool untouched;
(b) inside ``trusted_inputs()`` (no host check) an index outside [0, S) acts as the pad slot: the
    pool is a view of the middle rows of a bigger tensor whose guard rows stay bit-identical;
(c) the reference path validates every index before it writes anything.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import fastmamba.ops.state_update.api as ssu_api
from fastmamba.ops import selective_state_update
from fastmamba.ops._common.host_values import trusted_inputs
from fastmamba.ops.state_update.ref import selective_state_update_ref
from tests.helpers import nan_like, tol
from tests.ops.state_update.test_state_update import BASE, make_inputs

GUARD = 4  # rows of the bigger tensor on each side of the pool


def _pooled(state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(big, pool): ``pool`` (a copy of ``state``) is the middle rows of ``big``, whose GUARD rows
    on either side hold random values."""
    big = torch.randn(state.shape[0] + 2 * GUARD, *state.shape[1:]).to(state.dtype)
    pool = big[GUARD:GUARD + state.shape[0]]
    pool.copy_(state)
    return big, pool


def _case(tokens: int):
    c = dataclasses.replace(BASE, tokens=tokens, slots="shuffled")
    state, args, kw = make_inputs(c, "cpu", seed=21)
    return c, state, args, kw


@pytest.fixture(params=["kernel", "reference"])
def path(request, monkeypatch):
    """The op's kernel path (the interpreter on the CPU) or its reference path."""
    if request.param == "reference":
        monkeypatch.setattr(ssu_api, "use_triton", lambda t: False)
    elif not ssu_api.use_triton(torch.empty(1)):
        pytest.skip("the kernel path needs TRITON_INTERPRET=1 on the CPU")
    return request.param


@pytest.mark.parametrize("change", ["data", "numpy"])
@pytest.mark.parametrize("name", ["state_batch_indices", "dst_state_batch_indices"])
def test_index_changed_behind_version_counter_is_refused(change, name, path):
    c, state, args, kw = _case(tokens=0)
    S = state.shape[0]
    valid = kw["state_batch_indices"].tolist()
    if change == "numpy":  # a tensor sharing memory with a numpy array
        arr = np.array(valid, dtype=np.int32)
        idx = torch.from_numpy(arr)
    else:
        idx = torch.tensor(valid, dtype=torch.int32)
    kw = dict(kw, state_batch_indices=idx) if name == "state_batch_indices" else dict(
        kw, dst_state_batch_indices=idx)
    selective_state_update(state, *args, **kw)  # a first call with valid indices (nothing cached)
    version = idx._version
    if change == "numpy":
        arr[0] = S + 3
    else:
        idx.data[0] = S + 3
    assert idx._version == version, "the change is meant to go unseen by the version counter"
    before = state.clone()
    with pytest.raises(ValueError, match=rf"selective_state_update: `{name}` values must lie in \[0, {S}\).*\[{S + 3}\]"):
        selective_state_update(state, *args, **kw)
    assert torch.equal(state, before)


@pytest.mark.parametrize("bad", ["S+1", "-3", "2**40"])
@pytest.mark.parametrize("name", ["state_batch_indices", "dst_state_batch_indices"])
@pytest.mark.parametrize("tokens", [0, 3], ids=["single-token", "T3"])
def test_trusted_out_of_range_index_writes_nothing_outside_the_pool(tokens, name, bad):
    """Kernel path (checks skipped): the out-of-range row acts like the pad slot; the other row
    is updated as the reference updates it; the guard rows around the pool are bit-identical."""
    if not ssu_api.use_triton(torch.empty(1)):
        pytest.skip("the kernel path needs TRITON_INTERPRET=1 on the CPU")
    c, state, args, kw = _case(tokens)
    S = state.shape[0]
    big, pool = _pooled(state)
    big_before = big.clone()
    value = {"S+1": S + 1, "-3": -3, "2**40": 2**40}[bad]
    good = kw["state_batch_indices"].tolist()
    idx = torch.tensor([good[0], value], dtype=torch.int64)
    pad = torch.tensor([good[0], -1], dtype=torch.int64)
    if name == "state_batch_indices":
        kw_bad, kw_ref = dict(kw, state_batch_indices=idx), dict(kw, state_batch_indices=pad)
    else:  # reads the right rows, would write the new state outside
        src = torch.tensor(good, dtype=torch.int64)
        kw_bad = dict(kw, state_batch_indices=src, dst_state_batch_indices=idx)
        kw_ref = dict(kw, state_batch_indices=src, dst_state_batch_indices=pad)
    out = nan_like(args[0])
    with trusted_inputs():
        selective_state_update(pool, *args, **kw_bad, out=out)
    ref_state = state.clone()
    y_ref = selective_state_update_ref(ref_state, *args, **kw_ref)
    assert torch.equal(big[:GUARD], big_before[:GUARD]) and torch.equal(big[GUARD + S:], big_before[GUARD + S:])
    torch.testing.assert_close(pool, ref_state, **tol(c.act))
    untouched = [s for s in range(S) if s != good[0]]
    assert torch.equal(pool[untouched], state[untouched])
    torch.testing.assert_close(out, y_ref, **tol(c.act))
    if name == "state_batch_indices":
        assert torch.equal(out[1], torch.zeros_like(out[1]))  # as a pad row


@pytest.mark.parametrize("name", ["state_batch_indices", "dst_state_batch_indices"])
def test_reference_validates_before_writing(name, monkeypatch):
    """The reference path, even inside trusted_inputs(): ValueError, and the valid first row is
    not written either (no partial writes)."""
    monkeypatch.setattr(ssu_api, "use_triton", lambda t: False)
    c, state, args, kw = _case(tokens=3)
    S = state.shape[0]
    big, pool = _pooled(state)
    big_before = big.clone()
    good = kw["state_batch_indices"].tolist()
    idx = torch.tensor([good[0], S + 3], dtype=torch.int32)
    kw = dict(kw, **{name: idx})
    for ctx in (trusted_inputs, lambda: torch.no_grad()):
        with ctx(), pytest.raises(ValueError, match=rf"`{name}` values must lie in \[0, {S}\)"):
            selective_state_update(pool, *args, **kw)
        assert torch.equal(big, big_before)
    with pytest.raises(ValueError, match=rf"selective_state_update_ref: `{name}`"):
        selective_state_update_ref(pool, *args, **dict(kw, **{name: torch.tensor([good[0], -3])}))
    assert torch.equal(big, big_before)


@pytest.mark.gpu
def test_gpu_graph_replay_with_out_of_range_slot_writes_nothing_outside_the_pool():
    """A captured graph never reads the indices on the host: a slot set out of range between
    replays acts as the pad slot in the kernel, and the guard rows stay bit-identical."""
    c = dataclasses.replace(BASE, batch=2, slots="shuffled")
    state, args, kw = make_inputs(c, "cuda", seed=22)
    S = state.shape[0]
    big = _pooled(state.cpu())[0].cuda()
    pool = big[GUARD:GUARD + S]
    idx = kw["state_batch_indices"].clone()
    kw = dict(kw, state_batch_indices=idx)
    out = torch.empty_like(args[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        selective_state_update(pool.clone(), *args, **kw, out=out)  # warm-up / compile
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        selective_state_update(pool, *args, **kw, out=out)
    big_before = big.clone()
    idx.fill_(S + 1)  # behind the graph's back
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(big, big_before)
    assert torch.equal(out, torch.zeros_like(out))
