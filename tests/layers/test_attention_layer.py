"""The attention layer's Q/K/V projections in one GEMM: q_proj's, k_proj's and v_proj's weights lie
back to back in one storage (``Attention.qkv_weight``), the checkpoint's names and shapes unchanged;
where the aliasing ends (``module.to``, a replaced projection) the layer runs three projections and
gives the same values."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fastmamba.layers.attention import Attention
from tests.helpers import seeded


def make_layer(dtype=torch.float32) -> Attention:
    layer = Attention(40, 6, 2, 8, dtype=dtype)
    g = seeded(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(dtype) * 0.2)
    return layer


def separate(layer: Attention, u: torch.Tensor, hq: int = 6, hkv: int = 2, dh: int = 8):
    """The definition: three projections from the layer's own weights."""
    lead = u.shape[:-1]
    return (F.linear(u, layer.q_proj.weight).view(*lead, hq, dh), F.linear(u, layer.k_proj.weight).view(*lead, hkv, dh),
            F.linear(u, layer.v_proj.weight).view(*lead, hkv, dh))


class _Linears(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket.__name__ in ("mm", "addmm", "linear", "matmul", "bmm")
        return func(*args, **(kwargs or {}))


def test_one_gemm_same_values_and_the_checkpoints_names():
    layer = make_layer()
    w = layer.qkv_weight()
    assert w is not None and tuple(w.shape) == ((6 + 2 + 2) * 8, 40)
    assert torch.equal(w, torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight]))
    sd = layer.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items() if k.endswith("proj.weight")} == {
        "q_proj.weight": (48, 40), "k_proj.weight": (16, 40), "v_proj.weight": (16, 40), "o_proj.weight": (40, 48)}
    u = torch.randn(2, 3, 40, generator=seeded(1))
    with torch.no_grad(), _Linears() as mode:
        got = layer._qkv(u)
    assert mode.n == 1
    for g, want in zip(got, separate(layer, u)):
        torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-6)
    assert not got[1].is_contiguous()  # k and v are strided views of the one output


def test_loading_keeps_the_aliasing_and_module_to_ends_it():
    layer = make_layer()
    other = make_layer()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.5)
    layer.load_state_dict(other.state_dict())  # copies into the views
    assert layer.qkv_weight() is not None
    assert torch.equal(layer.k_proj.weight, other.k_proj.weight)
    u = torch.randn(5, 40, generator=seeded(2))
    with torch.no_grad():
        fused = layer._qkv(u)
        layer.to(torch.float64)  # every parameter gets a storage of its own: three GEMMs again
        assert layer.qkv_weight() is None
        with _Linears() as mode:
            three = layer._qkv(u.double())
    assert mode.n == 3
    for a, b in zip(fused, three):
        torch.testing.assert_close(a.double(), b, rtol=1e-6, atol=1e-6)


def test_a_replaced_or_biased_projection_runs_three():
    layer = make_layer()
    layer.v_proj = nn.Linear(40, 16, bias=True)
    assert layer.qkv_weight() is None
    u = torch.randn(4, 40, generator=seeded(3))
    with torch.no_grad():
        q, k, v = layer._qkv(u)
        torch.testing.assert_close(v, layer.v_proj(u).view(4, 2, 8))
        torch.testing.assert_close(q, F.linear(u, layer.q_proj.weight).view(4, 6, 8))


def test_a_hook_on_a_projection_sees_its_call():
    """A forward hook on k_proj (a user's, or a test's fake quantisation) is called with k_proj's
    own output, and what it returns is what the layer uses."""
    layer = make_layer()
    seen = []
    handle = layer.k_proj.register_forward_hook(lambda mod, args, out: seen.append(out.shape) or out * 0)
    u = torch.randn(3, 40, generator=seeded(4))
    with torch.no_grad():
        q, k, v = layer._qkv(u)
    assert seen == [torch.Size([3, 16])] and not k.any() and v.any()
    handle.remove()
    assert layer.qkv_weight() is not None


@pytest.mark.gpu
def test_decode_rows_take_the_triton_gemv_on_a_gpu(monkeypatch):
    """On a GPU a decode step's rows (bf16, at most GEMV_MAX_ROWS) read Q/K/V and o_proj through
    the Triton gemv (two launches), equal to F.linear within bf16 rounding; more rows take F.linear."""
    import fastmamba.layers.attention as attention

    layer = Attention(256, 4, 2, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.05)
    calls = []
    real = attention.gemv
    monkeypatch.setattr(attention, "gemv", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    u = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    o = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got = layer._qkv(u)
        out = layer._out(o)
        for g, want in zip(got, separate(layer, u, 4, 2, 64)):
            torch.testing.assert_close(g, want, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(out, F.linear(o, layer.o_proj.weight), rtol=2e-2, atol=2e-2)
        assert calls == [torch.Size([512, 256]), torch.Size([256, 256])]
        layer._qkv(torch.randn(40, 256, device="cuda", dtype=torch.bfloat16))  # past GEMV_MAX_ROWS: F.linear
    assert len(calls) == 2
