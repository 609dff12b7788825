"""The packed-batch ops check cu_seqlens and slot indices on the device (issue 19 item 0).

``causal_conv1d_varlen`` and ``ssd_scan_varlen`` called eagerly on GPU tensors read no index
value on the host (ops/_common/varlen_checks.py): a call with a bad value runs as padding (no
state read or written, zero outputs) and the op's next call raises the ValueError. On the CPU the
same path runs under the interpreter with ``varlen_checks.DEVICE_CHECK_CPU`` on; the GPU test
proves there is no synchronize.
"""
from __future__ import annotations

import pytest
import torch

import fastmamba.ops._common.checks as checks
from fastmamba.ops import causal_conv1d_varlen, raise_pending_slot_errors, ssd_scan_varlen
from fastmamba.ops._common import varlen_checks
from fastmamba.ops._common.dispatch import interpreter_enabled
from fastmamba.ops.conv1d_fn import api as conv_api
from fastmamba.ops.conv1d_fn.ref import causal_conv1d_varlen_ref
from fastmamba.ops.ssd_scan import plan as ssd_plan
from fastmamba.ops.ssd_scan.ref import ssd_scan_varlen_ref

LENS = (5, 0, 9, 3)  # T = 17, an empty sequence
T = sum(LENS)
S = 6
OPS = ["conv", "ssd-fused", "ssd-chunked"]


@pytest.fixture
def dev(device, monkeypatch):
    """The device the op runs on, with the device check on for it."""
    if device.type != "cuda":
        if not interpreter_enabled():
            pytest.skip("the kernel path needs TRITON_INTERPRET=1 on the CPU")
        monkeypatch.setattr(varlen_checks, "DEVICE_CHECK_CPU", True)
    return device


def _case(op: str, device: torch.device, seed: int) -> dict:
    """Keyword arguments of one call of ``op`` (cu_seqlens / cache_indices under those names)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32, device=device)
    slots = torch.tensor([4, 0, 2, 5], dtype=torch.int32, device=device)
    flags = torch.tensor([True, False, True, False], device=device)
    if op == "conv":
        D, W = 24, 4
        return dict(x=rnd(T, D), weight=rnd(D, W, scale=0.5), bias=rnd(D, scale=0.1), conv_states=rnd(S, D, W - 1),
                    cu_seqlens=cu, cache_indices=slots, has_initial_state=flags, activation="silu",
                    out=torch.full((T, D), float("nan"), device=device))
    H, P, G, N = 2, 16, 1, 16
    return dict(x=rnd(T, H, P), dt=rnd(T, H), A=-(torch.rand(H, generator=g) + 0.5).to(device),
                B=rnd(T, G, N, scale=0.5), C=rnd(T, G, N, scale=0.5), ssm_states=rnd(S, H, P, N),
                cu_seqlens=cu, chunk_size=8, D=rnd(H), dt_bias=rnd(H, scale=0.1), cache_indices=slots,
                has_initial_state=flags, out=torch.full((T, H, P), float("nan"), device=device),
                fused=op == "ssd-fused")


def _state_of(kw: dict) -> torch.Tensor:
    return kw["conv_states"] if "conv_states" in kw else kw["ssm_states"]


def _call(op: str, kw: dict) -> torch.Tensor:
    return causal_conv1d_varlen(**kw) if op == "conv" else ssd_scan_varlen(**kw)


def _reference(op: str, kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, states after) of the PyTorch reference on fp32 CPU copies."""
    cpu = {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    cpu.pop("out")
    if op == "conv":
        y = causal_conv1d_varlen_ref(**cpu)
    else:
        cpu.pop("fused")
        y = ssd_scan_varlen_ref(**cpu)
    return y, _state_of(cpu)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _count_host_reads(monkeypatch) -> list:
    reads = []
    for module in (checks, conv_api, ssd_plan):
        real = module.host_list
        monkeypatch.setattr(module, "host_list", lambda t, real=real: reads.append(t) or real(t))
    return reads


@pytest.mark.parametrize("op", OPS)
def test_good_call_reads_nothing_on_the_host_and_matches_the_reference(dev, monkeypatch, op):
    kw = _case(op, dev, seed=1)
    want_y, want_state = _reference(op, kw)
    reads = _count_host_reads(monkeypatch)
    y = _call(op, kw)
    assert reads == []
    torch.testing.assert_close(y.cpu(), want_y, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(_state_of(kw).cpu(), want_state, atol=2e-4, rtol=2e-4)
    raise_pending_slot_errors()  # nothing recorded


BAD = [
    pytest.param("cu_seqlens", [1, 5, 5, 14, 17], r"cu_seqlens\[0\] = 1", id="cu-not-from-0"),
    pytest.param("cu_seqlens", [0, 5, 3, 14, 17], r"cu_seqlens\[2\] = 3", id="cu-decreasing"),
    pytest.param("cu_seqlens", [0, 5, 5, 14, 16], r"cu_seqlens\[4\] = 16", id="cu-not-T"),
    pytest.param("cu_seqlens", [0, 5, 5, 19, 17], r"cu_seqlens\[3\] = 19", id="cu-past-T"),
    pytest.param("cache_indices", [4, 0, S + 2, 5], rf"\[{S + 2}\]", id="slot-past-S"),
    pytest.param("cache_indices", [4, -3, 2, 5], r"\[-3\]", id="slot-negative"),
]


@pytest.mark.parametrize("name, values, got", BAD)
@pytest.mark.parametrize("op", OPS)
def test_bad_call_runs_as_padding_and_the_next_call_raises(dev, op, name, values, got):
    """The bad call writes no state and zero outputs; the next call raises before touching
    anything (naming the op, the argument and the value); the one after runs normally."""
    op_name = "causal_conv1d_varlen" if op == "conv" else "ssd_scan_varlen"
    kw = _case(op, dev, seed=2)
    state = _state_of(kw)
    before = state.clone()
    bad = dict(kw, **{name: torch.tensor(values, dtype=torch.int32, device=dev)})
    y = _call(op, bad)
    _sync(dev)
    assert torch.equal(y, torch.zeros_like(y))
    assert torch.equal(state, before)
    if name == "cu_seqlens":
        message = (rf"{op_name}: `cu_seqlens` must start at 0, never decrease and end at the token count {T}; "
                   rf"an earlier call of {op_name} on .*{got}.*ran as padding")
    else:
        message = rf"{op_name}: `cache_indices` values must lie in \[0, {S}\).*an earlier call.*{got}.*ran as padding"
    kw["out"].fill_(float("nan"))
    with pytest.raises(ValueError, match=message):
        _call(op, kw)
    assert torch.equal(state, before)
    assert torch.isnan(kw["out"]).all()  # raised before launching
    want_y, want_state = _reference(op, kw)
    y = _call(op, kw)  # reported once: this call runs
    torch.testing.assert_close(y.cpu(), want_y, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(state.cpu(), want_state, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("op", ["conv", "ssd-chunked"])
def test_raise_pending_slot_errors_reports_a_varlen_op(dev, op):
    kw = _case(op, dev, seed=3)
    kw["cache_indices"] = torch.tensor([4, 0, 2, S], dtype=torch.int32, device=dev)
    _call(op, kw)
    _sync(dev)
    op_name = "causal_conv1d_varlen" if op == "conv" else "ssd_scan_varlen"
    with pytest.raises(ValueError, match=rf"{op_name}: `cache_indices`.*\[{S}\].*by raise_pending_slot_errors"):
        raise_pending_slot_errors()
    raise_pending_slot_errors()  # cleared


def test_ssd_chunk_states_out_keeps_the_host_check(dev):
    """chunk_states_out needs the exact chunk count, so that call reads cu_seqlens on the host and
    raises at once."""
    kw = _case("ssd-chunked", dev, seed=4)
    state = _state_of(kw)
    before = state.clone()
    kw["chunk_states_out"] = torch.zeros(8, *state.shape[1:], device=dev)
    kw["cu_seqlens"] = torch.tensor([0, 5, 3, 14, 17], dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="ssd_scan_varlen: `cu_seqlens` must start at 0, never decrease"):
        _call("ssd-chunked", kw)
    assert torch.equal(state, before)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_gpu_varlen_calls_never_synchronize(op):
    """Eager calls on GPU tensors: no device-to-host copy, no synchronize (a bad value included)."""
    dev = torch.device("cuda")
    kw = _case(op, dev, seed=5)
    _call(op, kw)  # compile
    bad = dict(kw, cu_seqlens=torch.tensor([0, 5, 3, 14, 17], dtype=torch.int32, device=dev))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            _call(op, kw)
        _call(op, bad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="never decrease"):
        _call(op, kw)


def test_dense_scan_cu_seqlens_checked_on_the_device(dev, monkeypatch):
    """mamba_chunk_scan_combined with cu_seqlens (B=1): no host read; a bad cu_seqlens is raised by
    the op's next call."""
    from fastmamba.ops import mamba_chunk_scan_combined
    from fastmamba.ops.ssd_scan.ref import mamba_chunk_scan_combined_ref

    kw = _case("ssd-chunked", dev, seed=6)
    L = T
    x, dt, B, C = (kw[k].unsqueeze(0) for k in ("x", "dt", "B", "C"))
    args = (x, dt, kw["A"], B, C, 8)
    extra = dict(D=kw["D"], dt_bias=kw["dt_bias"], dt_softplus=True, return_varlen_states=True)
    reads = _count_host_reads(monkeypatch)
    out, varlen = mamba_chunk_scan_combined(*args, cu_seqlens=kw["cu_seqlens"], **extra)
    assert reads == []
    cpu = [t.cpu() if isinstance(t, torch.Tensor) else t for t in args]
    r_out, r_varlen = mamba_chunk_scan_combined_ref(*cpu, cu_seqlens=kw["cu_seqlens"].cpu(),
                                                    **{k: v.cpu() if isinstance(v, torch.Tensor) else v
                                                       for k, v in extra.items()})
    torch.testing.assert_close(out.cpu(), r_out, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(varlen.cpu(), r_varlen, atol=2e-4, rtol=2e-4)
    bad = torch.tensor([0, 5, 2, 14, L], dtype=torch.int32, device=dev)
    mamba_chunk_scan_combined(*args, cu_seqlens=bad, **extra)  # runs (as one sequence), records
    _sync(dev)
    with pytest.raises(ValueError, match=rf"mamba_chunk_scan_combined: `cu_seqlens` must start at 0, never decrease "
                                         rf"and end at the token count {L}; an earlier call.*cu_seqlens\[2\] = 2"):
        mamba_chunk_scan_combined(*args, cu_seqlens=kw["cu_seqlens"], **extra)
    out2, _ = mamba_chunk_scan_combined(*args, cu_seqlens=kw["cu_seqlens"], **extra)  # reported once
    torch.testing.assert_close(out2, out, atol=0, rtol=0)


def test_launches_after_the_check_run_without_pdl(monkeypatch):
    """With PDL switched on (FASTMAMBA_PDL=1), the launches reading what the check kernel just
    wrote run plainly: a PDL program reads its indices before its grid-dependency wait."""
    from fastmamba.ops._common import pdl

    x = torch.empty(1)
    monkeypatch.setattr(varlen_checks, "pdl_requested", lambda t: True)
    monkeypatch.setattr(pdl, "_enabled", True)
    with varlen_checks.launches_after(True, x):
        assert not pdl._enabled
    assert pdl._enabled
    with varlen_checks.launches_after(False, x):  # no check ran: PDL as asked
        assert pdl._enabled
