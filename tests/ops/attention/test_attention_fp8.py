"""float8_e4m3fn K/V pages: the write (quantise K / k_scale, V / v_scale, saturate at +-448), the
decode and prefill kernels reading them (against the references, which read the same bytes), and
the error fp8 storage itself adds (against an fp32 pool, within a bound worked out from e4m3's
3 mantissa bits).

Tolerances. Kernel vs reference: both read the same e4m3 bytes, and converting an e4m3 value to
fp32, bf16 or fp16 is exact (3 mantissa bits, exponents -9..8 fit all three), so the fp8 rounding
cancels; what is left is the kernel's own rounding (accumulation order, q's dtype), the tolerance
of q's dtype as for 16-bit pools. fp8 pages vs the fp32 pool they were quantised from: a stored
value is x / scale rounded to nearest with 3 mantissa bits, relative error <= 2^-4 (half a step of
2^(e-3)), or an absolute 2^-10 x scale below e4m3's smallest normal 2^-6 (subnormal step 2^-9).
The output o = sum_i p_i v_i then moves by at most max|dv| + ||dp||_1 max|v|, and a score shift of
at most d = max_i |q . dk_i| x sm_scale changes each p_i by a factor within [e^-2d, e^2d], so
||dp||_1 <= e^(2d) - 1: the bound ``fp8_bound`` computes from the data (the actual dk, dv).

The Triton interpreter loads float8 and converts it (checked by these tests running the kernels
under TRITON_INTERPRET=1); writes are PyTorch (quantised in fp32, stored as bytes).
"""
from __future__ import annotations

import math

import pytest
import torch

from fastmamba.ops.attention import api as attention_api
from fastmamba.ops.attention import paged_decode_attention, paged_kv_write, varlen_prefill_attention
from fastmamba.ops.attention.ref import (
    paged_decode_attention_ref, paged_kv_write_ref, quantize_kv_ref, varlen_prefill_attention_ref,
)
from tests.helpers import nan_like, seeded, tol
from tests.ops.attention.test_attention import paged_pool

FP8 = torch.float8_e4m3fn


def to_fp8_pages(k: torch.Tensor, v: torch.Tensor, k_scale: float, v_scale: float):
    """fp32 pools -> float8 pools holding k / k_scale, v / v_scale (every page, used or not)."""
    return quantize_kv_ref(k, k_scale), quantize_kv_ref(v, v_scale)


def fp8_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor,
              k_scale: float, v_scale: float, sm_scale: float) -> float:
    """The most an attention output can move when the pools k, v are replaced by the float8 pools'
    values (module docstring): max|dv| + (e^(2d) - 1) max|v|, d the largest score shift."""
    dk = (k8.float() * k_scale - k.float()).abs()
    dv = (v8.float() * v_scale - v.float()).abs()
    d = sm_scale * q.float().abs().amax().item() * dk.sum(-1).amax().item()  # |q . dk| <= max|q| sum|dk|
    return dv.amax().item() + math.expm1(2 * d) * v.float().abs().amax().item()


def test_quantize_kv_ref_rounding_and_saturation():
    """e4m3: values inside the range round to within 2^-4 relative (2^-10 x scale absolute below the
    normals); beyond +-448 x scale they saturate instead of becoming NaN."""
    g = seeded(0)
    x = torch.randn(4096, generator=g) * 3
    scale = 0.02
    q = quantize_kv_ref(x, scale)
    assert q.dtype == FP8
    back = q.float() * scale
    inside = x.abs() <= 448 * scale
    err = (back - x).abs()
    assert bool((err[inside] <= torch.maximum(x[inside].abs() * 2 ** -4, torch.tensor(2 ** -10 * scale))).all())
    assert bool((back[~inside].abs() == 448 * scale).all()) and bool(inside.any()) and bool((~inside).any())
    assert torch.equal(back[~inside].sign(), x[~inside].sign())


def test_paged_kv_write_fp8_matches_ref(device):
    """The op writes the reference's bytes; pad tokens land on the scratch page only."""
    Hkv, Dh, PAGE = 2, 8, 4
    k32, v32, bt, _ = paged_pool(S=4, Np=10, PAGE=PAGE, Hkv=Hkv, Dh=Dh, lens=(6, 3, 0, 8))
    k_pool, v_pool = to_fp8_pages(k32, v32, 1.0, 1.0)
    g = seeded(3)
    slots = torch.tensor([3, -1, 0], dtype=torch.int32)
    token_rows = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2], dtype=torch.int32)
    positions = torch.tensor([5, 6, 7, 0, 1, 0, 1, 2], dtype=torch.int32)
    k = torch.randn(8, Hkv, Dh, generator=g) * 4
    v = torch.randn(8, Hkv, Dh, generator=g)
    k[0, 0, 0] = 1e4  # saturates (4e4 / 0.05 > 448)
    ks, vs = torch.tensor(0.05), torch.tensor([0.01])  # shape () and (1,)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    paged_kv_write_ref(k, v, want_k, want_v, bt, slots, positions, token_rows, k_scale=ks, v_scale=vs)
    got_k, got_v = k_pool.clone().to(device), v_pool.clone().to(device)
    paged_kv_write(k.to(device), v.to(device), got_k, got_v, bt.to(device), slots.to(device), positions.to(device),
                   token_rows.to(device), k_scale=ks.to(device), v_scale=vs.to(device))
    b = lambda t: t.cpu().view(torch.uint8)  # noqa: E731  (torch.equal has no float8 kernel on the CPU)
    assert torch.equal(b(got_k[:-1]), b(want_k[:-1])) and torch.equal(b(got_v[:-1]), b(want_v[:-1]))
    assert not torch.equal(b(got_k[-1]), b(k_pool[-1]))  # the pads landed on the scratch page
    page = int(bt[3, 1])
    assert got_k[page, 1, 0, 0].float().item() == 448.0  # position 5 of slot 3, saturated
    assert not bool(got_k.float().isnan().any()) and not bool(got_v.float().isnan().any())


DECODE_ROWS = [
    pytest.param(dict(Hq=4, Hkv=2, Dh=16, PAGE=4), id="Hq4-Hkv2-D16-P4-fp32q"),
    pytest.param(dict(Hq=4, Hkv=2, Dh=16, PAGE=4, dtype=torch.bfloat16), id="bf16q"),
    pytest.param(dict(Hq=4, Hkv=2, Dh=16, PAGE=4, dtype=torch.float16), id="fp16q"),
    pytest.param(dict(Hq=6, Hkv=2, Dh=24, PAGE=8), id="G3-D24-P8"),
    pytest.param(dict(Hq=4, Hkv=2, Dh=16, PAGE=4, num_splits=2), id="split2"),
]


@pytest.mark.parametrize("shape", DECODE_ROWS)
def test_paged_decode_attention_fp8_matches_ref(shape, device):
    shape = dict(shape)
    dtype = shape.pop("dtype", torch.float32)
    num_splits = shape.pop("num_splits", 1)
    Hq, Hkv, Dh, PAGE = shape["Hq"], shape["Hkv"], shape["Dh"], shape["PAGE"]
    lens = (13, 1, 0, 7, 4)
    k32, v32, bt, seq_lens = paged_pool(S=6, Np=16, PAGE=PAGE, Hkv=Hkv, Dh=Dh, lens=lens)
    k32 = k32 * 3  # K bigger than V: a scale other than V's
    ks, vs = 3.0 / 64, 1.0 / 128  # random normals reach ~ +-4.5 sigma: |x / s| stays below 448
    k8, v8 = to_fp8_pages(k32, v32, ks, vs)
    slots = torch.tensor([3, 0, -1, 4, 1, 2], dtype=torch.int32)
    q = torch.randn(6, Hq, Dh, generator=seeded(1)).to(dtype)
    d = lambda t: t.to(device)  # noqa: E731
    out = nan_like(d(q))
    ks_t, vs_t = d(torch.tensor(ks)), d(torch.tensor(vs))
    got = paged_decode_attention(d(q), d(k8), d(v8), d(bt), d(seq_lens), d(slots), num_splits=num_splits, out=out,
                                 k_scale=ks_t, v_scale=vs_t)
    assert got is out
    want = paged_decode_attention_ref(q, k8, v8, bt, seq_lens, slots, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got.float().cpu(), want, **tol(dtype))
    assert torch.equal(got[2].cpu(), torch.zeros_like(got[2].cpu()))  # pad row
    # what fp8 storage costs against the fp32 pool, within the bound argued in the module docstring
    exact = paged_decode_attention_ref(q.float(), k32, v32, bt, seq_lens, slots)
    bound = fp8_bound(q, k32, v32, k8, v8, ks, vs, Dh ** -0.5)
    err = (want - exact).abs().max().item()
    assert 0 < err <= bound, (err, bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32q", "bf16q"])
@pytest.mark.parametrize("path", ["kernel", "sdpa"])
def test_varlen_prefill_attention_fp8_matches_ref(dtype, path, device, monkeypatch):
    """Packed prompts (one continuing 5 cached tokens) over float8 pages written by paged_kv_write;
    ``sdpa`` is the plain-CPU path (the kernel switched off), which must read the pages' rounded
    values too, not the prompts' own K/V."""
    if path == "sdpa":
        if device.type != "cpu":
            pytest.skip("the SDPA path is the plain-CPU one")
        monkeypatch.setattr(attention_api, "use_triton", lambda t: False)
    Hq, Hkv, Dh, PAGE = 4, 2, 16, 4
    ctx, lens = [0, 5, 0], [7, 3, 1]
    slots = torch.tensor([2, 0, 1], dtype=torch.int32)
    held = [0] * 4
    for b, s in enumerate(slots.tolist()):
        held[s] = ctx[b] + lens[b]
    k32, v32, bt, _ = paged_pool(S=4, Np=12, PAGE=PAGE, Hkv=Hkv, Dh=Dh, lens=held)
    ks, vs = torch.tensor(0.02), torch.tensor(0.01)
    k8, v8 = to_fp8_pages(k32, v32, 0.02, 0.01)
    cu = torch.tensor([0, 7, 10, 11], dtype=torch.int32)
    g = seeded(4)
    q = torch.randn(11, Hq, Dh, generator=g).to(dtype)
    k_new, v_new = torch.randn(11, Hkv, Dh, generator=g).to(dtype), torch.randn(11, Hkv, Dh, generator=g).to(dtype)
    positions = torch.tensor([i + c for c, n in zip(ctx, lens) for i in range(n)], dtype=torch.int32)
    rows = torch.repeat_interleave(torch.arange(3), torch.tensor(lens)).int()
    paged_kv_write(k_new, v_new, k8, v8, bt, slots, positions, rows, k_scale=ks, v_scale=vs)
    want = varlen_prefill_attention_ref(q, k8, v8, bt, slots, cu, torch.tensor(ctx), k_scale=ks, v_scale=vs)
    d = lambda t: t.to(device)  # noqa: E731
    out = nan_like(d(q))
    got = varlen_prefill_attention(d(q), d(k8), d(v8), d(bt), d(slots), d(cu), ctx, k_new=d(k_new), v_new=d(v_new),
                                   out=out, k_scale=d(ks), v_scale=d(vs))
    torch.testing.assert_close(got.float().cpu(), want, **tol(dtype))


def test_fp8_pools_need_both_scales_and_others_none(device):
    k32, v32, bt, seq_lens = paged_pool(S=2, Np=4, PAGE=4, Hkv=1, Dh=16, lens=(3, 2))
    k8, v8 = to_fp8_pages(k32, v32, 1.0, 1.0)
    q = torch.randn(2, 2, 16)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    d = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    with pytest.raises(ValueError, match="`v_scale` is None"):
        paged_decode_attention(*d(q, k8, v8, bt, seq_lens, slots), k_scale=1.0)
    with pytest.raises(ValueError, match="go with float8_e4m3fn pools"):
        paged_decode_attention(*d(q, k32, v32, bt, seq_lens, slots), k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="both be float8_e4m3fn or neither"):
        paged_decode_attention(*d(q, k8, v32, bt, seq_lens, slots), k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="`k_scale` expected a finite number > 0"):
        paged_kv_write(*d(torch.zeros(2, 1, 16), torch.zeros(2, 1, 16), k8, v8, bt, slots, torch.tensor([3, 2])),
                       k_scale=0.0, v_scale=1.0)
    with pytest.raises(ValueError, match=r"`v_scale` expected one float value .* shape \(2,\)"):
        paged_decode_attention(*d(q, k8, v8, bt, seq_lens, slots), k_scale=1.0, v_scale=torch.ones(2, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_decode_attention_fp8_nemotron_shape_gpu(dtype):
    """Nemotron-H's shape (Hq 32, Hkv 8, Dh 128, pages of 16) on the GPU kernel, split-K on and off,
    against the reference on the same float8 bytes."""
    Hq, Hkv, Dh, PAGE = 32, 8, 128, 16
    lens = (1000, 37, 513, 16)
    k32, v32, bt, seq_lens = paged_pool(S=4, Np=160, PAGE=PAGE, Hkv=Hkv, Dh=Dh, lens=lens)
    k8, v8 = to_fp8_pages(k32, v32, 1 / 64, 1 / 64)
    slots = torch.tensor([2, 0, -1, 3, 1], dtype=torch.int32)
    q = torch.randn(5, Hq, Dh, generator=seeded(5)).to(dtype)
    ks, vs = torch.tensor(1 / 64, device="cuda"), torch.tensor(1 / 64, device="cuda")
    want = paged_decode_attention_ref(q, k8, v8, bt, seq_lens, slots, k_scale=ks.cpu(), v_scale=vs.cpu())
    for splits in (None, 1, 8):
        got = paged_decode_attention(*(t.cuda() for t in (q, k8, v8, bt, seq_lens, slots)), num_splits=splits,
                                     k_scale=ks, v_scale=vs)
        torch.testing.assert_close(got.float().cpu(), want, **tol(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_attention_fp8_nemotron_shape_gpu(dtype):
    """The prefill kernel on float8 pages at Nemotron-H's shape, long prompts and contexts (the
    GPU tile), against the reference on the same bytes."""
    from tests.ops.attention.test_prefill_attention import prefill_case

    ctx, lens, slots = [0, 700, 30, 0], [1, 300, 1000, 129], [3, 1, 0, 2]
    q, k_pool, v_pool, bt, sl, cu = prefill_case(Hq=32, Hkv=8, Dh=128, PAGE=16, ctx=ctx, lens=lens, slots=slots, S=4,
                                                 dtype=torch.float32)
    k8, v8 = to_fp8_pages(k_pool, v_pool, 1 / 64, 1 / 64)
    q = q.to(dtype)
    ks = torch.tensor(1 / 64, device="cuda")
    safe_bt = bt.clamp(max=k8.shape[0] - 1)
    want = varlen_prefill_attention_ref(q, k8, v8, safe_bt, sl, cu, torch.tensor(ctx), k_scale=1 / 64, v_scale=1 / 64)
    got = varlen_prefill_attention(q.cuda(), k8.cuda(), v8.cuda(), bt.cuda(), sl.cuda(), cu.cuda(), ctx,
                                   k_scale=ks, v_scale=ks)
    torch.testing.assert_close(got.float().cpu(), want, **tol(dtype))
