"""moe_gate (the router's fp32 GEMV and the routing in one launch) vs its reference (CPU: the
Triton interpreter).

Base row: T=1 token, M=48, E=8 experts, top-2, bias, fp32 x; each other row changes one thing.
The interpreter's config runs 4 router rows per program, so E=8 is two programs (the second to
arrive routes) and E=12 three.
"""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops._common.dispatch import interpreter_enabled
from fastmamba.ops.moe import configs, decode_workspace, moe_gate
from fastmamba.ops.moe import router_kernel
from fastmamba.ops.moe.ref import moe_gate_ref
from tests.helpers import count_launches, seeded


def make_inputs(T, M, E, dtype, device, seed=0, bias=True):
    g = seeded(seed)
    x = torch.randn(T, M, generator=g).to(device, dtype)
    weight = (torch.randn(E, M, generator=g) * 0.3).to(device)  # fp32, as the router holds it
    b = (torch.randn(E, generator=g) * 0.1).to(device) if bias else None
    return x, weight, b


def check(x, weight, bias, arrivals=None, **kw):
    got = moe_gate(x, weight, bias, arrivals=arrivals, **kw)
    want = moe_gate_ref(x, weight, bias, **kw)
    assert got.ids.dtype == torch.int32 and got.weights.dtype == torch.float32
    assert torch.equal(got.ids.cpu(), want.ids.cpu())
    torch.testing.assert_close(got.weights, want.weights, atol=1e-5, rtol=1e-5)  # fp32 sums in another order
    if arrivals is not None:
        assert not arrivals.any()  # left zero for the next call
    return got


CASES = {  # id: (T, M, E, dtype, selection keywords)
    "T1-M48-E8-k2-fp32": (1, 48, 8, torch.float32, dict(top_k=2)),
    "T1-M48-E8-k2-bf16": (1, 48, 8, torch.bfloat16, dict(top_k=2)),
    "T4-M48-E8-k2-fp16": (4, 48, 8, torch.float16, dict(top_k=2)),
    "T3-M40-E8-k2-fp32-masked-M": (3, 40, 8, torch.float32, dict(top_k=2)),
    "T2-M48-E12-k3-bf16-odd-E": (2, 48, 12, torch.bfloat16, dict(top_k=3)),
    "T2-M48-E8-k3-grouped": (2, 48, 8, torch.float32, dict(top_k=3, n_group=4, topk_group=2)),
    "T1-M48-E8-k2-no-renorm-scaled": (1, 48, 8, torch.float32, dict(top_k=2, norm_topk_prob=False,
                                                                  routed_scaling_factor=2.5)),
}


@pytest.mark.parametrize("T,M,E,dtype,kw", list(CASES.values()), ids=list(CASES))
def test_matches_reference(T, M, E, dtype, kw, device):
    x, weight, bias = make_inputs(T, M, E, dtype, device, seed=T * 10 + E)
    check(x, weight, bias, decode_workspace(M, device=device)[:1], **kw)


def test_no_bias_and_its_own_counter(device):
    """No selection bias; without ``arrivals`` the op makes its own counter."""
    x, weight, _ = make_inputs(2, 48, 8, torch.float32, device, seed=3, bias=False)
    check(x, weight, None, top_k=2)


def test_strided_inputs_and_reused_counter(device):
    """x a transposed view, the router weight a column slice of a wider one; one counter for calls in
    a row (each leaves it zero), rows of a token do not depend on the others in the call."""
    x, weight, bias = make_inputs(3, 48, 8, torch.bfloat16, device, seed=4)
    wide = torch.randn(8, 96, device=device)
    wide[:, 48:] = weight
    ws = decode_workspace(48, device=device)
    batch = check(x.t().contiguous().t(), wide[:, 48:], bias, ws[:1], top_k=2)
    alone = check(x[1:2], weight, bias, ws[:1], top_k=2)
    assert torch.equal(batch.ids[1:2], alone.ids) and torch.equal(batch.weights[1:2], alone.weights)


def test_one_launch(device, monkeypatch):
    if device.type == "cpu" and not interpreter_enabled():
        pytest.skip("the reference runs on a CPU without TRITON_INTERPRET=1")
    launches = count_launches(monkeypatch, router_kernel)
    x, weight, bias = make_inputs(1, 48, 8, torch.bfloat16, device, seed=5)
    moe_gate(x, weight, bias, top_k=2, arrivals=decode_workspace(48, device=device)[:1])
    assert launches[0] == 1


def test_no_tokens(device):
    x, weight, bias = make_inputs(1, 48, 8, torch.float32, device)
    r = moe_gate(x[:0], weight, bias, top_k=2)
    assert r.ids.shape == (0, 2) and r.weights.shape == (0, 2)


def test_config_heuristic():
    """About 128 programs of at most 4096 fp32 values: Nano one row in one step, Super four rows."""
    assert configs.gate_config(128, 2688) == configs.GateConfig(1, 4096)
    assert configs.gate_config(512, 4096) == configs.GateConfig(4, 1024)
    assert configs.gate_config(8, 48) == configs.GateConfig(1, 64)
    assert configs.gate_config(8, 48, interpreter=True) == configs.GateConfig(4, 32)


# --- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("change,exc,match", [
    (lambda a: {**a, "x": a["x"][0]}, ValueError, r"moe_gate: `x` expected shape \(T, M\)"),
    (lambda a: {**a, "x": torch.zeros(configs.GATE_MAX_TOKENS + 1, 16)}, ValueError,
     r"moe_gate: `x` has T=17 tokens, more than GATE_MAX_TOKENS=16"),
    (lambda a: {**a, "weight": a["weight"][:, :8]}, ValueError, r"`weight` expected shape \(E, M=16\)"),
    (lambda a: {**a, "weight": a["weight"].long()}, TypeError, r"`weight` expected dtype in"),
    (lambda a: {**a, "bias": a["bias"][:3]}, ValueError, r"`correction_bias` expected shape \(E=4,\)"),
    (lambda a: {**a, "top_k": 5}, ValueError, r"`top_k`=5 must lie in \[1, 4\]"),
    (lambda a: {**a, "arrivals": torch.zeros(1, dtype=torch.int64)}, TypeError, r"`arrivals` expected dtype in \(int32"),
    (lambda a: {**a, "arrivals": torch.zeros(0, dtype=torch.int32)}, ValueError, r"`arrivals` expected at least 1"),
], ids=["x-1d", "too-many-tokens", "weight-M", "weight-dtype", "bias-shape", "top_k", "arrivals-dtype",
        "arrivals-empty"])
def test_bad_input(change, exc, match):
    x, weight, bias = make_inputs(3, 16, 4, torch.float32, torch.device("cpu"))
    a = change(dict(x=x, weight=weight, bias=bias, top_k=2, arrivals=None))
    with pytest.raises(exc, match=match):
        moe_gate(a["x"], a["weight"], a["bias"], top_k=a["top_k"], arrivals=a["arrivals"])


# --- GPU: the real shapes, CUDA graphs ------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("shape", ["nano", "super"])
def test_gpu_shapes_graph_and_pdl(shape, T):
    """Nano (E=128, M=2688, top-6) and Super (E=512, M=4096, top-22) in bf16: the reference's ids,
    in a CUDA graph under PDL replayed many times on new inputs (the arrival counter must reset
    every time, and the last program must see every other program's logits)."""
    from fastmamba.ops._common.pdl import programmatic_dependent_launch

    E, M, k = (128, 2688, 6) if shape == "nano" else (512, 4096, 22)
    dev = torch.device("cuda")
    x, weight, bias = make_inputs(T, M, E, torch.bfloat16, dev, seed=T)
    ws = decode_workspace(M, device=dev)
    kw = dict(top_k=k, routed_scaling_factor=2.5)
    check(x, weight, bias, ws[:1], **kw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe_gate(x, weight, bias, arrivals=ws[:1], **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with programmatic_dependent_launch(True), torch.cuda.graph(graph):
        captured = moe_gate(x, weight, bias, arrivals=ws[:1], **kw)
    for i in range(200):
        x.copy_(torch.randn(T, M, generator=seeded(100 + i)).to(dev, torch.bfloat16))
        graph.replay()
        want = moe_gate_ref(x, weight, bias, **kw)
        assert torch.equal(captured.ids, want.ids), i
        torch.testing.assert_close(captured.weights, want.weights, atol=1e-5, rtol=1e-5)
    assert not ws.any()
