"""rmsnorm_gemv (the mixer's norm fused into out_proj's gemv) vs its fp32 reference and vs the two
ops it replaces (CPU: Triton interpreter)."""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops.gated_rmsnorm import rmsnorm_fn
from fastmamba.ops.gemv import gemv, rmsnorm_gemv
from fastmamba.ops.gemv.ref import rmsnorm_gemv_ref
from tests.helpers import nan_like, tol


def _case(lead, N, K, dtype, has_bias, device, seed):
    g = torch.Generator().manual_seed(seed)
    x_wide = (torch.randn(*lead, K + 64, generator=g) * 3).to(device, dtype)
    x = x_wide[..., 64:]  # rows strided by K + 64
    nw = (1 + 0.5 * torch.randn(K, generator=g)).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype) if has_bias else None
    return x, nw, w, b


@pytest.mark.parametrize("lead,N,K,group,dtype,has_bias", [
    ((1,), 37, 512, 512, torch.bfloat16, True),     # one row, one group, N not a multiple of the tile
    ((3,), 64, 1024, 256, torch.float16, False),    # a few rows, four groups
    ((2, 8), 40, 512, 128, torch.bfloat16, True),   # 16 rows (the most), leading dims, group = one K step
    ((5,), 33, 384, 384, torch.bfloat16, False),    # K a multiple of the K step (128) but not of 256
], ids=["M1-G1", "M3-G4-fp16", "M16-G4", "M5-K384"])
def test_matches_reference_and_the_unfused_ops(lead, N, K, group, dtype, has_bias, device):
    x, nw, w, b = _case(lead, N, K, dtype, has_bias, device, seed=N + K)
    want = rmsnorm_gemv_ref(x, nw, w, b, eps=1e-5, group_size=group)
    out = nan_like(want)
    got = rmsnorm_gemv(x, nw, w, b, eps=1e-5, group_size=group, out=out)
    assert got.data_ptr() == out.data_ptr() and got.shape == lead + (N,) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **tol(dtype))
    unfused = gemv(rmsnorm_fn(x, nw, None, None, 1e-5, group, False), w, b)
    torch.testing.assert_close(rmsnorm_gemv(x, nw, w, b, eps=1e-5, group_size=group).float(), unfused.float(),
                               **tol(dtype))


def test_untiled_shapes_run_the_two_ops(device):
    """A group the kernel's K step does not divide (K = 200): the unfused ops, same result."""
    x, nw, w, b = _case((2,), 24, 200, torch.bfloat16, True, device, seed=7)
    got = rmsnorm_gemv(x, nw, w, b, eps=1e-6, group_size=100)
    want = rmsnorm_gemv_ref(x, nw, w, b, eps=1e-6, group_size=100)
    torch.testing.assert_close(got.float(), want.float(), **tol(torch.bfloat16))


def test_a_row_does_not_depend_on_the_others(device):
    x, nw, w, _ = _case((6,), 40, 512, torch.bfloat16, False, device, seed=9)
    full = rmsnorm_gemv(x, nw, w, eps=1e-5, group_size=256)
    for rows in (slice(0, 1), slice(4, 5), slice(1, 4)):
        assert torch.equal(rmsnorm_gemv(x[rows], nw, w, eps=1e-5, group_size=256), full[rows])


def test_bad_arguments_raise(device):
    x, nw, w, b = _case((2,), 24, 256, torch.bfloat16, True, device, seed=11)
    with pytest.raises(ValueError, match=r"rmsnorm_gemv: `norm_weight` expected shape \(K=256,\), got \(128,\)"):
        rmsnorm_gemv(x, nw[:128], w, b, eps=1e-5, group_size=256)
    with pytest.raises(ValueError, match=r"rmsnorm_gemv: `group_size` expected a positive int dividing K=256, got 100"):
        rmsnorm_gemv(x, nw, w, b, eps=1e-5, group_size=100)
    with pytest.raises(ValueError, match=r"rmsnorm_gemv: `eps` expected a finite number >= 0, got -1"):
        rmsnorm_gemv(x, nw, w, b, eps=-1, group_size=256)
    with pytest.raises(TypeError, match=r"rmsnorm_gemv: `eps` expected a float, got str 'a'"):
        rmsnorm_gemv(x, nw, w, b, eps="a", group_size=256)
    with pytest.raises(ValueError, match=r"rmsnorm_gemv: x has 17 rows; at most 16"):
        rmsnorm_gemv(torch.zeros(17, 256, dtype=torch.bfloat16, device=device), nw, w, b, eps=1e-5, group_size=256)
    with pytest.raises(TypeError, match=r"rmsnorm_gemv: `x` expected dtype in \(float16, bfloat16\), got float32"):
        rmsnorm_gemv(x.float(), nw, w, b, eps=1e-5, group_size=256)


@pytest.mark.parametrize("lead,N,K,res_dtype,out_rdtype", [
    ((1,), 37, 512, torch.float32, None),            # decode at batch 1, fp32 residual stream
    ((4,), 64, 256, torch.bfloat16, torch.float32),  # a bf16 residual promoted
    ((2, 8), 40, 384, None, None),                   # the first block (no residual), 16 rows
], ids=["M1-fp32-res", "M4-bf16-res", "M16-first-block"])
def test_add_rmsnorm_gemv_matches_the_two_ops(lead, N, K, res_dtype, out_rdtype, device):
    from fastmamba.ops import add_rmsnorm
    from fastmamba.ops.gemv import add_rmsnorm_gemv
    from fastmamba.ops.gemv.ref import add_rmsnorm_gemv_ref

    x, nw, w, b = _case(lead, N, K, torch.bfloat16, True, device, seed=K + N)
    g = torch.Generator().manual_seed(5)
    res = None if res_dtype is None else (torch.randn(*lead, K, generator=g) * 2).to(device, res_dtype)
    y, s = add_rmsnorm_gemv(x, res, nw, w, b, eps=1e-5, residual_dtype=out_rdtype)
    want_y, want_s = add_rmsnorm_gemv_ref(x, res, nw, w, b, eps=1e-5, residual_dtype=out_rdtype)
    assert y.shape == lead + (N,) and y.dtype == torch.bfloat16 and s.dtype == want_s.dtype and s.is_contiguous()
    torch.testing.assert_close(y.float(), want_y.float(), **tol(torch.bfloat16))
    normed, s_unfused = add_rmsnorm(x, res, nw, 1e-5, residual_dtype=out_rdtype)
    assert torch.equal(s, s_unfused)  # the new residual bit for bit
    torch.testing.assert_close(y.float(), gemv(normed, w, b).float(), **tol(torch.bfloat16))


def test_add_rmsnorm_gemv_bad_arguments_raise(device):
    from fastmamba.ops.gemv import add_rmsnorm_gemv

    x, nw, w, b = _case((2,), 24, 256, torch.bfloat16, True, device, seed=12)
    with pytest.raises(ValueError, match=r"add_rmsnorm_gemv: `residual` expected shape \(2, 256\) \(as x\), got \(1, 256\)"):
        add_rmsnorm_gemv(x, x[:1].float(), nw, w, b, eps=1e-5)
    with pytest.raises(TypeError, match=r"add_rmsnorm_gemv: `residual_dtype` expected float32, bfloat16, float16 or None"):
        add_rmsnorm_gemv(x, None, nw, w, b, eps=1e-5, residual_dtype=torch.int32)
    with pytest.raises(ValueError, match=r"add_rmsnorm_gemv: `norm_weight` expected shape \(K=256,\)"):
        add_rmsnorm_gemv(x, None, nw[:8], w, b, eps=1e-5)
    with pytest.raises(ValueError, match=r"add_rmsnorm_gemv: `eps` expected a finite number >= 0, got inf"):
        add_rmsnorm_gemv(x, None, nw, w, b, eps=float("inf"))
