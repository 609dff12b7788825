"""rmsnorm_fn (gated RMSNorm) against its fp32 reference.

CPU: the Triton kernel runs in the interpreter on small shapes (tens of programs at most).
GPU (`gpu` marker): the benchmark shape, Dh=5120, the two-pass path, CUDA-graph capture, and
parity with mamba_ssm's rmsnorm_fn when that package is installed.
"""
from __future__ import annotations

import doctest
from dataclasses import dataclass, replace

import pytest
import torch

from fastmamba.ops.gated_rmsnorm import RMSNormGated, rmsnorm_fn
from fastmamba.ops.gated_rmsnorm.configs import GatedRMSNormConfig
from fastmamba.ops.gated_rmsnorm.kernel import gated_rmsnorm_fwd
from fastmamba.ops.gated_rmsnorm.ref import rmsnorm_ref
from tests.helpers import nan_like, seeded, tol

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Case:
    shape: tuple[int, ...] = (3, 96)      # (..., Dh)
    group_size: int | None = 32
    has_z: bool = True
    norm_before_gate: bool = True
    has_bias: bool = True
    dtype: torch.dtype = torch.float32
    row_pad: int = 0                      # > 0: x, z and out are column slices of wider tensors

    @property
    def id(self) -> str:
        parts = ["x".join(map(str, self.shape)), f"g{self.group_size or 'all'}",
                 "z" if self.has_z else "noz", "nbg" if self.norm_before_gate else "gbn",
                 "bias" if self.has_bias else "nobias", DTYPE_NAMES[self.dtype]]
        if self.row_pad:
            parts.append("strided")
        return "-".join(parts)


BASE = Case()
CASES = [
    BASE,
    replace(BASE, group_size=None),                 # one group (G=1)
    replace(BASE, shape=(3, 80), group_size=40),    # group not a power of two, 2 groups
    replace(BASE, has_z=False),
    replace(BASE, norm_before_gate=False),
    replace(BASE, has_bias=False),
    replace(BASE, dtype=torch.bfloat16),
    replace(BASE, dtype=torch.float16),
    replace(BASE, shape=(1, 96)),                   # one row (decode)
    replace(BASE, shape=(37, 96)),                  # odd row count: partial row blocks
    replace(BASE, shape=(2, 3, 96)),                # 3-D input
    replace(BASE, row_pad=40),                      # rows of x, z, out not contiguous with each other
]


def make_inputs(case: Case, device, seed: int = 0):
    """x, z, weight, bias in case.dtype; x, z as column slices of wider tensors when row_pad > 0."""
    g = seeded(seed)
    Dh = case.shape[-1]
    wide = (*case.shape[:-1], Dh + case.row_pad)

    def rows(scale: float) -> torch.Tensor:
        t = (torch.randn(wide, generator=g) * scale).to(device=device, dtype=case.dtype)
        return t[..., :Dh]

    x = rows(2.0)
    z = rows(1.5) if case.has_z else None
    weight = (1.0 + 0.2 * torch.randn(Dh, generator=g)).to(device=device, dtype=case.dtype)
    bias = (0.1 * torch.randn(Dh, generator=g)).to(device=device, dtype=case.dtype) if case.has_bias else None
    return x, z, weight, bias


def poisoned_out(case: Case, device) -> torch.Tensor:
    Dh = case.shape[-1]
    out = nan_like(torch.empty((*case.shape[:-1], Dh + case.row_pad), device=device, dtype=case.dtype))
    return out[..., :Dh]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_rmsnorm_matches_reference(case: Case, device):
    x, z, weight, bias = make_inputs(case, device)
    out = poisoned_out(case, device)
    y = rmsnorm_fn(x, weight, bias, z, 1e-6, case.group_size, case.norm_before_gate, out=out)
    expected = rmsnorm_ref(x, weight, bias, z, 1e-6, case.group_size, case.norm_before_gate)
    assert y is out
    torch.testing.assert_close(y, expected, **tol(case.dtype))
    if case.row_pad:  # the padding columns of the wide buffer stay untouched
        assert out.as_strided((*case.shape[:-1], case.row_pad), out.stride(), case.shape[-1]).isnan().all()


def test_rmsnorm_allocates_output(device):
    x, z, weight, bias = make_inputs(replace(BASE, shape=(2, 3, 96), dtype=torch.bfloat16), device)
    y = rmsnorm_fn(x, weight, bias, z=z, group_size=32)
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
    torch.testing.assert_close(y, rmsnorm_ref(x, weight, bias, z=z, group_size=32), **tol(torch.bfloat16))


def test_rmsnorm_mixed_dtypes(device):
    """bf16 activations with an fp32 weight and an fp16 gate (weights kept in fp32, as under AMP)."""
    x, _, _, _ = make_inputs(replace(BASE, dtype=torch.bfloat16), device)
    _, z, weight, bias = make_inputs(replace(BASE, dtype=torch.float32), device, seed=1)
    z = z.half()
    y = rmsnorm_fn(x, weight, bias, z=z, group_size=32, norm_before_gate=False)
    assert y.dtype == torch.bfloat16
    expected = rmsnorm_ref(x, weight, bias, z=z, group_size=32, norm_before_gate=False)
    torch.testing.assert_close(y, expected, **tol(torch.bfloat16))


def test_rmsnorm_non_collapsible_leading_dims(device):
    """Leading dims that cannot be flattened to one row stride: reshape copies x, result unchanged."""
    x, z, weight, bias = make_inputs(replace(BASE, shape=(3, 2, 96)), device)
    x, z = x.transpose(0, 1), z.transpose(0, 1)
    y = rmsnorm_fn(x, weight, bias, z=z, group_size=32)
    torch.testing.assert_close(y, rmsnorm_ref(x, weight, bias, z=z, group_size=32), **tol(torch.float32))


# Configs the heuristic does not pick for the small shapes above, forced through the launcher.
FORCED = [
    pytest.param(GatedRMSNormConfig(block_m=4, block_n=32, single_tile=True, num_warps=1), 7, 96, 32,
                 id="rows4-M7-partial-block"),
    pytest.param(GatedRMSNormConfig(block_m=1, block_n=32, single_tile=False, num_warps=1), 3, 160, 80,
                 id="two-pass-3-chunks-last-partial"),
    pytest.param(GatedRMSNormConfig(block_m=2, block_n=16, single_tile=False, num_warps=1), 3, 64, 64,
                 id="two-pass-rows2"),
]


@pytest.mark.parametrize("norm_before_gate", [True, False], ids=["nbg", "gbn"])
@pytest.mark.parametrize("cfg, M, Dh, group_size", FORCED)
def test_rmsnorm_forced_configs(cfg, M, Dh, group_size, norm_before_gate, device):
    case = replace(BASE, shape=(M, Dh), group_size=group_size, norm_before_gate=norm_before_gate)
    x, z, weight, bias = make_inputs(case, device)
    out = nan_like(x)
    gated_rmsnorm_fwd(x, z, weight, bias, out, 1e-6, group_size, norm_before_gate, cfg)
    expected = rmsnorm_ref(x, weight, bias, z, 1e-6, group_size, norm_before_gate)
    torch.testing.assert_close(out, expected, **tol(torch.float32))


def test_rmsnorm_module(device):
    norm = RMSNormGated(96, eps=1e-5, group_size=32, norm_before_gate=False, device=device)
    assert list(norm.state_dict()) == ["weight"]  # same key as mamba_ssm's RMSNorm checkpoints
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.2 * torch.randn(96, generator=seeded(3)))
    x, z, _, _ = make_inputs(BASE, device)
    with torch.no_grad():
        y = norm(x, z)
    expected = rmsnorm_ref(x, norm.weight, None, z, 1e-5, 32, False)
    torch.testing.assert_close(y, expected, **tol(torch.float32))


def test_rmsnorm_reference_fallback(monkeypatch):
    """CPU without the interpreter runs the reference (same answer, same `out` contract)."""
    x, z, weight, bias = make_inputs(BASE, "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    out = nan_like(x)
    y = rmsnorm_fn(x, weight, bias, z, group_size=32, out=out)
    assert y is out
    torch.testing.assert_close(y, rmsnorm_ref(x, weight, bias, z, group_size=32), **tol(torch.float32))


def test_rmsnorm_docstring_example():
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder().find(rmsnorm_fn, globs={"torch": torch, "rmsnorm_fn": rmsnorm_fn}):
        runner.run(test)
    assert runner.failures == 0 and runner.tries > 0


def _bad(**changes):
    """Valid base arguments (Dh=96, group 32) with `changes` applied."""
    x, z, weight, bias = make_inputs(BASE, "cpu")
    kwargs = dict(x=x, weight=weight, bias=bias, z=z, group_size=32, out=None, eps=1e-6)
    for k, v in changes.items():
        kwargs[k] = v(kwargs) if callable(v) else v
    return kwargs


BAD_INPUTS = [
    pytest.param(dict(z=lambda a: a["z"][:, :64]), ValueError, r"`z` expected shape \(3, 96\).*got \(3, 64\)", id="z-shape"),
    pytest.param(dict(weight=lambda a: a["weight"][:64]), ValueError, r"`weight` expected shape \(Dh=96\), got \(64\)", id="weight-shape"),
    pytest.param(dict(bias=lambda a: a["bias"][:95]), ValueError, r"`bias` expected shape \(Dh=96\), got \(95\)", id="bias-shape"),
    pytest.param(dict(x=lambda a: a["x"].to(torch.int32)), TypeError, r"`x` expected dtype in .*got int32", id="x-dtype"),
    pytest.param(dict(z=lambda a: a["z"].double()), TypeError, r"`z` expected dtype in .*got float64", id="z-dtype"),
    pytest.param(dict(weight=lambda a: a["weight"].to(torch.int64)), TypeError, r"`weight` expected dtype", id="weight-dtype"),
    pytest.param(dict(group_size=36), ValueError, r"`group_size` must be a positive divisor of Dh=96.*got 36", id="group-not-divisor"),
    pytest.param(dict(group_size=0), ValueError, r"`group_size`.*got 0", id="group-zero"),
    pytest.param(dict(out=lambda a: torch.empty(3, 95)), ValueError, r"`out` expected shape \(3, 96\).*got \(3, 95\)", id="out-shape"),
    pytest.param(dict(out=lambda a: torch.empty(3, 96, dtype=torch.bfloat16)), TypeError, r"`out` expected dtype", id="out-dtype"),
    pytest.param(dict(out=lambda a: torch.empty(96, 3).t()), ValueError, r"`out` must be contiguous in dim -1", id="out-column-stride"),
    pytest.param(dict(x=lambda a: torch.randn(96, 3).t()), ValueError, r"`x` must be contiguous in dim -1", id="x-column-stride"),
    pytest.param(dict(weight=lambda a: torch.ones(96, device="meta")), ValueError, r"`weight` is on meta but `x` is on cpu", id="weight-device"),
    # eps: a negative one made every row NaN; NaN / inf, and non-numbers, are refused too
    pytest.param(dict(eps=-1), ValueError, r"rmsnorm_fn: `eps` expected a finite number >= 0, got -1", id="eps-negative"),
    pytest.param(dict(eps=-1e-6), ValueError, r"`eps` expected a finite number >= 0, got -1e-06", id="eps-small-negative"),
    pytest.param(dict(eps=float("nan")), ValueError, r"`eps` expected a finite number >= 0, got nan", id="eps-nan"),
    pytest.param(dict(eps=float("inf")), ValueError, r"`eps` expected a finite number >= 0, got inf", id="eps-inf"),
    pytest.param(dict(eps="1e-5"), TypeError, r"`eps` expected a float, got str", id="eps-str"),
    pytest.param(dict(eps=True), TypeError, r"`eps` expected a float, got bool", id="eps-bool"),
    pytest.param(dict(eps=None), TypeError, r"`eps` expected a float, got NoneType", id="eps-none"),
]


@pytest.mark.parametrize("changes, exc, match", BAD_INPUTS)
def test_rmsnorm_bad_inputs(changes, exc, match):
    a = _bad(**changes)
    with pytest.raises(exc, match=match):
        rmsnorm_fn(a["x"], a["weight"], a["bias"], a["z"], eps=a["eps"], group_size=a["group_size"], out=a["out"])


# eps = 0: the interpreter warns about 1/sqrt(0) in the masked padding lanes of a block (never stored)
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("eps", [0, 0.0, 1e-5, 1])
def test_rmsnorm_accepts_eps_ints_and_zero(eps, device):
    x, z, weight, bias = make_inputs(BASE, device)
    y = rmsnorm_fn(x, weight, bias, z, eps=eps, group_size=32)
    torch.testing.assert_close(y, rmsnorm_ref(x, weight, bias, z, float(eps), 32), **tol(torch.float32))


def test_rmsnorm_module_checks_eps():
    with pytest.raises(ValueError, match=r"RMSNormGated: `eps` expected a finite number >= 0, got -1"):
        RMSNormGated(8, eps=-1)


def test_rmsnorm_out_not_viewable_as_rows():
    x, z, weight, bias = make_inputs(replace(BASE, shape=(2, 3, 96)), "cpu")
    out = torch.empty(3, 2, 96).transpose(0, 1)       # (2, 3, 96), leading dims not collapsible
    with pytest.raises(ValueError, match=r"`out` must be viewable as \(M, Dh\) rows"):
        rmsnorm_fn(x, weight, bias, z, group_size=32, out=out)


# ---------------------------------------------------------------------------------------------
# GPU: full shapes

GPU_CASES = [
    Case(shape=(256, 8192), group_size=1024, has_bias=False, dtype=torch.bfloat16),   # benchmark shape
    Case(shape=(256, 8192), group_size=1024, has_bias=False, norm_before_gate=False, dtype=torch.bfloat16),
    Case(shape=(1, 5120), group_size=None, has_bias=False, dtype=torch.bfloat16),     # mamba2-2.7b decode
    Case(shape=(333, 5120), group_size=None, has_bias=False, dtype=torch.bfloat16),
    Case(shape=(3, 8192), group_size=1024, has_bias=False, norm_before_gate=False, dtype=torch.bfloat16),
    Case(shape=(4, 20480), group_size=None, dtype=torch.bfloat16),                   # two-pass path
    Case(shape=(256, 8192), group_size=1024, dtype=torch.float16, row_pad=24),
    Case(shape=(64, 8192), group_size=1024, has_z=False, dtype=torch.float32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_rmsnorm_gpu_full_shapes(case: Case):
    x, z, weight, bias = make_inputs(case, "cuda")
    out = poisoned_out(case, "cuda")
    y = rmsnorm_fn(x, weight, bias, z, 1e-5, case.group_size, case.norm_before_gate, out=out)
    expected = rmsnorm_ref(x, weight, bias, z, 1e-5, case.group_size, case.norm_before_gate)
    torch.testing.assert_close(y, expected, **tol(case.dtype))


@pytest.mark.gpu
def test_rmsnorm_cuda_graph_replay():
    case = Case(shape=(8, 8192), group_size=1024, has_bias=False, norm_before_gate=False, dtype=torch.bfloat16)
    x, z, weight, bias = make_inputs(case, "cuda")
    x, z = x.contiguous(), z.contiguous()
    out = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up compiles the kernel outside capture
        rmsnorm_fn(x, weight, bias, z, 1e-5, 1024, False, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rmsnorm_fn(x, weight, bias, z, 1e-5, 1024, False, out=out)
    x2, z2, _, _ = make_inputs(case, "cuda", seed=7)
    x.copy_(x2)
    z.copy_(z2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, rmsnorm_ref(x, weight, bias, z, 1e-5, 1024, False), **tol(case.dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("norm_before_gate", [True, False], ids=["nbg", "gbn"])
def test_rmsnorm_parity_with_mamba_ssm(norm_before_gate):
    from fastmamba.bench.peers import mamba_ssm_rmsnorm_fn  # imports its Triton module without its __init__

    peer = mamba_ssm_rmsnorm_fn()
    if peer.fn is None:
        pytest.skip(f"mamba_ssm's rmsnorm_fn is not importable ({peer.reason}); parity not checked")
    case = Case(shape=(256, 8192), group_size=1024, norm_before_gate=norm_before_gate, dtype=torch.bfloat16)
    x, z, weight, bias = make_inputs(case, "cuda")
    ours = rmsnorm_fn(x, weight, bias, z, 1e-5, 1024, norm_before_gate)
    theirs = peer.fn(x, weight, bias, z=z, eps=1e-5, group_size=1024, norm_before_gate=norm_before_gate)
    torch.testing.assert_close(ours, theirs, **tol(case.dtype))
