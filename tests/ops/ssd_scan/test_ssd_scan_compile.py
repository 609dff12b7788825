"""torch.compile(fullgraph=True) and torch.inference_mode() of the scan's public entries.

Compiled with the "aot_eager" backend (tracing is what can break; Inductor adds nothing here and
is slow on a CPU). Both entries run as custom ops, so the compiled graph holds one node per call.
"""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops.ssd_scan import mamba_chunk_scan_combined, plan, ssd_scan_varlen
from fastmamba.ops.ssd_scan.ref import mamba_chunk_scan_combined_ref, ssd_scan_varlen_ref
from tests.helpers import seeded, tol
from tests.ops.ssd_scan.test_ssd_scan import _inputs, _varlen_case


@pytest.fixture
def no_host_reads(monkeypatch):
    """Counts host reads of index tensors by the ops (the checks' and the chunk count's)."""
    from fastmamba.ops._common import checks

    reads = []

    def counting(t):
        reads.append(tuple(t.shape))
        return t.tolist()

    monkeypatch.setattr(plan, "host_list", counting)
    monkeypatch.setattr(checks, "host_list", counting)
    torch._dynamo.reset()
    yield reads
    torch._dynamo.reset()


def _varlen_call(x, dt, A, B, C, states, cu, slots, flags, D, dt_bias, seed):
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)  # `out=` (its aliasing check)
    return ssd_scan_varlen(x, dt, A, B, C, states, cu, chunk_size=16, D=D, dt_bias=dt_bias, cache_indices=slots,
                           has_initial_state=flags, rand_seed=seed, A_is_log=True, out=out)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
def test_compile_varlen_with_cache_indices(device, no_host_reads, state_dtype):
    inp, cu, states = _varlen_case(device, [9, 14], H=2, P=16, G=1, N=16, state_dtype=state_dtype, seed=131)
    A_log = torch.randn(2, generator=seeded(132)).to(device)
    slots = torch.tensor([3, 0], dtype=torch.int32, device=device)
    flags = torch.tensor([1, 0], dtype=torch.bool, device=device)
    seed = torch.tensor([7], dtype=torch.int64, device=device)
    args = (inp["x"], inp["dt"], A_log, inp["B"], inp["C"])
    rest = (cu, slots, flags, inp["D"], inp["dt_bias"], seed)
    compiled = torch.compile(_varlen_call, fullgraph=True, backend="aot_eager")
    mine = states.clone()
    out = compiled(*args, mine, *rest)
    assert no_host_reads == [], "the compiled op read index tensors on the host"
    eager = states.clone()
    want = _varlen_call(*args, eager, *rest)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    assert torch.equal(mine, eager)  # the in-place slot writes happen under compile too, same seed
    theirs = states.clone()
    ref = ssd_scan_varlen_ref(*args, theirs, cu, chunk_size=16, D=inp["D"], dt_bias=inp["dt_bias"],
                              cache_indices=slots, has_initial_state=flags, A_is_log=True)
    torch.testing.assert_close(out, ref, **tol(state_dtype))


def _dense_call(x, dt, A, B, C, init, cu):
    return mamba_chunk_scan_combined(x, dt, A, B, C, 16, initial_states=init, cu_seqlens=cu, dt_softplus=True,
                                     return_final_states=True, return_varlen_states=True)


def test_compile_dense(device, no_host_reads):
    L, H, P, G, N = 30, 2, 16, 1, 16
    inp = _inputs((1, L), H, P, G, N, torch.float32, device, seed=133)
    init = torch.randn(1, H, P, N, generator=seeded(134)).to(device)
    cu = torch.tensor([0, 11, 30], dtype=torch.int32, device=device)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], init, cu)
    compiled = torch.compile(_dense_call, fullgraph=True, backend="aot_eager")
    got = compiled(*args)
    assert no_host_reads == [], "the compiled op read cu_seqlens on the host"
    want = _dense_call(*args)
    ref = mamba_chunk_scan_combined_ref(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 16, initial_states=init,
                                        cu_seqlens=cu, dt_softplus=True, return_final_states=True,
                                        return_varlen_states=True)
    for g, w, r in zip(got, want, ref):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
        torch.testing.assert_close(g, r, **tol(torch.float32))


def test_trusted_inputs_read_nothing_on_the_host(device, no_host_reads):
    from fastmamba.ops._common.host_values import trusted_inputs

    inp, cu, states = _varlen_case(device, [9, 14], H=2, P=16, G=1, N=16, seed=135)
    slots = torch.tensor([3, 0], dtype=torch.int32, device=device)
    mine, theirs = states.clone(), states.clone()
    with trusted_inputs():
        out = ssd_scan_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], mine, cu, chunk_size=16,
                              cache_indices=slots)
        dense = mamba_chunk_scan_combined(inp["x"][None], inp["dt"][None], inp["A"], inp["B"][None], inp["C"][None],
                                          16, cu_seqlens=cu)
    assert no_host_reads == []
    ref = ssd_scan_varlen_ref(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], theirs, cu, chunk_size=16,
                              cache_indices=slots)
    torch.testing.assert_close(out, ref, **tol(torch.float32))
    torch.testing.assert_close(mine, theirs, **tol(torch.float32))
    want = mamba_chunk_scan_combined_ref(inp["x"][None], inp["dt"][None], inp["A"], inp["B"][None], inp["C"][None],
                                         16, cu_seqlens=cu)
    torch.testing.assert_close(dense, want, **tol(torch.float32))


def test_inference_mode(device):
    with torch.inference_mode():
        inp, cu, states = _varlen_case(device, [9, 14], H=2, P=16, G=1, N=16, seed=136)
        slots = torch.tensor([3, 0], dtype=torch.int32, device=device)
        seed = torch.tensor([1], dtype=torch.int64, device=device)
        mine, theirs = states.clone(), states.clone()
        out = ssd_scan_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], mine, cu, chunk_size=16,
                              cache_indices=slots, rand_seed=seed)
        ref = ssd_scan_varlen_ref(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], theirs, cu, chunk_size=16,
                                  cache_indices=slots)
        dense, final = mamba_chunk_scan_combined(inp["x"][None], inp["dt"][None], inp["A"], inp["B"][None],
                                                 inp["C"][None], 16, return_final_states=True)
        r_dense, r_final = mamba_chunk_scan_combined_ref(inp["x"][None], inp["dt"][None], inp["A"], inp["B"][None],
                                                         inp["C"][None], 16, return_final_states=True)
    torch.testing.assert_close(out, ref, **tol(torch.float32))
    torch.testing.assert_close(mine, theirs, **tol(torch.float32))
    torch.testing.assert_close(dense, r_dense, **tol(torch.float32))
    torch.testing.assert_close(final, r_final, **tol(torch.float32))
