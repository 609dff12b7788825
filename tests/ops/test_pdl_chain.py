"""Programmatic dependent launch: a decode-step chain (conv update -> state update -> gated norm)
captured in a CUDA graph with PDL on gives exactly what eager launches without PDL give."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastmamba.ops import causal_conv1d_update, rmsnorm_fn, selective_state_update
from fastmamba.ops._common.pdl import programmatic_dependent_launch


def _step(conv_state, ssm_state, xBC, z, dt, conv_w, conv_b, A, D, dt_bias, norm_w, idx, H, P, G, N):
    xBC = causal_conv1d_update(xBC, conv_state, conv_w, conv_b, "silu", conv_state_indices=idx)
    x, Bm, Cm = torch.split(xBC, [H * P, G * N, G * N], dim=-1)
    nreq = x.shape[0]
    y = selective_state_update(ssm_state, x.view(nreq, H, P), dt, A, Bm.view(nreq, G, N), Cm.view(nreq, G, N),
                               D, z.view(nreq, H, P), dt_bias, True, idx)
    return rmsnorm_fn(y.view(nreq, H * P), norm_w, None, group_size=H * P // G)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs a Hopper (sm_90) or newer GPU")
def test_pdl_graph_chain_matches_eager():
    torch.manual_seed(0)
    dev, B, H, P, G, N, W = "cuda", 8, 16, 64, 2, 128, 4
    E = H * P + 2 * G * N
    S = 2 * B
    conv_state = torch.randn(S, E, W - 1, device=dev, dtype=torch.bfloat16)
    ssm_state = torch.randn(S, H, P, N, device=dev)
    conv_w = torch.randn(E, W, device=dev, dtype=torch.bfloat16) * 0.3
    conv_b = torch.randn(E, device=dev, dtype=torch.bfloat16)
    A = (-torch.exp(torch.rand(H, device=dev)))[:, None, None].expand(H, P, N)
    D = torch.randn(H, device=dev)[:, None].expand(H, P)
    dt_bias = torch.randn(H, device=dev)[:, None].expand(H, P)
    norm_w = torch.randn(H * P, device=dev, dtype=torch.bfloat16)
    idx = torch.randperm(S, device=dev)[:B].to(torch.int32)
    xBC = torch.randn(B, E, device=dev, dtype=torch.bfloat16)
    z = torch.randn(B, H * P, device=dev, dtype=torch.bfloat16)
    dt = F.softplus(torch.randn(B, H, device=dev) - 3)[..., None].expand(B, H, P).to(torch.bfloat16)
    args = (xBC, z, dt, conv_w, conv_b, A, D, dt_bias, norm_w, idx, H, P, G, N)

    cs_eager, ss_eager = conv_state.clone(), ssm_state.clone()
    outs_eager = [_step(cs_eager, ss_eager, *args) for _ in range(3)]

    cs_graph, ss_graph = conv_state.clone(), ssm_state.clone()
    with programmatic_dependent_launch():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm up on copies
            _step(cs_graph.clone(), ss_graph.clone(), *args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _step(cs_graph, ss_graph, *args)
    for expected in outs_eager:
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
    assert torch.equal(cs_graph, cs_eager) and torch.equal(ss_graph, ss_eager)
