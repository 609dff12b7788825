"""ssd_scan_varlen's deferred norm (norm_weight / norm_sumsq): out = y * norm_weight and the sums of
y^2 over each 16 columns, on both paths (the fused short-prompt kernel and the chunked kernels),
against the op without it and against the reference."""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops.ssd_scan import ssd_scan_varlen
from fastmamba.ops.ssd_scan.ref import ssd_scan_varlen_ref
from tests.helpers import nan_like, seeded, tol
from tests.ops.ssd_scan.test_ssd_scan import _inputs

PAD = -1


def _call(device, lens, slots, *, H=3, P=32, dtype=torch.float32, fused=None, seed=0, strided=False):
    T = sum(lens)
    inp = _inputs((T,), H, P, 1, 16, dtype, device, seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    S = len(lens) + 2
    states = torch.randn(S, H, P, 16, generator=seeded(seed + 1)).to(device)
    kw = dict(chunk_size=16, D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], fused=fused,
              cache_indices=torch.tensor(slots, dtype=torch.int32, device=device),
              has_initial_state=torch.ones(len(lens), dtype=torch.bool, device=device))
    x = inp["x"]
    if strided:  # x as every other head of a wider buffer
        wide = torch.zeros(T, 2 * H, P, dtype=dtype, device=device)
        wide[:, ::2] = x
        x = wide[:, ::2]
    args = (x, inp["dt"], inp["A"], inp["B"], inp["C"])
    nw = (1 + 0.5 * torch.randn(H * P, generator=seeded(seed + 2))).to(device, dtype)
    return args, states, cu, kw, nw


# odd lengths (1 token, a chunk and a bit, an empty sequence), a pad slot, fp32 and bf16, both paths
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "chunked"])
@pytest.mark.parametrize("lens,slots,strided", [
    ((1, 21, 0, 6), (2, 0, 4, PAD), False),
    ((5,), (1,), True),  # batch 1, non-contiguous x
], ids=["odd-lens-pad", "B1-strided"])
def test_deferred_norm_matches_the_plain_scan(device, dtype, fused, lens, slots, strided):
    args, states, cu, kw, nw = _call(device, lens, slots, dtype=dtype, fused=fused, strided=strided)
    T, H, P = args[0].shape
    plain_states = states.clone()
    plain = ssd_scan_varlen(*args, plain_states, cu, **kw)
    sumsq = nan_like(torch.empty(T, H * P // 16, dtype=torch.float32, device=device))
    out = nan_like(torch.empty_like(plain))
    got = ssd_scan_varlen(*args, states, cu, **kw, out=out, norm_weight=nw, norm_sumsq=sumsq)
    assert got is out
    torch.testing.assert_close(states, plain_states, **tol(dtype))  # the states do not depend on it
    y = plain.float().reshape(T, H * P)
    torch.testing.assert_close(got.float().reshape(T, H * P), y * nw.float(), **tol(dtype))
    want = y.square().reshape(T, -1, 16).sum(-1)
    torch.testing.assert_close(sumsq, want, **tol(dtype))
    bounds = cu.tolist()
    for b, slot in enumerate(slots):  # a pad sequence's tokens: zero output, zero sums
        if slot == PAD:
            rows = slice(bounds[b], bounds[b + 1])
            assert torch.all(sumsq[rows] == 0) and torch.all(got[rows] == 0)


def test_deferred_norm_matches_the_reference(device):
    args, states, cu, kw, nw = _call(device, (3, 18), (1, 0), seed=5)
    T, H, P = args[0].shape
    ref_states = states.clone()
    sumsq, ref_sumsq = (torch.empty(T, H * P // 16, device=device) for _ in range(2))
    got = ssd_scan_varlen(*args, states, cu, **kw, norm_weight=nw, norm_sumsq=sumsq)
    kw.pop("fused")
    want = ssd_scan_varlen_ref(*args, ref_states, cu, **kw, norm_weight=nw, norm_sumsq=ref_sumsq)
    torch.testing.assert_close(got, want, **tol(torch.float32))
    torch.testing.assert_close(sumsq, ref_sumsq, **tol(torch.float32))


def test_deferred_norm_argument_errors(device):
    args, states, cu, kw, nw = _call(device, (3,), (0,))
    T, H, P = args[0].shape
    sumsq = torch.empty(T, H * P // 16, device=device)
    cases = [
        (dict(norm_weight=nw), ValueError, "pass both `norm_weight` and `norm_sumsq`"),
        (dict(norm_sumsq=sumsq), ValueError, "pass both `norm_weight` and `norm_sumsq`"),
        (dict(norm_weight=nw[:-1], norm_sumsq=sumsq), ValueError, r"`norm_weight` expected shape \(H \* P=96\)"),
        (dict(norm_weight=nw, norm_sumsq=sumsq[:, :-1]), ValueError, r"`norm_sumsq` expected shape \(T=3, H \* P / 16=6\)"),
        (dict(norm_weight=nw, norm_sumsq=sumsq.double()), TypeError, "`norm_sumsq` expected dtype"),
        (dict(norm_weight=nw, norm_sumsq=torch.empty(6, T, device=device).t()), ValueError,
         "`norm_sumsq` must be contiguous in dim 1"),
        (dict(norm_weight=nw.tolist(), norm_sumsq=sumsq), TypeError,
         "`norm_weight` expected a torch.Tensor or None, got list"),
    ]
    for extra, exc, match in cases:
        with pytest.raises(exc, match=match):
            ssd_scan_varlen(*args, states, cu, **kw, **extra)
    args12, states12, cu12, kw12, _ = _call(device, (3,), (0,), P=24)
    with pytest.raises(ValueError, match="the deferred norm needs P .* a multiple of 16, got P = 24"):
        ssd_scan_varlen(*args12, states12, cu12, **kw12, norm_weight=torch.ones(72, device=device),
                        norm_sumsq=torch.empty(3, 4, device=device))
