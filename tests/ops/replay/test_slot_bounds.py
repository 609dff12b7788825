"""The replay op, commit_accepted and flush_replay_cache never write outside the cache (design
decision 2).

(a) slot indices changed behind the version counter are still range-checked on the host:
    ValueError, cache untouched;
(b) inside ``trusted_inputs()`` (no host check) a slot outside [0, S) acts as the pad slot: every
    per-slot buffer is a view of the middle rows (along its S axis) of a bigger tensor whose guard
    rows stay bit-identical;
(c) the reference path validates every index before it writes anything.
"""
from __future__ import annotations

import pytest
import torch

import fastmamba.ops.replay.api as replay_api
from fastmamba.ops import ReplayCache, commit_accepted, flush_replay_cache, replay_selective_state_update
from fastmamba.ops._common.host_values import trusted_inputs
from fastmamba.ops.replay.ref import commit_accepted_ref, flush_ref, replay_selective_state_update_ref
from tests.helpers import nan_like, tol
from tests.ops.replay.test_replay import BASE, _bits, _clone, kernel_path, make_inputs

GUARD = 3
S_AXIS = {"old_B": 1, "old_dt": 1, "old_cumA": 1}  # the other fields have S first


def _pooled(cache: ReplayCache) -> tuple[list[torch.Tensor], ReplayCache]:
    """(bigs, pooled): each field of ``pooled`` (a copy of ``cache``'s) is the middle of a bigger
    tensor along its S axis, with GUARD random rows on either side."""
    bigs, views = [], []
    for name, t in zip(ReplayCache._fields, cache):
        ax = S_AXIS.get(name, 0)
        shape = list(t.shape)
        shape[ax] += 2 * GUARD
        big = (torch.randint(0, 2, shape) if not t.dtype.is_floating_point else torch.randn(shape)).to(t.dtype)
        view = big.narrow(ax, GUARD, t.shape[ax])
        view.copy_(t)
        bigs.append(big)
        views.append(view)
    return bigs, ReplayCache(*views)


def _guards(bigs: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for name, big in zip(ReplayCache._fields, bigs):
        ax = S_AXIS.get(name, 0)
        n = big.shape[ax]
        out += [_bits(big.narrow(ax, 0, GUARD)).clone(), _bits(big.narrow(ax, n - GUARD, GUARD)).clone()]
    return out


def _guards_equal(bigs, before) -> bool:
    return all(torch.equal(a, b) for a, b in zip(_guards(bigs), before))


def _kernel_path_only():
    if not replay_api.use_triton(torch.empty(1)):
        pytest.skip("the kernel path needs TRITON_INTERPRET=1 on the CPU")


def test_index_changed_behind_version_counter_is_refused():
    cache, inp, slots = make_inputs(BASE, "cpu", seed=41)
    S = cache.state.shape[0]
    idx = inp["state_batch_indices"]
    before = _clone(cache)
    idx.data[0] = S + 3
    with pytest.raises(ValueError, match=rf"replay_selective_state_update: `state_batch_indices` values must lie in \[0, {S}\)"):
        replay_selective_state_update(*cache, **inp)
    with pytest.raises(ValueError, match=r"commit_accepted: `slots` values"):
        cache.commit(idx, torch.ones(3, dtype=torch.int32), BASE.tokens)
    with pytest.raises(ValueError, match=r"flush_replay_cache: `slots` values"):
        cache.flush(idx)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(cache, before))


@pytest.mark.parametrize("bad", ["S+1", "-3"])
@pytest.mark.parametrize("path", ["auto", "split"])
def test_trusted_out_of_range_slot_writes_nothing_outside_the_cache(path, bad):
    """Kernel path: request 2 (the base case's pad row) gets an out-of-range slot; it acts as the
    pad row, the others match the reference; then commit and flush with the same slots."""
    _kernel_path_only()
    cache, inp, slots = make_inputs(BASE, "cpu", seed=42)
    S = cache.state.shape[0]
    bigs, pooled = _pooled(cache)
    before = _guards(bigs)
    idx = inp["state_batch_indices"].clone()
    idx[2] = {"S+1": S + 1, "-3": -3}[bad]
    ref = _clone(cache)
    y_ref = replay_selective_state_update_ref(*ref, **inp)  # row 2 padded
    out = nan_like(inp["x"])
    with trusted_inputs(), kernel_path(path, "cpu"):
        replay_selective_state_update(*pooled, **dict(inp, state_batch_indices=idx), out=out)
    assert _guards_equal(bigs, before)
    torch.testing.assert_close(out, y_ref, **tol(BASE.act))
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    torch.testing.assert_close(pooled.state, ref.state, **tol(BASE.act))
    assert torch.equal(_bits(pooled.old_x), _bits(ref.old_x))

    accepted = torch.tensor([1, 2, 3], dtype=torch.int32)
    with trusted_inputs():
        pooled.commit(idx, accepted, BASE.tokens)
        pooled.flush(idx)
    commit_accepted_ref(ref.buf_idx, ref.prev_accepted, ref.hist_len, inp["state_batch_indices"], accepted,
                        tokens=BASE.tokens, history=BASE.history)
    flush_ref(*ref, inp["state_batch_indices"])
    assert _guards_equal(bigs, before)
    for name in ("buf_idx", "prev_accepted", "hist_len"):
        assert torch.equal(getattr(pooled, name), getattr(ref, name)), name
    torch.testing.assert_close(pooled.state, ref.state, **tol(BASE.act))


def test_reference_validates_before_writing(monkeypatch):
    """Reference path, even inside trusted_inputs(): ValueError before any row is written (the
    first request's slot is valid)."""
    monkeypatch.setattr(replay_api, "use_triton", lambda t: False)
    cache, inp, slots = make_inputs(BASE, "cpu", seed=43)
    S = cache.state.shape[0]
    bigs, pooled = _pooled(cache)
    snapshot = [_bits(b).clone() for b in bigs]
    idx = inp["state_batch_indices"].clone()
    idx[2] = S + 3
    with trusted_inputs(), pytest.raises(ValueError, match=rf"`state_batch_indices` values must lie in \[0, {S}\)"):
        replay_selective_state_update(*pooled, **dict(inp, state_batch_indices=idx))
    idx[2] = -3
    with pytest.raises(ValueError, match=r"commit_accepted_ref: `slots`.*\[-3\]"):
        commit_accepted_ref(pooled.buf_idx, pooled.prev_accepted, pooled.hist_len, idx,
                            torch.ones(3, dtype=torch.int32), tokens=BASE.tokens, history=BASE.history)
    with pytest.raises(ValueError, match=r"flush_ref: `slots`.*\[-3\]"):
        flush_ref(*pooled, idx)
    assert all(torch.equal(_bits(b), s) for b, s in zip(bigs, snapshot))
