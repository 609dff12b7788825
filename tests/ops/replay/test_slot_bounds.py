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

import fastmamba.ops._common.checks as checks
import fastmamba.ops.replay.api as replay_api
import fastmamba.ops.replay.cache as replay_cache
from fastmamba.ops import ReplayCache, replay_selective_state_update
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


# (d) eager calls on GPU tensors check their slots (and commit's accepted counts) on the device: no
# synchronize; a bad row is skipped and the op's next call raises (ops/_common/slot_errors.py). On
# the CPU the same path runs under the interpreter with DEVICE_CHECK_CPU on.

def _device_checked(monkeypatch, device):
    if device.type != "cuda":
        _kernel_path_only()
        monkeypatch.setattr(replay_api, "DEVICE_CHECK_CPU", True)


def test_device_checked_slots_skip_the_row_and_the_next_call_raises(monkeypatch, device):
    _device_checked(monkeypatch, device)
    cache, inp, slots = make_inputs(BASE, device, seed=44)
    S = cache.state.shape[0]
    bigs, pooled = _pooled(_clone(cache)) if device.type == "cpu" else (None, _clone(cache))
    before = _guards(bigs) if bigs else None
    idx = inp["state_batch_indices"].clone()
    idx[2] = S + 1  # the base case's pad row gets an out-of-range slot
    ref = _clone(cache)
    y_ref = replay_selective_state_update_ref(*[t.cpu() for t in ref], **{k: v.cpu() if isinstance(v, torch.Tensor)
                                                                       else v for k, v in inp.items()})
    out = nan_like(inp["x"])
    reads = []
    for module in (checks, replay_cache):
        monkeypatch.setattr(module, "host_list", lambda t, real=module.host_list: reads.append(t) or real(t))
    replay_selective_state_update(*pooled, **dict(inp, state_batch_indices=idx), out=out)
    assert reads == []  # checked on the device
    if device.type == "cuda":
        torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), y_ref, **tol(BASE.act))
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    if bigs:
        assert _guards_equal(bigs, before)
    state_after = pooled.state.clone()
    with pytest.raises(ValueError, match=rf"replay_selective_state_update: `state_batch_indices` values must lie in "
                                         rf"\[0, {S}\).*an earlier call.*\[{S + 1}\].*row was skipped"):
        replay_selective_state_update(*pooled, **inp)
    assert torch.equal(pooled.state, state_after)  # raised before launching

    pooled.commit(idx, torch.tensor([1, 2, 3], dtype=torch.int32, device=device), BASE.tokens)  # row 2 skipped
    if device.type == "cuda":
        torch.cuda.synchronize()
    with pytest.raises(ValueError, match=rf"commit_accepted: `slots` values must lie in \[0, {S}\).*\[{S + 1}\]"):
        pooled.commit(inp["state_batch_indices"], torch.ones(3, dtype=torch.int32, device=device), BASE.tokens)
    assert pooled.prev_accepted[idx[:2].long()].tolist() == [1, 2]  # the two live rows were committed

    good = inp["state_batch_indices"]
    too_many = torch.tensor([BASE.tokens + 1, 0, 0], dtype=torch.int32, device=device)
    kept = pooled.prev_accepted.clone()
    pooled.commit(good, too_many, BASE.tokens)  # row 0 skipped, rows 1 (and the pad row) committed
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert pooled.prev_accepted[good[0]] == kept[good[0]]
    with pytest.raises(ValueError, match=rf"commit_accepted: `accepted` values must lie in \[0, {BASE.tokens}\].*"
                                         rf"\[{BASE.tokens + 1}\]"):
        pooled.commit(good, torch.ones(3, dtype=torch.int32, device=device), BASE.tokens)

    pooled.flush(idx)  # the out-of-range slot skipped
    if device.type == "cuda":
        torch.cuda.synchronize()
    with pytest.raises(ValueError, match=rf"flush_replay_cache: `slots` values must lie in \[0, {S}\).*\[{S + 1}\]"):
        pooled.flush(good)
    if bigs:
        assert _guards_equal(bigs, before)
    pooled.flush(good)  # reported once


@pytest.mark.gpu
def test_gpu_replay_ops_never_synchronize():
    device = torch.device("cuda")
    cache, inp, slots = make_inputs(BASE, device, seed=45)
    idx, accepted = inp["state_batch_indices"], torch.tensor([1, 2, 3], dtype=torch.int32, device=device)
    for _ in range(2):  # compile
        replay_selective_state_update(*cache, **inp)
        cache.commit(idx, accepted, BASE.tokens)
        cache.flush(idx)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        replay_selective_state_update(*cache, **inp)
        cache.commit(idx, accepted, BASE.tokens)
        cache.flush(idx)
    finally:
        torch.cuda.set_sync_debug_mode("default")
