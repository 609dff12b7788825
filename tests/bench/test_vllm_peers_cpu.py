"""vLLM's Triton mamba ops as bench peers (fastmamba/bench/peers.py): each loads from the git-ignored
peers/vllm_mamba_ops/ with its stand-in modules, and the bench adapters (our positional signatures)
give the reference's answer on a tiny shape under the Triton interpreter. Skipped where peers/ is
absent (it is extracted from the vLLM wheel: see peers.py)."""
from __future__ import annotations

import sys

import pytest
import torch

from fastmamba.bench import peers
from fastmamba.ops._common.dispatch import interpreter_enabled

pytestmark = pytest.mark.skipif(peers.vllm_ops_dir() is None, reason="peers/vllm_mamba_ops/ not extracted")

LOADERS = (peers.vllm_selective_state_update, peers.vllm_causal_conv1d_update, peers.vllm_causal_conv1d_fn,
           peers.vllm_chunk_scan_combined)


@pytest.fixture
def vllm(device):
    """The stand-in ``vllm.*`` modules live only for the test (other tests probe for a real vllm)."""
    if device.type != "cuda" and not interpreter_enabled():
        pytest.skip("vLLM's ops are Triton kernels: CPU runs need TRITON_INTERPRET=1")
    before = set(sys.modules)
    yield peers
    for name in set(sys.modules) - before:
        if name == "vllm" or name.startswith("vllm."):
            del sys.modules[name]
    for loader in (*LOADERS, peers._vllm_module):
        loader.cache_clear()


def _ssu_inputs(device, B=3, S=5, H=4, P=16, N=16, G=2):
    g = torch.Generator().manual_seed(0)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(device)

    A_h = -torch.rand(H, generator=g).to(device) - 0.5
    return dict(
        state=r(S, H, P, N, scale=0.5), x=r(B, H, P), dt=r(B, H, scale=0.5).unsqueeze(-1).expand(B, H, P),
        A=A_h[:, None, None].expand(H, P, N), B=r(B, G, N, scale=0.3), C=r(B, G, N, scale=0.3),
        D=r(H)[:, None].expand(H, P), z=r(B, H, P), dt_bias=r(H, scale=0.1)[:, None].expand(H, P),
        idx=torch.tensor([4, -1, 1], dtype=torch.int32, device=device),
    )


def test_every_vllm_peer_loads(vllm):
    for loader in LOADERS:
        peer = loader()
        assert peer.available, peer.reason
        assert peer.name == "vLLM" and peer.version == peers.VLLM_VERSION
        assert "peers/vllm_mamba_ops" in peer.source.replace("\\", "/")


def test_vllm_selective_state_update_matches_reference(vllm, device):
    from fastmamba.bench.ops.state_update import vllm_adapter
    from fastmamba.ops.state_update.ref import selective_state_update_ref

    i = _ssu_inputs(device)
    args = [i[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")]
    mine, theirs = i["state"].clone(), i["state"].clone()
    y = vllm_adapter(vllm.vllm_selective_state_update().fn)(mine, *args, True, i["idx"])
    want = selective_state_update_ref(theirs, *args, True, i["idx"])
    live = [0, 2]  # row 1 is the pad slot: vLLM leaves its output unwritten, the reference zeroes it
    torch.testing.assert_close(y[live], want[live], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    assert not torch.equal(mine[4], i["state"][4]) and torch.equal(mine[[0, 2, 3]], i["state"][[0, 2, 3]])


def test_vllm_causal_conv1d_update_matches_reference(vllm, device):
    from fastmamba.bench.ops.conv1d import vllm_adapter
    from fastmamba.ops.conv1d.ref import causal_conv1d_update_ref

    g = torch.Generator().manual_seed(1)
    B, D, W, S = 3, 40, 4, 5  # D not a power of two
    x, state = torch.randn(B, D, generator=g).to(device), torch.randn(S, D, W - 1, generator=g).to(device)
    weight, bias = (torch.randn(D, W, generator=g) * 0.5).to(device), (torch.randn(D, generator=g) * 0.1).to(device)
    idx = torch.tensor([2, -1, 0], dtype=torch.int32, device=device)
    mine, theirs = state.clone(), state.clone()
    y = vllm_adapter(vllm.vllm_causal_conv1d_update().fn)(x, mine, weight, bias, "silu", None, idx)
    want = causal_conv1d_update_ref(x, theirs, weight, bias, "silu", None, idx)
    torch.testing.assert_close(y[[0, 2]], want[[0, 2]], atol=1e-4, rtol=1e-4)
    assert torch.equal(mine, theirs)  # data movement: exact
    assert not torch.equal(mine, state)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense-L37", "varlen-3seqs"])
def test_vllm_chunk_scan_matches_reference(vllm, device, varlen):
    from fastmamba.bench.ops.ssd_scan import REL_TOL, SsdScanBench, ScanFns
    from fastmamba.bench.ops._base import Provider
    from fastmamba.ops.ssd_scan.ref import mamba_chunk_scan_combined_ref, ssd_scan_varlen_ref

    bench = SsdScanBench()
    case = bench._case("tiny", 2, 8, 8, 1, 37, 16, torch.float32, torch.float32, 3 if varlen else 0)
    inp = bench.make_set(case, device, seed=0)
    prov = Provider("vLLM", "peer", peers.VLLM_VERSION, ScanFns(vllm.vllm_chunk_scan_combined().fn, None, style="vllm"))
    ref = Provider("torch-ref", "ref", "", ScanFns(mamba_chunk_scan_combined_ref, ssd_scan_varlen_ref))
    mine = {k: (v.clone() if k == "ssm_states" else v) for k, v in inp.items()}
    theirs = {k: (v.clone() if k == "ssm_states" else v) for k, v in inp.items()}
    got, want = bench.results(prov, case, mine), bench.results(ref, case, theirs)
    assert set(got) == set(want)
    # The interpreter runs vLLM's tl.dot in exact fp32, so on the CPU the answers agree to 1e-4. On a
    # GPU, Triton's tl.dot on fp32 operands defaults to tf32 (inputs rounded to a 10-bit mantissa,
    # unit roundoff 2^-11 ~ 4.9e-4), and the chunked scan chains several such dots (C.B, the chunk
    # states, C.prev_states): an H100 run gave elementwise differences up to 3.2e-3 on O(1) values
    # (relative 0.03-0.07 on near-zero ones). There: 1e-2 per element, and the relative error norm
    # within the bench's own criterion (REL_TOL, 1e-2; tf32 gives about 1e-3).
    tol = 1e-2 if device.type == "cuda" else 1e-4
    for name in want:
        g, w = got[name].float(), want[name].float()
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)
        assert ((g - w).norm() / w.norm()).item() < (REL_TOL if device.type == "cuda" else 1e-5), name
    if varlen:  # slots of no sequence untouched
        used = set(inp["cache_indices"].tolist())
        other = [s for s in range(inp["ssm_states"].shape[0]) if s not in used]
        assert torch.equal(mine["ssm_states"][other], inp["ssm_states"][other])
    assert bench.check(prov, ref, case, inp) == "ok"


@pytest.mark.gpu
def test_vllm_causal_conv1d_fn_matches_reference(vllm, device):
    """GPU only: its launch grid callback rewrites a kernel argument, which the interpreter cannot run."""
    from fastmamba.bench.ops.conv1d_fn import vllm_adapter
    from fastmamba.ops.conv1d_fn.ref import causal_conv1d_fn_ref

    g = torch.Generator().manual_seed(2)
    B, D, L, W = 2, 72, 19, 4
    x = torch.randn(B, L, D, generator=g).to(device).transpose(1, 2)  # channel-last
    weight, bias = (torch.randn(D, W, generator=g) * 0.5).to(device), (torch.randn(D, generator=g) * 0.1).to(device)
    y = vllm_adapter(vllm.vllm_causal_conv1d_fn().fn)(x, weight, bias, None, None, False, None, "silu")
    torch.testing.assert_close(y, causal_conv1d_fn_ref(x, weight, bias, activation="silu"), atol=1e-4, rtol=1e-4)
