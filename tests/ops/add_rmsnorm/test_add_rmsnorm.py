"""add_rmsnorm vs its fp32 reference (CPU: Triton interpreter)."""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops import add_rmsnorm
from fastmamba.ops.add_rmsnorm.ref import add_rmsnorm_ref
from tests.helpers import tol


@pytest.mark.parametrize("rows,D,xdt,rdt,wdt", [
    (3, 80, torch.float32, torch.float32, torch.float32),   # base: D not a power of two
    (1, 80, torch.float32, torch.float32, torch.float32),   # one row
    (5, 96, torch.bfloat16, torch.float32, torch.bfloat16),  # Mamba-2: bf16 block output, fp32 residual
    (4, 64, torch.float16, None, torch.float16),             # no residual (the first block)
], ids=["base", "B1", "bf16-x-fp32-res", "no-residual"])
def test_matches_reference(rows, D, xdt, rdt, wdt, device):
    g = torch.Generator().manual_seed(rows * D)
    x = torch.randn(rows, 2, D, generator=g).to(device, xdt)[:, 1]  # strided rows
    res = None if rdt is None else torch.randn(rows, D, generator=g).to(device, rdt)
    w = (1 + 0.3 * torch.randn(D, generator=g)).to(device, wdt)
    y, s = add_rmsnorm(x, res, w, 1e-5)
    y_ref, s_ref = add_rmsnorm_ref(x, res, w, 1e-5)
    assert y.dtype == wdt and s.dtype == (rdt or torch.float32)
    torch.testing.assert_close(s, s_ref, **tol(xdt, s.dtype))
    torch.testing.assert_close(y.float(), y_ref.float(), **tol(xdt, wdt))


def test_bad_input():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"`weight` expected shape \(8,\)"):
        add_rmsnorm(x, None, torch.ones(7))
    with pytest.raises(ValueError, match="`residual` expected shape"):
        add_rmsnorm(x, torch.randn(2, 9), torch.ones(8))
    with pytest.raises(TypeError, match="`x` expected dtype"):
        add_rmsnorm(x.int(), None, torch.ones(8))


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(eps=-1), ValueError, r"add_rmsnorm: `eps` expected a finite number >= 0, got -1"),
    (dict(eps=float("nan")), ValueError, r"`eps` expected a finite number >= 0, got nan"),
    (dict(eps=float("-inf")), ValueError, r"`eps` expected a finite number >= 0, got -inf"),
    (dict(eps="0.1"), TypeError, r"`eps` expected a float, got str"),
    (dict(x=torch.tensor(1.0)), ValueError, r"`x` expected shape \(\.\.\., D\), got a 0-d tensor"),
    (dict(weight=torch.ones(16)[::2]), ValueError, r"`weight` must be contiguous in dim -1"),
    (dict(residual_dtype=torch.int32), TypeError, r"`residual_dtype` expected one of \(float32, float16, bfloat16\)"),
    (dict(residual_dtype="float32"), TypeError, r"`residual_dtype` expected one of .*got 'float32'"),
], ids=["eps-negative", "eps-nan", "eps-neg-inf", "eps-str", "x-0d", "weight-strided", "res-dtype-int",
        "res-dtype-str"])
def test_bad_input_more(kwargs, exc, match):
    """Each refused with an error naming the argument (eps=-1 used to return NaN; a strided weight
    was read as if contiguous)."""
    args = dict(x=torch.randn(2, 8), residual=torch.randn(2, 8), weight=torch.ones(8), eps=1e-5)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        add_rmsnorm(**args)


def test_eps_zero_and_int(device):
    x = torch.randn(3, 40, device=device)
    w = torch.randn(40, device=device)
    for eps in (0, 0.0, 1):
        y, s = add_rmsnorm(x, None, w, eps)
        y_ref, _ = add_rmsnorm_ref(x, None, w, float(eps))
        torch.testing.assert_close(y, y_ref, **tol(torch.float32))


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_compiles_to_one_graph(inference, device):
    """torch.compile(fullgraph=True): one graph (a registered custom op), equal to eager. Backend
    "aot_eager": the op is opaque to the compiler, Inductor's C++ build would only add time."""
    import contextlib

    torch._dynamo.reset()
    x = torch.randn(3, 40, device=device, dtype=torch.bfloat16)
    res = torch.randn(3, 40, device=device)
    w = torch.randn(40, device=device, dtype=torch.bfloat16)

    def call(x, res, w):
        y, s = add_rmsnorm(x, res, w, 1e-5)
        return y + 1, s

    with torch.inference_mode() if inference else contextlib.nullcontext():
        explained = torch._dynamo.explain(call)(x, res, w)
        assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
        y, s = torch.compile(call, fullgraph=True, backend="aot_eager")(x, res, w)
        y_e, s_e = call(x, res, w)
        assert torch.equal(y, y_e) and torch.equal(s, s_e)
    torch._dynamo.reset()


@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pending_norm_scales_x_first(xdt, device):
    """pending_norm: x's rows owe a deferred norm's 1 / rms (the scan summed the squares of the
    rows g with x = (g * w) @ W^T), applied before the add."""
    from fastmamba.ops import PendingNorm

    g = torch.Generator().manual_seed(3)
    rows, D, J = 5, 48, 7
    x = torch.randn(rows, D, generator=g).to(device, xdt)
    res = torch.randn(rows, D, generator=g).to(device)
    w = (1 + 0.3 * torch.randn(D, generator=g)).to(device, xdt)
    sumsq = (torch.rand(rows, J, generator=g) * 30).to(device)
    pending = PendingNorm(sumsq, 16 * J, 1e-6)
    y, s = add_rmsnorm(x, res, w, 1e-5, pending_norm=pending)
    scale = torch.rsqrt(sumsq.sum(-1, keepdim=True) / (16 * J) + 1e-6)
    want_y, want_s = add_rmsnorm_ref((x.float() * scale), res, w, 1e-5)
    torch.testing.assert_close(s, want_s, **tol(xdt, torch.float32))
    torch.testing.assert_close(y.float(), want_y.float(), **tol(xdt))
    ref_y, ref_s = add_rmsnorm_ref(x, res, w, 1e-5, pending_norm=pending)
    torch.testing.assert_close(s, ref_s, **tol(xdt, torch.float32))
    # no residual (the first block), leading dims
    y3, s3 = add_rmsnorm(x.view(1, rows, D), None, w, 1e-5, pending_norm=PendingNorm(sumsq.view(1, rows, J), 16 * J, 1e-6))
    torch.testing.assert_close(s3.view(rows, D), (x.float() * scale), **tol(xdt, torch.float32))


def test_pending_norm_errors():
    from fastmamba.ops import PendingNorm

    x = torch.randn(2, 8)
    sq = torch.rand(2, 3)
    with pytest.raises(TypeError, match="`pending_norm` expected a PendingNorm or None, got tuple"):
        add_rmsnorm(x, None, torch.ones(8), pending_norm=(sq, 48, 1e-5))
    with pytest.raises(ValueError, match=r"`pending_norm.sumsq` expected shape \(2, 'J'\)"):
        add_rmsnorm(x, None, torch.ones(8), pending_norm=PendingNorm(sq[:1], 48, 1e-5))
    with pytest.raises(TypeError, match="`pending_norm.sumsq` expected dtype"):
        add_rmsnorm(x, None, torch.ones(8), pending_norm=PendingNorm(sq.double(), 48, 1e-5))
    with pytest.raises(ValueError, match="`pending_norm.width` expected a positive int, got 0"):
        add_rmsnorm(x, None, torch.ones(8), pending_norm=PendingNorm(sq, 0, 1e-5))
    with pytest.raises(ValueError, match="`eps` expected"):
        add_rmsnorm(x, None, torch.ones(8), pending_norm=PendingNorm(sq, 48, -1.0))
