"""The shared expert fused into the routed call: fused_moe over [routed + shared slices] equals the
routed reference plus the shared MLP (relu², non-gated), on both paths (CPU: the interpreter)."""
from __future__ import annotations

import pytest
import torch

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
