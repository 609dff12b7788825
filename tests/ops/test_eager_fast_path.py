"""The lean eager path of the decode ops (issue 19 item 0): a call whose signature (shapes, strides,
dtypes, devices, flags) an earlier call validated skips the checks and launches from a cached plan.
It must give the same answer as the checked path with fresh values, still check the slot values
on every call, and a changed signature must go through every check again."""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops import causal_conv1d_update, selective_state_update
from fastmamba.ops.conv1d import api as conv1d_api
from fastmamba.ops.conv1d.ref import causal_conv1d_update_ref
from fastmamba.ops.state_update import api as ssu_api
from fastmamba.ops.state_update.ref import selective_state_update_ref

H, P, N, G, S = 3, 16, 16, 1, 6  # odd head count


def _ssu_inputs(device, seed, B=2, state_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(device)

    A = -torch.rand(H, generator=g).to(device) - 0.5
    dt_bias = r(H, scale=0.1)
    return dict(
        state=r(S, H, P, N, scale=0.5).to(state_dtype), x=r(B, H, P), dt=r(B, H, scale=0.5).unsqueeze(-1).expand(B, H, P),
        A=A[:, None, None].expand(H, P, N), B=r(B, G, N, scale=0.3), C=r(B, G, N, scale=0.3), D=r(H)[:, None].expand(H, P),
        z=r(B, H, P), dt_bias=dt_bias[:, None].expand(H, P),
        idx=torch.randperm(S, generator=g)[:B].to(device=device, dtype=torch.int32),
    )


def _ssu_call(fn, i, idx=None):
    return fn(i["state"], i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["z"], i["dt_bias"], True,
              i["idx"] if idx is None else idx)


def _no_checks(monkeypatch, module, names):
    def boom(*a, **k):
        raise AssertionError("the fast path ran a check it should have skipped")

    for name in names:
        monkeypatch.setattr(module, name, boom)


def test_ssu_repeat_calls_skip_checks_and_match_reference(device, monkeypatch):
    first = _ssu_inputs(device, 0)
    want_state = first["state"].clone()
    want = _ssu_call(lambda s, *a: selective_state_update_ref(want_state, *a), first)
    got = _ssu_call(selective_state_update, first)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(first["state"], want_state, atol=1e-4, rtol=1e-4)
    if device.type != "cuda" and not ssu_api.use_triton(first["x"]):
        pytest.skip("no Triton path on this CPU (TRITON_INTERPRET unset): nothing is planned")
    assert len(ssu_api._PLANS) == 1
    # same signature, fresh values, the shape checks made to fail if they ran
    _no_checks(monkeypatch, ssu_api, ["check_shape", "check_tensors", "check_same_device", "check_indices"])
    second = _ssu_inputs(device, 1)
    want_state = second["state"].clone()
    want = _ssu_call(lambda s, *a: selective_state_update_ref(want_state, *a), second)
    got = _ssu_call(selective_state_update, second)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(second["state"], want_state, atol=1e-4, rtol=1e-4)
    # the pad slot keeps working on the fast path: zero output, no state touched
    third = _ssu_inputs(device, 2)
    before = third["state"].clone()
    pad = torch.tensor([third["idx"][0].item(), -1], dtype=torch.int32, device=device)
    y = _ssu_call(selective_state_update, third, idx=pad)
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    untouched = [s for s in range(S) if s != pad[0].item()]
    assert torch.equal(third["state"][untouched], before[untouched])


def _guarded_pool(state, extra=8):
    """``state`` copied into the first S rows of a larger buffer: the rows after it are a guard that
    shows any write outside the pool (slot S + k lands in guard row k)."""
    big = torch.randn(state.shape[0] + extra, *state.shape[1:]).to(device=state.device, dtype=state.dtype)
    big[: state.shape[0]] = state
    return big, big[: state.shape[0]]


def _skip_without_kernel_path(device, api, device_check_cpu):
    if device_check_cpu and device.type != "cuda" and not api.use_triton(torch.empty(1)):
        pytest.skip("the device check runs in the kernel: TRITON_INTERPRET=1 on the CPU")


@pytest.mark.parametrize("device_check_cpu", [False, True], ids=["cpu-host-check", "device-check"])
def test_ssu_fast_path_still_checks_slot_values(device, monkeypatch, device_check_cpu):
    """A bad slot value on a cached signature. Indices read on the host (CPU ones): ValueError at
    that call, nothing written. Indices left to the kernel (CUDA ones; on the CPU with the switch
    on): that call skips the row (y row zero, nothing written outside the pool, the good row exact),
    and the op's next call raises the ValueError naming the argument and the value, before it
    launches; the call after that runs."""
    _skip_without_kernel_path(device, ssu_api, device_check_cpu)
    monkeypatch.setattr(ssu_api, "DEVICE_CHECK_CPU", device_check_cpu)
    i = _ssu_inputs(device, 0)
    big, i["state"] = _guarded_pool(i["state"])
    _ssu_call(selective_state_update, i)  # the first call of the signature: checked on the host
    before, big_before = i["state"].clone(), big.clone()
    bad = torch.tensor([1, S + 2], dtype=torch.int32, device=device)
    msg = rf"selective_state_update: `state_batch_indices` values must lie in \[0, {S}\).*\[{S + 2}\]"
    if not ssu_api._device_check(bad):
        with pytest.raises(ValueError, match=msg):
            _ssu_call(selective_state_update, i, idx=bad)
        assert torch.equal(big, big_before)
        return
    want_state = before.clone()
    pad = torch.tensor([1, -1], dtype=torch.int32, device=device)
    want = _ssu_call(lambda s, *a: selective_state_update_ref(want_state, *a), i, idx=pad)
    y = _ssu_call(selective_state_update, i, idx=bad)  # lean path: no host read, so no error yet
    if device.type == "cuda":
        torch.cuda.synchronize()  # the record is written when the kernel runs
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)  # row 1 (the bad one) is zero, as a pad row
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    torch.testing.assert_close(i["state"], want_state, atol=1e-4, rtol=1e-4)
    assert torch.equal(big[S:], big_before[S:])  # nothing written outside the pool
    after_bad = big.clone()
    with pytest.raises(ValueError, match=msg + r".*reported at this call.*nothing was written outside the pool"):
        _ssu_call(selective_state_update, i)
    assert torch.equal(big, after_bad)  # raised before launching
    _ssu_call(selective_state_update, i)  # reported once: the next call runs
    from fastmamba.ops import raise_pending_slot_errors
    raise_pending_slot_errors()  # nothing left


def test_ssu_changed_signature_is_checked_again(device):
    i = _ssu_inputs(device, 0)
    _ssu_call(selective_state_update, i)
    i["z"] = i["z"].to(torch.float16)  # z must match x's dtype
    with pytest.raises(TypeError, match="selective_state_update: `z` has dtype float16 but `x` has float32"):
        _ssu_call(selective_state_update, i)
    j = _ssu_inputs(device, 0)
    j["C"] = j["C"][:, :, : N - 1]
    with pytest.raises(ValueError, match="selective_state_update: `C` expected shape"):
        _ssu_call(selective_state_update, j)
    with pytest.raises(TypeError, match="pad_slot_id"):  # a float pad id never takes the fast path
        selective_state_update(i["state"], i["x"], i["dt"], i["A"], i["B"], i["C"], pad_slot_id=-1.0)


def _conv_inputs(device, seed, B=3, D=40, W=4):
    g = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(B, D, generator=g).to(device), state=torch.randn(S, D, W - 1, generator=g).to(device),
        weight=(torch.randn(D, W, generator=g) * 0.5).to(device), bias=(torch.randn(D, generator=g) * 0.1).to(device),
        idx=torch.randperm(S, generator=g)[:B].to(device=device, dtype=torch.int32),
    )


def _conv_call(fn, i, state, idx=None):
    return fn(i["x"], state, i["weight"], i["bias"], "silu", None, i["idx"] if idx is None else idx)


def test_conv_repeat_calls_skip_checks_and_match_reference(device, monkeypatch):
    for seed in (0, 1):
        i = _conv_inputs(device, seed)
        want_state = i["state"].clone()
        want = _conv_call(causal_conv1d_update_ref, i, want_state)
        got = _conv_call(causal_conv1d_update, i, i["state"])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(i["state"], want_state)  # data movement: exact
        if seed == 0:
            if device.type != "cuda" and not conv1d_api.use_triton(i["x"]):
                pytest.skip("no Triton path on this CPU (TRITON_INTERPRET unset): nothing is planned")
            assert len(conv1d_api._PLANS) == 1
            _no_checks(monkeypatch, conv1d_api, ["_check_inputs", "check_tensors", "parse_activation"])


@pytest.mark.parametrize("device_check_cpu", [False, True], ids=["cpu-host-check", "device-check"])
def test_conv_fast_path_still_checks_slot_values_and_changed_signatures(device, monkeypatch, device_check_cpu):
    """As the SSU test above: a bad slot value on a cached signature raises at that call (host-read
    indices) or at the op's next call (kernel-checked indices: CUDA ones), never writing outside
    the pool; a changed signature goes through every check again."""
    _skip_without_kernel_path(device, conv1d_api, device_check_cpu)
    monkeypatch.setattr(conv1d_api, "DEVICE_CHECK_CPU", device_check_cpu)
    i = _conv_inputs(device, 0)
    big, i["state"] = _guarded_pool(i["state"])
    _conv_call(causal_conv1d_update, i, i["state"])
    before, big_before = i["state"].clone(), big.clone()
    bad = torch.tensor([0, S, 1], dtype=torch.int32, device=device)
    msg = rf"causal_conv1d_update: `conv_state_indices` values must lie in \[0, {S}\).*\[{S}\]"
    if not conv1d_api._device_check(bad):
        with pytest.raises(ValueError, match=msg):
            _conv_call(causal_conv1d_update, i, i["state"], idx=bad)
        assert torch.equal(big, big_before)
    else:
        want_state = before.clone()
        pad = torch.tensor([0, -1, 1], dtype=torch.int32, device=device)
        want = _conv_call(causal_conv1d_update_ref, i, want_state, idx=pad)
        y = _conv_call(causal_conv1d_update, i, i["state"], idx=bad)  # lean path: the kernel skips row 1
        if device.type == "cuda":
            torch.cuda.synchronize()  # the record is written when the kernel runs
        torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(y[1], torch.zeros_like(y[1]))
        assert torch.equal(i["state"], want_state)  # data movement: exact
        assert torch.equal(big[S:], big_before[S:])  # nothing written outside the pool
        before, big_before = i["state"].clone(), big.clone()
        with pytest.raises(ValueError, match=msg + r".*reported at this call.*nothing was written outside the pool"):
            _conv_call(causal_conv1d_update, i, i["state"])
        assert torch.equal(big, big_before)  # raised before launching
    with pytest.raises(ValueError, match="activation"):
        i["x"] = i["x"].clone()
        causal_conv1d_update(i["x"], i["state"], i["weight"], i["bias"], "gelu", None, i["idx"])
    with pytest.raises(ValueError, match="causal_conv1d_update: `bias` expected shape"):
        causal_conv1d_update(i["x"], i["state"], i["weight"], i["bias"][:-1], "silu", None, i["idx"])
    assert torch.equal(big, big_before)


def test_rmsnorm_repeat_calls_skip_checks_and_match_reference(device, monkeypatch):
    from fastmamba.ops import rmsnorm_fn
    from fastmamba.ops.gated_rmsnorm import api as norm_api
    from fastmamba.ops.gated_rmsnorm.ref import rmsnorm_ref

    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        x, z = torch.randn(3, 48, generator=g).to(device), torch.randn(3, 48, generator=g).to(device)
        w = (1 + 0.1 * torch.randn(48, generator=g)).to(device)
        got = rmsnorm_fn(x, w, None, z, 1e-5, 16, False)
        torch.testing.assert_close(got, rmsnorm_ref(x, w, None, z, 1e-5, 16, False), atol=1e-5, rtol=1e-5)
        if seed == 0:
            assert len(norm_api._VALID) == 1
            _no_checks(monkeypatch, norm_api, ["check_dtype", "check_shape", "check_same_device", "check_eps"])
    with pytest.raises(AssertionError, match="fast path ran a check"):  # another group size: checked again
        rmsnorm_fn(x, w, None, z, 1e-5, 24, False)


@pytest.mark.parametrize("name", ["state_batch_indices", "dst_state_batch_indices"])
def test_ssu_device_checked_slots_report_at_the_next_call(device, monkeypatch, name):
    """Indices the lean path does not read on the host (a GPU's; here CPU ones with the switch on):
    the kernel treats a bad one as the pad slot and records it; the next call raises the
    ValueError before launching anything, and the one after runs again."""
    from fastmamba.ops._common import slot_errors

    if device.type != "cuda" and not ssu_api.use_triton(torch.empty(1)):
        pytest.skip("the kernel path needs TRITON_INTERPRET=1 on the CPU")
    monkeypatch.setattr(ssu_api, "DEVICE_CHECK_CPU", True)
    i = _ssu_inputs(device, 0)
    if name == "state_batch_indices":
        _ssu_call(selective_state_update, i)  # the first call of a signature is checked on the host
        good = i["idx"].tolist()
        bad = torch.tensor([good[0], S + 5], dtype=torch.int32, device=device)
        before = i["state"].clone()
        y = _ssu_call(selective_state_update, i, idx=bad)  # lean path: no host read, no error yet
        assert torch.equal(y[1], torch.zeros_like(y[1]))  # the bad row acts as a pad row
        untouched = [s for s in range(S) if s != good[0]]
        assert torch.equal(i["state"][untouched], before[untouched])
        if device.type == "cuda":
            torch.cuda.synchronize()
        after_bad = i["state"].clone()
        with pytest.raises(ValueError, match=rf"selective_state_update: `state_batch_indices` values must lie in "
                                             rf"\[0, {S}\).*\[{S + 5}\].*nothing was written outside the pool"):
            _ssu_call(selective_state_update, i)
        assert torch.equal(i["state"], after_bad)  # raised before launching
        _ssu_call(selective_state_update, i)  # reported once: the next call runs
    else:  # dst indices take the checked path; the device record stays clean
        _ssu_call(selective_state_update, i)
        _ssu_call(selective_state_update, i)
        slot_errors.raise_pending_slot_errors()


@pytest.mark.parametrize("kernel", ["generic", "vec4", "rows"], ids=["generic-SL3", "vec4-SL4", "rows-SL3-bf16"])
def test_conv_device_checked_slots_report_at_the_next_call(device, monkeypatch, kernel):
    import fastmamba.ops.conv1d.kernel as conv_kernel

    if device.type != "cuda" and not conv1d_api.use_triton(torch.empty(1)):
        pytest.skip("the kernel path needs TRITON_INTERPRET=1 on the CPU")
    monkeypatch.setattr(conv1d_api, "DEVICE_CHECK_CPU", True)
    taken = []
    for name in ("_conv1d_update_vec4_kernel", "_causal_conv1d_update_kernel"):
        monkeypatch.setattr(conv_kernel, name, _Spy(getattr(conv_kernel, name), taken, name))
    monkeypatch.setattr(conv_kernel, "use_rows_kernel", lambda D, B: kernel == "rows")
    monkeypatch.setattr(conv_kernel, "use_vec4_kernel", lambda D, B: kernel == "vec4")
    i = _conv_inputs(device, 0)
    if kernel == "vec4":
        i["state"] = torch.randn(S, i["x"].shape[1], 4).to(device)
    if kernel == "rows":
        i["state"] = i["state"].to(torch.bfloat16)
    _conv_call(causal_conv1d_update, i, i["state"])  # first call of the signature: checked on the host
    good = i["idx"].tolist()
    bad = torch.tensor([good[0], S + 7, good[2]], dtype=torch.int32, device=device)
    before = i["state"].clone()
    y = _conv_call(causal_conv1d_update, i, i["state"], idx=bad)  # no host read: the kernel skips row 1
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    untouched = [s for s in range(S) if s not in (good[0], good[2])]
    assert torch.equal(i["state"][untouched], before[untouched])
    if device.type == "cuda":
        torch.cuda.synchronize()
    after_bad = i["state"].clone()
    with pytest.raises(ValueError, match=rf"causal_conv1d_update: `conv_state_indices` values must lie in \[0, {S}\)"
                                         rf".*\[{S + 7}\]"):
        _conv_call(causal_conv1d_update, i, i["state"])
    assert torch.equal(i["state"], after_bad)
    _conv_call(causal_conv1d_update, i, i["state"])  # reported once
    want = {"generic": "_causal_conv1d_update_kernel", "vec4": "_conv1d_update_vec4_kernel", "rows": None}[kernel]
    assert set(taken) == ({want} if want else set()), taken


class _Spy:
    """A kernel stand-in that records its name when launched, then launches the kernel."""

    def __init__(self, kernel, taken, name):
        self.kernel, self.taken, self.name = kernel, taken, name

    def __getitem__(self, grid):
        self.taken.append(self.name)
        return self.kernel[grid]


def test_raise_pending_slot_errors_reports_on_demand(device, monkeypatch):
    from fastmamba.ops import raise_pending_slot_errors

    if device.type != "cuda" and not conv1d_api.use_triton(torch.empty(1)):
        pytest.skip("the kernel path needs TRITON_INTERPRET=1 on the CPU")
    monkeypatch.setattr(conv1d_api, "DEVICE_CHECK_CPU", True)
    i = _conv_inputs(device, 3)
    _conv_call(causal_conv1d_update, i, i["state"])
    _conv_call(causal_conv1d_update, i, i["state"], idx=torch.tensor([-5, 0, 1], dtype=torch.int32, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"causal_conv1d_update: `conv_state_indices`.*\[-5\]"):
        raise_pending_slot_errors()
    raise_pending_slot_errors()  # cleared


def test_pending_slot_error_is_reported_only_by_the_same_op(device, monkeypatch):
    """A bad index a conv kernel recorded is not reported by another op's call (the SSU's runs),
    and the conv op's next call reports it even when that call takes the checked path (a new
    signature), naming the op and the device."""
    if device.type != "cuda" and not conv1d_api.use_triton(torch.empty(1)):
        pytest.skip("the kernel path needs TRITON_INTERPRET=1 on the CPU")
    monkeypatch.setattr(conv1d_api, "DEVICE_CHECK_CPU", True)
    monkeypatch.setattr(ssu_api, "DEVICE_CHECK_CPU", True)
    c, i = _conv_inputs(device, 4), _ssu_inputs(device, 4)
    _conv_call(causal_conv1d_update, c, c["state"])
    _ssu_call(selective_state_update, i)
    _conv_call(causal_conv1d_update, c, c["state"], idx=torch.tensor([0, 1, S + 3], dtype=torch.int32, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize()
    for _ in range(2):  # another op on the same device: runs, reports nothing
        _ssu_call(selective_state_update, i)
    d = _conv_inputs(device, 5, B=2)  # a new signature: the checked path
    before = d["state"].clone()
    with pytest.raises(ValueError, match=rf"causal_conv1d_update: `conv_state_indices` values must lie in \[0, {S}\) or equal "
                                         rf"pad_slot_id; an earlier call of causal_conv1d_update on {device.type}.*\[{S + 3}\]"):
        _conv_call(causal_conv1d_update, d, d["state"])
    assert torch.equal(d["state"], before)
    _conv_call(causal_conv1d_update, d, d["state"])  # reported once


def test_conv_fn_repeat_calls_skip_checks_and_match_reference(device, monkeypatch):
    from fastmamba.ops import causal_conv1d_fn
    from fastmamba.ops.conv1d_fn import api as fn_api
    from fastmamba.ops.conv1d_fn.ref import causal_conv1d_fn_ref

    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(2, 19, 24, generator=g).to(device).transpose(1, 2)  # channel-last (B, D, L), L odd
        w, b = (torch.randn(24, 4, generator=g) * 0.5).to(device), (torch.randn(24, generator=g) * 0.1).to(device)
        got = causal_conv1d_fn(x, w, b, activation="silu")
        torch.testing.assert_close(got, causal_conv1d_fn_ref(x, w, b, activation="silu"), atol=1e-5, rtol=1e-5)
        if seed == 0:
            assert len(fn_api._VALID_FN) == 1
            _no_checks(monkeypatch, fn_api, ["_check_fn_inputs", "parse_activation"])
    with pytest.raises(AssertionError, match="fast path ran a check"):  # another activation: checked again
        causal_conv1d_fn(x, w, b, activation=None)


def test_repeat_decode_calls_read_no_index_on_the_host(device, monkeypatch):
    """With the device check on (as for GPU indices), a repeated signature reads no slot index on
    the host: zero host reads after the first call."""
    import fastmamba.ops._common.checks as checks

    if device.type != "cuda" and not ssu_api.use_triton(torch.empty(1)):
        pytest.skip("the kernel path needs TRITON_INTERPRET=1 on the CPU")
    monkeypatch.setattr(ssu_api, "DEVICE_CHECK_CPU", True)
    monkeypatch.setattr(conv1d_api, "DEVICE_CHECK_CPU", True)
    i, c = _ssu_inputs(device, 0), _conv_inputs(device, 0)
    _ssu_call(selective_state_update, i)
    _conv_call(causal_conv1d_update, c, c["state"])
    reads = []
    real = checks.host_list
    monkeypatch.setattr(checks, "host_list", lambda t: reads.append(t) or real(t))
    for _ in range(3):
        _ssu_call(selective_state_update, i)
        _conv_call(causal_conv1d_update, c, c["state"])
    assert reads == []


@pytest.mark.gpu
def test_repeat_decode_calls_never_synchronize():
    """On a GPU the lean path of the decode ops makes no device-to-host copy or synchronize."""
    i, c = _ssu_inputs(torch.device("cuda"), 0), _conv_inputs(torch.device("cuda"), 0)
    _ssu_call(selective_state_update, i)  # first call of each signature: checked on the host
    _conv_call(causal_conv1d_update, c, c["state"])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            _ssu_call(selective_state_update, i)
            _conv_call(causal_conv1d_update, c, c["state"])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
