"""Programmatic dependent launch: a decode-step chain (conv update -> state update -> gated norm)
and a speculative verify chain (conv update over T tokens -> replay precompute -> replay main)
captured in a CUDA graph with PDL on give exactly what eager launches without PDL give."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastmamba.ops import (
    allocate_replay_cache,
    causal_conv1d_update,
    replay_selective_state_update,
    rmsnorm_fn,
    selective_state_update,
)
from fastmamba.ops._common.pdl import programmatic_dependent_launch


def _step(conv_state, ssm_state, xBC, z, dt, conv_w, conv_b, A, D, dt_bias, norm_w, idx, H, P, G, N):
    xBC = causal_conv1d_update(xBC, conv_state, conv_w, conv_b, "silu", conv_state_indices=idx)
    x, Bm, Cm = torch.split(xBC, [H * P, G * N, G * N], dim=-1)
    nreq = x.shape[0]
    y = selective_state_update(ssm_state, x.view(nreq, H, P), dt, A, Bm.view(nreq, G, N), Cm.view(nreq, G, N),
                               D, z.view(nreq, H, P), dt_bias, True, idx)
    return rmsnorm_fn(y.view(nreq, H * P), norm_w, None, group_size=H * P // G)


def _replays_match(warm_up, step, outs_eager, before_replay=None, pdl: bool = True) -> None:
    """With PDL on (or switched off: ``pdl``): run ``warm_up`` (compiles, on copies) on a side stream,
    capture ``step`` in a CUDA graph, then replay it once per eager output (after ``before_replay()``,
    when given); each replay's output must equal it exactly."""
    with programmatic_dependent_launch(pdl):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm_up()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
    for expected in outs_eager:
        if before_replay is not None:
            before_replay()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


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
    _replays_match(lambda: _step(cs_graph.clone(), ss_graph.clone(), *args), lambda: _step(cs_graph, ss_graph, *args),
                   outs_eager)
    assert torch.equal(cs_graph, cs_eager) and torch.equal(ss_graph, ss_eager)


def _verify_step(conv_state, cache, xBC, z, dt, conv_w, conv_b, A, D, dt_bias, idx, conv_acc, accepted, H, P, G, N):
    """A speculative verify step of T tokens: conv update at the accepted offset -> replay -> commit."""
    nreq, T, E = xBC.shape
    conv_out = xBC.new_empty(nreq, T, E)
    causal_conv1d_update(xBC.transpose(1, 2), conv_state, conv_w, conv_b, "silu", conv_state_indices=idx,
                         num_accepted_tokens=conv_acc, out=conv_out.transpose(1, 2))
    x, Bm, Cm = torch.split(conv_out, [H * P, G * N, G * N], dim=-1)
    y = replay_selective_state_update(*cache, x.reshape(nreq, T, H, P), dt, A, Bm.reshape(nreq, T, G, N),
                                      Cm.reshape(nreq, T, G, N), D, z.view(nreq, T, H, P), dt_bias, True, idx)
    cache.commit(idx, accepted, T)
    return y


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs a Hopper (sm_90) or newer GPU")
@pytest.mark.parametrize("B", [1, 8])
def test_pdl_verify_chain_matches_eager(B):
    """conv update -> replay precompute -> replay main (-> commit), captured with PDL on, replayed
    over several steps (the history fills and checkpoints): bit-identical to eager without PDL."""
    torch.manual_seed(1)
    dev, H, P, G, N, W, T = "cuda", 16, 64, 2, 128, 4, 4
    E = H * P + 2 * G * N
    S = 2 * B
    conv_state = torch.randn(S, E, W - 1 + T - 1, device=dev, dtype=torch.bfloat16)
    cache = allocate_replay_cache(S, T, H, P, G, N, torch.float32, torch.bfloat16, dev, history=8)
    cache.state.normal_()
    conv_w = torch.randn(E, W, device=dev, dtype=torch.bfloat16) * 0.3
    conv_b = torch.randn(E, device=dev, dtype=torch.bfloat16)
    A = -torch.exp(torch.rand(H, device=dev))
    D, dt_bias = torch.randn(H, device=dev), torch.randn(H, device=dev) * 0.3
    idx = torch.randperm(S, device=dev)[:B].to(torch.int32)
    conv_acc = torch.randint(1, T + 1, (B,), device=dev, dtype=torch.int32)
    accepted = torch.randint(1, T + 1, (B,), device=dev, dtype=torch.int32)
    xBC = torch.randn(B, T, E, device=dev, dtype=torch.bfloat16)
    z = torch.randn(B, T, H * P, device=dev, dtype=torch.bfloat16)
    dt = torch.randn(B, T, H, device=dev) - 3
    args = (xBC, z, dt, conv_w, conv_b, A, D, dt_bias, idx, conv_acc, accepted, H, P, G, N)

    def copies():
        return conv_state.clone(), type(cache)(*(t.clone() for t in cache))

    cs_eager, c_eager = copies()
    outs_eager = [_verify_step(cs_eager, c_eager, *args).clone() for _ in range(4)]

    cs_graph, c_graph = copies()
    _replays_match(lambda: _verify_step(*copies(), *args), lambda: _verify_step(cs_graph, c_graph, *args), outs_eager)
    assert torch.equal(cs_graph, cs_eager)
    for name, a, b in zip(type(cache)._fields, c_graph, c_eager):
        assert torch.equal(a, b), name
    assert int(c_eager.hist_len.max()) < 8 and bool((c_eager.buf_idx != 0).any() or (c_eager.hist_len != 0).any())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs a Hopper (sm_90) or newer GPU")
@pytest.mark.parametrize("fused", [True, False])
def test_pdl_prefill_chain_matches_eager(fused):
    """A short prefill's chain (varlen conv -> scan -> gated norm), pad slot and all, captured with
    PDL: the fused scan reads its slot's state before the grid-dependency wait; the five kernels of
    the chunked path (16-token chunks here: several per sequence) each wait at their start."""
    from fastmamba.ops import causal_conv1d_varlen, ssd_scan_varlen
    from fastmamba.ops._common.host_values import trusted_inputs

    torch.manual_seed(1)
    dev, H, P, G, N, W = "cuda", 16, 64, 1, 128, 4
    E = H * P + 2 * G * N
    lengths = [37, 1, 20, 6]  # the last: a padding request on slot -1
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    slots = torch.tensor([2, 0, 5, -1], dtype=torch.int32, device=dev)
    flags = torch.tensor([True, False, True, False], device=dev)
    T = sum(lengths)
    conv_w = torch.randn(E, W, device=dev, dtype=torch.bfloat16) * 0.3
    conv_b = torch.randn(E, device=dev, dtype=torch.bfloat16)
    A_log, D = torch.rand(H, device=dev), torch.randn(H, device=dev)
    dt_bias, norm_w = torch.randn(H, device=dev) * 0.3, torch.randn(H * P, device=dev, dtype=torch.bfloat16)
    xBC = torch.randn(T, E, device=dev, dtype=torch.bfloat16)
    z = torch.randn(T, H, P, device=dev, dtype=torch.bfloat16)
    dt = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    conv0 = torch.randn(8, E, W - 1, device=dev, dtype=torch.bfloat16)
    ssm0 = torch.randn(8, H, P, N, device=dev)

    def step(conv_state, ssm_state):
        with trusted_inputs():
            xc = causal_conv1d_varlen(xBC, conv_w, conv_b, conv_state, cu, slots, flags, "silu")
            x, Bm, Cm = torch.split(xc, [H * P, G * N, G * N], dim=-1)
            y = ssd_scan_varlen(x.view(T, H, P), dt, A_log, Bm.view(T, G, N), Cm.view(T, G, N), ssm_state, cu,
                                D=D, z=z, dt_bias=dt_bias, cache_indices=slots, has_initial_state=flags,
                                A_is_log=True, fused=fused, chunk_size=256 if fused else 16,
                                max_seqlen=max(lengths))
        return torch.cat([rmsnorm_fn(y.view(T, H * P), norm_w, None, group_size=H * P // G).flatten().float(),
                          ssm_state.flatten(), conv_state.flatten().float()])

    want = step(conv0.clone(), ssm0.clone())
    conv_g, ssm_g = conv0.clone(), ssm0.clone()

    def reset():  # every replay starts from the same states
        conv_g.copy_(conv0)
        ssm_g.copy_(ssm0)

    _replays_match(lambda: step(conv0.clone(), ssm0.clone()), lambda: step(conv_g, ssm_g), [want] * 3,
                   before_replay=reset)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs a Hopper (sm_90) or newer GPU")
@pytest.mark.parametrize("hopper_scan", ["off", "auto"])
def test_scan_kernels_chained_with_pdl_match_plain_launches(monkeypatch, hopper_scan):
    """With PDL switched off, the chunked scan's kernels after its first still launch with PDL (each
    waits at its start for the one before): eager and graphed outputs, final states included, equal
    those of plain launches (``pdl_chained`` replaced by ``pdl_active``), at 4 chunks of 256 tokens with a
    ragged tail."""
    from fastmamba.ops import mamba_chunk_scan_combined
    from fastmamba.ops._common import pdl
    from fastmamba.ops.ssd_scan.chunked import launch
    from fastmamba.ops.ssd_scan.hopper import chunk_output as hopper
    from fastmamba.ops.ssd_scan.hopper import states as hopper_states

    monkeypatch.setenv("FASTMAMBA_HOPPER_SCAN", hopper_scan)
    torch.manual_seed(2)
    dev, L, H, P, G, N = "cuda", 1000, 16, 64, 2, 128
    x, z = (torch.randn(1, L, H, P, device=dev, dtype=torch.bfloat16) for _ in range(2))
    dt = torch.randn(1, L, H, device=dev)
    A = -torch.rand(H, device=dev) - 0.5
    B, C = (torch.randn(1, L, G, N, device=dev, dtype=torch.bfloat16) for _ in range(2))
    D, bias = torch.randn(H, device=dev), torch.randn(H, device=dev)
    init = torch.randn(1, H, P, N, device=dev) * 0.1

    def call():
        with hopper.hopper_kernels():
            y, final = mamba_chunk_scan_combined(x, dt, A, B, C, 256, D=D, z=z, dt_bias=bias, dt_softplus=True,
                                                 initial_states=init, return_final_states=True)
        return torch.cat([y.flatten().float(), final.flatten()])

    monkeypatch.setattr(pdl, "_enabled", False)
    with monkeypatch.context() as plain_launches:
        for module in (launch, hopper, hopper_states):
            plain_launches.setattr(module, "pdl_chained", pdl.pdl_active)
        plain = call()
    assert torch.equal(call(), plain)
    _replays_match(call, call, [plain] * 3, pdl=False)
