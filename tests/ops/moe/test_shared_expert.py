"""The shared expert fused into the routed call: fused_moe over [routed + shared slices] equals the
routed reference plus the shared MLP (relu², non-gated), on both paths (CPU: the interpreter)."""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops._common.dispatch import use_triton
from fastmamba.ops.moe import Routing, append_shared_routing, fuse_shared_expert, fused_moe
from fastmamba.ops.moe.api import fused_moe_gemv
from fastmamba.ops.moe.ref import fused_moe_ref
from tests.helpers import nan_like, seeded, tol
from tests.ops.moe.test_fused_moe import make_inputs


@pytest.mark.parametrize("T,op", [(2, fused_moe_gemv), (7, fused_moe)], ids=["gemv-T2", "grouped-T7"])
def test_routed_plus_shared(T, op, device):
    M, F, E, k, S = 32, 24, 5, 2, 2
    x, w_up, w_down, tw, ids = make_inputs(T, M, F, E, k, torch.float32, device, seed=T)
    g = seeded(99)
    shared_up = (torch.randn(S * F, M, generator=g) / M ** 0.5).to(device)
    shared_down = (torch.randn(M, S * F, generator=g) / (S * F) ** 0.5).to(device)
    up_all, down_all = fuse_shared_expert(w_up, w_down, shared_up, shared_down)
    assert up_all.shape == (E + S, F, M) and torch.equal(up_all[:E], w_up) and torch.equal(down_all[:E], w_down)
    r = append_shared_routing(Routing(tw, ids), E, S)
    assert r.ids[:, k:].tolist() == [[E, E + 1]] * T and (r.weights[:, k:] == 1).all()
    want = fused_moe_ref(x, w_up, w_down, tw, ids) + torch.relu(x @ shared_up.t()).square() @ shared_down.t()
    got = op(x, up_all, down_all, r.weights, r.ids, out=nan_like(want))
    torch.testing.assert_close(got, want, **tol(torch.float32))


def test_bad_shapes():
    w_up, w_down = torch.zeros(4, 8, 16), torch.zeros(4, 16, 8)
    with pytest.raises(ValueError, match=r"`shared_up` expected shape \(F_s, M=16\) with F_s a multiple of F=8"):
        fuse_shared_expert(w_up, w_down, torch.zeros(12, 16), torch.zeros(16, 12))
    with pytest.raises(ValueError, match=r"`shared_down` expected shape \(M=16, F_s=16\)"):
        fuse_shared_expert(w_up, w_down, torch.zeros(16, 16), torch.zeros(16, 8))
    with pytest.raises(TypeError, match=r"`shared_up` has dtype float16"):
        fuse_shared_expert(w_up, w_down, torch.zeros(16, 16, dtype=torch.float16), torch.zeros(16, 16))


# --- fused_moe_gemv's in-place shared expert and fused k-sum -------------------------------------------
def shared_weights(S, F, M, dtype, device, seed=99):
    g = seeded(seed)
    up = (torch.randn(S * F, M, generator=g) / M ** 0.5).to(device, dtype)
    down = (torch.randn(M, S * F, generator=g) / (S * F) ** 0.5).to(device, dtype)
    return up, down


GEMV_CASES = {  # id: (T, M, F, E, k, S, dtype, fused sum)
    "T1-M48-F40-E6-k2-S2-fp32-sum": (1, 48, 40, 6, 2, 2, torch.float32, True),
    "T1-M48-F40-E6-k2-S2-bf16-sum": (1, 48, 40, 6, 2, 2, torch.bfloat16, True),
    "T3-M48-F40-E6-k2-S2-fp16-sum": (3, 48, 40, 6, 2, 2, torch.float16, True),
    "T2-M48-F40-E6-k3-S1-bf16-sum": (2, 48, 40, 6, 3, 1, torch.bfloat16, True),
    "T2-M48-F40-E6-k2-S2-bf16-sum-kernel": (2, 48, 40, 6, 2, 2, torch.bfloat16, False),
    "T4-M40-F24-E5-k1-S3-fp32-sum": (4, 40, 24, 5, 1, 3, torch.float32, True),
}


@pytest.mark.parametrize("T,M,F,E,k,S,dtype,fused_sum", list(GEMV_CASES.values()), ids=list(GEMV_CASES))
def test_gemv_shared_in_place(T, M, F, E, k, S, dtype, fused_sum, device):
    """The shared expert read where it lies (no fused copy) as S more pairs: routed + shared
    reference; NaN-poisoned out; the arrival counters left zero."""
    x, w_up, w_down, tw, ids = make_inputs(T, M, F, E, k, dtype, device, seed=T + 10 * S)
    su, sd = shared_weights(S, F, M, dtype, device)
    want = fused_moe_ref(x, w_up, w_down, tw, ids, shared_up=su, shared_down=sd)
    ref_sum = fused_moe_ref(x, w_up, w_down, tw, ids).float() + torch.relu(x.float() @ su.float().t()).square() @ sd.float().t()
    torch.testing.assert_close(want.float(), ref_sum, **tol(dtype))  # the reference's shared term is the MLP
    arrivals = torch.zeros(T * M + 5, dtype=torch.int32, device=device) if fused_sum else None
    got = fused_moe_gemv(x, w_up, w_down, tw, ids, out=nan_like(want), shared_up=su, shared_down=sd, arrivals=arrivals)
    torch.testing.assert_close(got.float(), want.float(), **tol(dtype))
    if fused_sum:
        assert not arrivals.any()


GEMV_DOT_CASES = {  # id: (T, dtype, block_n, block_k, shared, fused sum); M=48, F=40, E=6, k=2 (odd tiles)
    "T1-fp32-16x32-shared-sum": (1, torch.float32, 16, 32, True, True),
    "T4-bf16-32x16-shared-sum": (4, torch.bfloat16, 32, 16, True, True),
    "T2-fp16-16x64-routed-kernel": (2, torch.float16, 16, 64, False, False),
    "T3-fp32-8x32-clamped-to-16": (3, torch.float32, 8, 32, True, True),
}


@pytest.mark.parametrize("T,dtype,bn,bk,shared,fused_sum", list(GEMV_DOT_CASES.values()), ids=list(GEMV_DOT_CASES))
def test_gemv_on_tensor_core_tiles(T, dtype, bn, bk, shared, fused_sum, device):
    """The GEMV path with ``gemv_dot`` (each pair's row as row 0 of a 16-row dot): the reference,
    NaN-poisoned out, counters left zero, and the FMA tiles' result within the dtype's rounding."""
    from fastmamba.ops.moe import configs

    M, F, E, k, S = 48, 40, 6, 2, 2
    x, w_up, w_down, tw, ids = make_inputs(T, M, F, E, k, dtype, device, seed=30 + T)
    extra = dict(zip(("shared_up", "shared_down"), shared_weights(S, F, M, dtype, device))) if shared else {}
    want = fused_moe_ref(x, w_up, w_down, tw, ids, **extra)
    arrivals = torch.zeros(T * M, dtype=torch.int32, device=device) if fused_sum else None
    cfg = dict(path="gemv", block_m=16, block_n_up=bn, block_k_up=bk, block_n_down=bn, block_k_down=bk, group_m=1,
               num_warps=4, num_stages=3)
    with configs.forced_config(**cfg, gemv_dot=True):
        got = fused_moe_gemv(x, w_up, w_down, tw, ids, out=nan_like(want), arrivals=arrivals, **extra)
    torch.testing.assert_close(got.float(), want.float(), **tol(dtype))
    if fused_sum:
        assert not arrivals.any()
    with configs.forced_config(**cfg):
        fma = fused_moe_gemv(x, w_up, w_down, tw, ids, **extra)
    torch.testing.assert_close(got.float(), fma.float(), **tol(dtype))


def test_gemv_shared_strided(device):
    """x a transposed view, out every other column of a NaN buffer, the shared weights row slices
    of taller ones (their row strides differ from the experts')."""
    T, M, F, E, k, S = 2, 48, 40, 6, 2, 2
    x, w_up, w_down, tw, ids = make_inputs(T, M, F, E, k, torch.bfloat16, device, seed=21)
    su, sd = shared_weights(S, F, M, torch.bfloat16, device)
    tall_up = torch.randn(2 * S * F, M, device=device, dtype=torch.bfloat16)
    tall_up[::2] = su
    wide_down = torch.randn(M, 3 * S * F, device=device, dtype=torch.bfloat16)
    wide_down[:, S * F:2 * S * F] = sd
    want = fused_moe_ref(x, w_up, w_down, tw, ids, shared_up=su, shared_down=sd)
    big = torch.full((T, 2 * M), float("nan"), dtype=x.dtype, device=device)
    got = fused_moe_gemv(x.t().contiguous().t(), w_up, w_down, tw, ids, out=big[:, ::2], shared_up=tall_up[::2],
                         shared_down=wide_down[:, S * F:2 * S * F], arrivals=torch.zeros(T * M, dtype=torch.int32,
                                                                                         device=device))
    torch.testing.assert_close(got.float(), want.float(), **tol(torch.bfloat16))
    assert torch.isnan(big[:, 1::2]).all()


def test_fused_sum_equals_the_sum_kernel_bit_for_bit(device):
    """The down kernel's last arrival sums the pairs in the sum kernel's order and rounding: the
    two paths agree exactly, with and without a shared expert; a token alone equals it in a batch."""
    T, M, F, E, k, S = 3, 48, 40, 6, 2, 2
    x, w_up, w_down, tw, ids = make_inputs(T, M, F, E, k, torch.bfloat16, device, seed=22)
    su, sd = shared_weights(S, F, M, torch.bfloat16, device)
    ws = torch.zeros(T * M, dtype=torch.int32, device=device)
    for shared in ({}, dict(shared_up=su, shared_down=sd)):
        kernel = fused_moe_gemv(x, w_up, w_down, tw, ids, **shared)
        fused = fused_moe_gemv(x, w_up, w_down, tw, ids, arrivals=ws, **shared)
        assert torch.equal(kernel, fused)
        alone = fused_moe_gemv(x[2:], w_up, w_down, tw[2:], ids[2:], arrivals=ws, **shared)
        assert torch.equal(fused[2:], alone)
    assert not ws.any()


def test_gemv_launches(device, monkeypatch):
    """Two launches with the fused sum (up, down), three without (up, down, sum)."""
    from fastmamba.ops._common.dispatch import interpreter_enabled
    from fastmamba.ops.moe import gemv_kernel, kernel as moe_kernel
    from tests.helpers import count_launches

    if device.type == "cpu" and not interpreter_enabled():
        pytest.skip("the reference runs on a CPU without TRITON_INTERPRET=1")
    x, w_up, w_down, tw, ids = make_inputs(1, 48, 40, 6, 2, torch.float32, device, seed=23)
    su, sd = shared_weights(2, 40, 48, torch.float32, device)
    gemvs = count_launches(monkeypatch, gemv_kernel)
    sums = count_launches(monkeypatch, moe_kernel)  # launch_sum lives beside the grouped GEMMs
    fused_moe_gemv(x, w_up, w_down, tw, ids, shared_up=su, shared_down=sd,
                   arrivals=torch.zeros(48, dtype=torch.int32, device=device))
    assert (gemvs[0], sums[0]) == (2, 0)
    fused_moe_gemv(x, w_up, w_down, tw, ids, shared_up=su, shared_down=sd)
    assert (gemvs[0], sums[0]) == (4, 1)


def test_gemv_config_is_keyed_by_the_shared_slices(device, monkeypatch):
    """fused_moe_gemv asks for the config of its grid: S shared slices beside the k routed pairs (a
    tuned table entry for Nano's decode call is not the routed-only op's)."""
    from fastmamba.ops.moe import configs

    asked = []
    pick = configs.pick_config
    monkeypatch.setattr(configs, "pick_config", lambda *a, **kw: asked.append(kw.get("shared", 0)) or pick(*a, **kw))
    x, w_up, w_down, tw, ids = make_inputs(1, 48, 40, 6, 2, torch.float32, device, seed=24)
    su, sd = shared_weights(3, 40, 48, torch.float32, device)
    want = fused_moe_ref(x, w_up, w_down, tw, ids, shared_up=su, shared_down=sd)
    got = fused_moe_gemv(x, w_up, w_down, tw, ids, shared_up=su, shared_down=sd)
    torch.testing.assert_close(got, want, **tol(torch.float32))
    fused_moe_gemv(x, w_up, w_down, tw, ids)
    assert asked == ([3, 0] if use_triton(x) else [])  # (the reference path picks no config)


@pytest.mark.parametrize("change,exc,match", [
    (lambda a: {**a, "shared_down": None}, ValueError, r"`shared_up` and `shared_down` come together, got only `shared_up`"),
    (lambda a: {**a, "shared_up": a["shared_up"][:12]}, ValueError, r"`shared_up` expected shape \(S\*F, M=16\) with S >= 1 \(F=8\)"),
    (lambda a: {**a, "shared_down": a["shared_down"][:, :8]}, ValueError, r"`shared_down` expected shape \(M=16, S\*F=16\)"),
    (lambda a: {**a, "shared_up": a["shared_up"].half()}, TypeError, r"`shared_up` has dtype float16"),
    (lambda a: {**a, "shared_up": a["shared_up"].t().contiguous().t()}, ValueError,
     r"the shared expert's strides along M / F \(16, 1\) must equal"),
    (lambda a: {**a, "arrivals": torch.zeros(3 * 16 - 1, dtype=torch.int32)}, ValueError,
     r"`arrivals` expected at least T\*M=48 entries, got 47"),
    (lambda a: {**a, "arrivals": torch.zeros(48, dtype=torch.int64)}, TypeError, r"`arrivals` expected dtype in \(int32"),
    (lambda a: {**a, "arrivals": torch.zeros(96, dtype=torch.int32)[::2]}, ValueError, r"`arrivals` must be contiguous"),
], ids=["only-up", "up-not-multiple", "down-shape", "dtype", "stride-M", "arrivals-small", "arrivals-dtype",
        "arrivals-strided"])
def test_gemv_extras_bad_input(change, exc, match):
    x, w_up, w_down, tw, ids = make_inputs(3, 16, 8, 4, 2, torch.float32, torch.device("cpu"))
    su, sd = shared_weights(2, 8, 16, torch.float32, torch.device("cpu"))
    a = change(dict(shared_up=su, shared_down=sd, arrivals=None))
    with pytest.raises(exc, match=match):
        fused_moe_gemv(x, w_up, w_down, tw, ids, **a)


GPU_DOT_TILE = dict(path="gemv", block_m=16, block_n_up=32, block_k_up=128, block_n_down=32, block_k_down=128,
                    group_m=1, num_warps=4, num_stages=4, gemv_dot=True)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["default", "dot-32x128"])
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("T", [1, 4])
def test_gpu_nano_shared_fused_sum_in_graph(T, pdl, tile):
    """Nano's shape in bf16 (128 experts, top-6, the 3712-wide shared expert as 2 slices, the fused
    sum): the reference, then 300 replays of a CUDA graph on new routings, each equal bit for bit to
    the eager three-kernel path (the arrivals must reset and publish every time); with the default
    tile and a tensor-core one (``gemv_dot``: cp.async-pipelined weight tiles)."""
    import contextlib

    from fastmamba.ops.moe import configs

    with configs.forced_config(**GPU_DOT_TILE) if tile != "default" else contextlib.nullcontext():
        _nano_shared_fused_sum_in_graph(T, pdl)


def _nano_shared_fused_sum_in_graph(T, pdl):
    from fastmamba.ops._common.pdl import programmatic_dependent_launch

    M, F, E, k, S = 2688, 1856, 128, 6, 2
    dev = torch.device("cuda")
    x, w_up, w_down, tw, ids = make_inputs(T, M, F, E, k, torch.bfloat16, dev, seed=T)
    su, sd = shared_weights(S, F, M, torch.bfloat16, dev)
    ws = torch.zeros(T * M, dtype=torch.int32, device=dev)
    want = fused_moe_ref(x, w_up, w_down, tw, ids, shared_up=su, shared_down=sd)
    got = fused_moe_gemv(x, w_up, w_down, tw, ids, shared_up=su, shared_down=sd, arrivals=ws)
    torch.testing.assert_close(got.float(), want.float(), **tol(torch.bfloat16))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_moe_gemv(x, w_up, w_down, tw, ids, shared_up=su, shared_down=sd, arrivals=ws)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with programmatic_dependent_launch(pdl), torch.cuda.graph(graph):
        captured = fused_moe_gemv(x, w_up, w_down, tw, ids, shared_up=su, shared_down=sd, arrivals=ws)
    for i in range(300):
        g = seeded(1000 + i)
        x.copy_(torch.randn(T, M, generator=g).to(dev, torch.bfloat16))
        ids.copy_(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(dev, torch.int32))
        graph.replay()
        assert torch.equal(captured, fused_moe_gemv(x, w_up, w_down, tw, ids, shared_up=su, shared_down=sd)), i
    assert not ws.any()
