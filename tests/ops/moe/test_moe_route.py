"""moe_route (Nemotron-3's sigmoid router) vs its reference (CPU: the Triton interpreter).

Base row: T=7 tokens, E=8 experts, top-2, no bias, renormalised, scale 1; each other row changes
one or two things. Ids must be equal (same order: best first); weights within fp32 tolerance.
"""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops.moe import Routing, moe_route
from fastmamba.ops.moe.ref import moe_route_ref
from tests.helpers import seeded

CASES = {  # id: (T, E, top_k, bias, n_group, topk_group, norm, scale, dtype)
    "T7-E8-k2": (7, 8, 2, False, 1, 1, True, 1.0, torch.float32),
    "T7-E8-k2-bias": (7, 8, 2, True, 1, 1, True, 1.0, torch.float32),
    "T7-E8-k3-bias-G4-keep2": (7, 8, 3, True, 4, 2, True, 2.5, torch.float32),
    "T5-E6-k2-bias-G3-keep1-nonorm": (5, 6, 2, True, 3, 1, False, 5.0, torch.float32),
    "T3-E4-k2-G4-keep2": (3, 4, 2, True, 4, 2, True, 1.0, torch.float32),  # one expert per group
    "T1-E5-k5": (1, 5, 5, True, 1, 1, True, 1.0, torch.float32),  # k == E, E not a power of two
    "T7-E8-k2-bf16-logits": (7, 8, 2, True, 1, 1, True, 1.0, torch.bfloat16),
    "T20-E24-k6-bias-G4-keep2": (20, 24, 6, True, 4, 2, True, 2.5, torch.float32),
}


@pytest.mark.parametrize("T,E,k,has_bias,n_group,topk_group,norm,scale,dtype", list(CASES.values()), ids=list(CASES))
def test_matches_reference(T, E, k, has_bias, n_group, topk_group, norm, scale, dtype, device):
    g = seeded(T * E + k)
    logits = (torch.randn(T, E, generator=g) * 2).to(device, dtype)
    bias = (torch.randn(E, generator=g) * 0.3).to(device) if has_bias else None
    kw = dict(top_k=k, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scale)
    got = moe_route(logits, bias, **kw)
    want = moe_route_ref(logits, bias, **kw)
    assert isinstance(got, Routing) and got.ids.dtype == torch.int32 and got.weights.dtype == torch.float32
    assert torch.equal(got.ids.cpu(), want.ids.cpu())
    torch.testing.assert_close(got.weights, want.weights, atol=1e-6, rtol=1e-5)


def test_strided_logits(device):
    """Logits as a transposed view (stride 1 along T)."""
    g = seeded(11)
    logits = torch.randn(8, 6, generator=g).to(device).t()  # [6, 8] with strides (1, 6)
    bias = torch.randn(8, generator=g).to(device) * 0.1
    got = moe_route(logits, bias, top_k=3, n_group=2, topk_group=1)
    want = moe_route_ref(logits, bias, top_k=3, n_group=2, topk_group=1)
    assert torch.equal(got.ids.cpu(), want.ids.cpu())
    torch.testing.assert_close(got.weights, want.weights, atol=1e-6, rtol=1e-5)


def test_bias_selects_but_does_not_weigh(device):
    """A large bias on expert 3 makes every token choose it, yet its weight is its plain score."""
    logits = torch.zeros(2, 4, device=device)
    logits[:, 0] = 1.0
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0], device=device)
    r = moe_route(logits, bias, top_k=2, norm_topk_prob=False)
    assert r.ids.cpu().tolist() == [[3, 0], [3, 0]]
    torch.testing.assert_close(r.weights.cpu(), torch.tensor([[0.5, torch.tensor(1.0).sigmoid().item()]] * 2))


def test_ties_take_the_lower_id_and_negative_choices_keep_their_order(device):
    """Equal choices go lowest id first; choices below zero (a negative bias) order as floats do
    (the kernel's argmax compares the choices' bits mapped to a signed order)."""
    logits = torch.tensor([[0.5, 1.0, 1.0, -3.0, 1.0, 0.5, -1.0]], device=device)
    bias = torch.tensor([-2.0, -2.0, -2.0, 0.0, -2.0, 0.0, -2.5], device=device)
    kw = dict(top_k=6, norm_topk_prob=False)
    got, want = moe_route(logits, bias, **kw), moe_route_ref(logits, bias, **kw)
    assert got.ids.cpu().tolist() == [[5, 3, 1, 2, 4, 0]]
    assert sorted(want.ids.cpu().tolist()[0]) == [0, 1, 2, 3, 4, 5]  # torch.topk orders ties as it likes
    torch.testing.assert_close(got.weights, want.weights, atol=1e-6, rtol=1e-5)  # tied experts weigh the same


def test_no_tokens(device):
    r = moe_route(torch.empty(0, 8, device=device), None, top_k=2)
    assert r.weights.shape == (0, 2) and r.ids.shape == (0, 2)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(top_k=9), ValueError, r"`top_k`=9 must lie in \[1, 8\]"),
    (dict(top_k=0), ValueError, r"`top_k`=0 must lie in \[1, 8\]"),
    (dict(top_k=2, n_group=3), ValueError, r"`n_group`=3 must be >= 1 and divide E=8"),
    (dict(top_k=2, n_group=4, topk_group=5), ValueError, r"`topk_group`=5 must lie in \[1, n_group=4\]"),
    (dict(top_k=5, n_group=4, topk_group=2), ValueError, r"`top_k`=5 must lie in \[1, 4\] .*2 of 4 groups kept"),
    (dict(top_k=2.0), TypeError, r"`top_k` expected an int"),
    (dict(top_k=2, bias=torch.zeros(7)), ValueError, r"`correction_bias` expected shape \(E=8,\)"),
    (dict(top_k=2, logits=torch.zeros(8)), ValueError, r"`router_logits` expected shape \(T, E\)"),
    (dict(top_k=2, logits=torch.zeros(2, 8, dtype=torch.int32)), TypeError, r"`router_logits` expected dtype"),
], ids=["k>E", "k0", "E%G", "topk_group>G", "k>kept", "k-float", "bias-shape", "logits-1d", "logits-int"])
def test_bad_input(kwargs, exc, match):
    logits = kwargs.pop("logits", torch.zeros(3, 8))
    bias = kwargs.pop("bias", None)
    with pytest.raises(exc, match=match):
        moe_route(logits, bias, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,k", [(1, 128, 6), (4096, 128, 6), (64, 512, 22)])
def test_gpu_shapes(T, E, k):
    g = seeded(T)
    logits = torch.randn(T, E, generator=g).cuda()
    bias = (torch.randn(E, generator=g) * 0.1).cuda()
    got = moe_route(logits, bias, top_k=k, routed_scaling_factor=2.5)
    want = moe_route_ref(logits, bias, top_k=k, routed_scaling_factor=2.5)
    assert torch.equal(got.ids, want.ids)
    torch.testing.assert_close(got.weights, want.weights, atol=1e-6, rtol=1e-5)
