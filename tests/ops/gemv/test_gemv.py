"""gemv (decode-time projections) vs its fp32 reference (CPU: Triton interpreter)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastmamba.ops.gemv import configs as gemv_configs
from fastmamba.ops.gemv import gemv
from fastmamba.ops.gemv.configs import pick_config
from fastmamba.ops.gemv.ref import gemv_ref
from tests.helpers import nan_like, tol


@pytest.mark.parametrize("lead,N,K,dtype,has_bias", [
    ((1,), 37, 300, torch.bfloat16, True),      # one row (FMA tiles), N and K not multiples of the tile
    ((1,), 64, 512, torch.float16, False),      # one row, every tile full (the unmasked path)
    ((3,), 45, 130, torch.bfloat16, False),     # a few rows (tensor-core tiles), masked
    ((2, 8), 32, 256, torch.float16, True),     # 16 rows (the most), leading dims, full tiles
    ((5,), 1, 17, torch.bfloat16, True),        # one output feature
], ids=["M1-masked", "M1-even", "M3-masked", "M16-even-2d", "N1"])
@pytest.mark.parametrize("one_row_fma", [False, True], ids=["dot", "one-row-fma"])
def test_matches_reference(lead, N, K, dtype, has_bias, one_row_fma, device, monkeypatch):
    monkeypatch.setattr(gemv_configs, "ONE_ROW_FMA", one_row_fma)
    g = torch.Generator().manual_seed(N * K)
    x_wide = torch.randn(*lead, 2 * K, generator=g).to(device, dtype)
    x = x_wide[..., K:]  # rows strided by 2K
    w = torch.randn(N, K, generator=g).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype) if has_bias else None
    y_ref = gemv_ref(x, w, b)
    out = nan_like(y_ref)
    y = gemv(x, w, b, out=out)
    assert y.data_ptr() == out.data_ptr() and y.shape == lead + (N,) and y.dtype == dtype
    torch.testing.assert_close(y.float(), y_ref.float(), **tol(dtype))
    torch.testing.assert_close(gemv(x, w, b).float(), y_ref.float(), **tol(dtype))  # fresh output


def test_configs_cover_both_tile_kinds(monkeypatch):
    assert pick_config(1, 2560) == pick_config(16, 2560) and pick_config(1, 2560).use_dot  # the default
    monkeypatch.setattr(gemv_configs, "ONE_ROW_FMA", True)
    assert not pick_config(1, 2560).use_dot and pick_config(2, 2560).use_dot
    assert pick_config(1, 5120).block_k == 512 and pick_config(1, 2560).block_k == 256


def test_table_entry_is_taken_for_its_shape_only(device, monkeypatch):
    """A TABLE row (family, dtype, N, K) sets the launch of that shape on that GPU family, for every
    row count, and leaves other shapes to the fallback; a forced config (tune) overrides both."""
    entry = gemv_configs.GemvConfig(True, 16, 64, 4, 3)
    key = gemv_configs.table_key(torch.device(device), torch.bfloat16, 40, 200)
    monkeypatch.setitem(gemv_configs.TABLE, key, entry)
    for rows in (1, 7, 16):
        assert pick_config(rows, 200, 40, device=torch.device(device), dtype=torch.bfloat16) == entry
    assert pick_config(1, 200, 41, device=torch.device(device), dtype=torch.bfloat16) == gemv_configs.heuristic(1, 200)
    assert pick_config(1, 200, 40, device=torch.device(device), dtype=torch.float16) == gemv_configs.heuristic(1, 200)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 200, generator=g).to(device, torch.bfloat16)
    w = torch.randn(40, 200, generator=g).to(device, torch.bfloat16)
    torch.testing.assert_close(gemv(x, w).float(), gemv_ref(x, w).float(), **tol(torch.bfloat16))
    with gemv_configs.forced_config(use_dot=True, block_n=32, block_k=128, num_warps=4, num_stages=2):
        assert pick_config(1, 200, 40, device=torch.device(device), dtype=torch.bfloat16).block_n == 32
        torch.testing.assert_close(gemv(x, w).float(), gemv_ref(x, w).float(), **tol(torch.bfloat16))
    assert gemv_configs.CANDIDATES and all(c["use_dot"] for c in gemv_configs.CANDIDATES)


def test_a_row_does_not_depend_on_the_others(device):
    """Row b of a call equals the same row alone, bit for bit (a plain decode step of B rows and
    a verify step of B*T rows then agree; see configs.ONE_ROW_FMA)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 300, generator=g).to(device, torch.bfloat16)
    w = torch.randn(40, 300, generator=g).to(device, torch.bfloat16)
    full = gemv(x, w)
    for b in (0, 4):
        assert torch.equal(gemv(x[b:b + 1], w), full[b:b + 1])
    assert torch.equal(gemv(x[1:4], w), full[1:4])


def test_empty_reduction_gives_bias(device):
    w = torch.empty(6, 0, dtype=torch.bfloat16, device=device)
    b = torch.arange(6, dtype=torch.bfloat16, device=device)
    x = torch.empty(2, 0, dtype=torch.bfloat16, device=device)
    torch.testing.assert_close(gemv(x, w, b), b.expand(2, 6))
    assert torch.equal(gemv(x, w), torch.zeros(2, 6, dtype=torch.bfloat16, device=device))


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda a: {**a, "x": torch.randn(17, 8).bfloat16()}, ValueError, "x has 17 rows; at most 16"),
    (lambda a: {**a, "x": torch.randn(2, 8)}, TypeError, "`x` expected dtype"),
    (lambda a: {**a, "weight": a["weight"].half()}, TypeError, "`weight` has dtype float16 but `x` has bfloat16"),
    (lambda a: {**a, "weight": torch.randn(4, 9).bfloat16()}, ValueError, r"`weight` expected shape \(N, K=8\)"),
    (lambda a: {**a, "weight": torch.randn(8, 4).bfloat16().t()}, ValueError, "`weight`"),
    (lambda a: {**a, "bias": torch.randn(5).bfloat16()}, ValueError, r"`bias` expected shape \(4,\)"),
    (lambda a: {**a, "out": torch.empty(2, 5).bfloat16()}, ValueError, r"`out` expected a contiguous tensor of shape \(2, 4\)"),
], ids=["too-many-rows", "fp32-x", "dtype-mismatch", "K-mismatch", "weight-strided", "bias-shape", "out-shape"])
def test_bad_input(mutate, exc, match):
    args = {"x": torch.randn(2, 8).bfloat16(), "weight": torch.randn(4, 8).bfloat16(), "bias": None, "out": None}
    args = mutate(args)
    with pytest.raises(exc, match=match):
        gemv(args["x"], args["weight"], args["bias"], out=args["out"])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 8, 16])
@pytest.mark.parametrize("N,K", [(10576, 2560), (2560, 5120)], ids=["in_proj-2.7b", "out_proj-2.7b"])
def test_gpu_2p7b_projections(rows, N, K):
    from fastmamba.ops._common.pdl import programmatic_dependent_launch

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
    b = torch.randn(N, device="cuda", generator=g).bfloat16()
    y_ref = gemv_ref(x, w, b)
    torch.testing.assert_close(gemv(x, w, b).float(), y_ref.float(), **tol(torch.bfloat16))
    torch.testing.assert_close(F.linear(x, w, b).float(), y_ref.float(), **tol(torch.bfloat16))  # the scale of the check
    with programmatic_dependent_launch():  # the PDL launch (weights read before the wait) inside a graph
        out = torch.full((rows, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        x2 = x * 2
        graph = torch.cuda.CUDAGraph()
        gemv(x2, w, b, out=out)
        with torch.cuda.graph(graph):
            x2.copy_(x * 2)
            gemv(x2, w, b, out=out)
        out.fill_(float("nan"))
        graph.replay()
    torch.testing.assert_close(out.float(), gemv_ref(x * 2, w, b).float(), **tol(torch.bfloat16))


def test_gemv_covers_decode_rows_only():
    """``gemv_covers`` (the projections' one rule for taking gemv): never on a CPU tensor; on a GPU
    16-bit rows of the weight's dtype, at most MAX_ROWS, unit stride along K."""
    from fastmamba.ops.gemv import gemv_covers
    from fastmamba.ops.gemv.configs import MAX_ROWS

    assert not gemv_covers(torch.randn(2, 64).half(), torch.randn(32, 64).half())
    if not torch.cuda.is_available():
        return
    x, w = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16), torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    assert gemv_covers(x, w) and gemv_covers(x[None], w)
    assert not gemv_covers(torch.randn(MAX_ROWS + 1, 64, device="cuda", dtype=torch.bfloat16), w)
    assert not gemv_covers(x.float(), w.float()) and not gemv_covers(x, w.half())
    assert not gemv_covers(x, w.to(torch.float8_e4m3fn)) and not gemv_covers(x.t().contiguous().t(), w)
