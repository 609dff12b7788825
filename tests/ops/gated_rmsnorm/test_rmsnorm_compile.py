"""torch.compile(fullgraph=True) of rmsnorm_fn and RMSNormGated: one graph, no breaks
(torch._dynamo.explain), equal to eager, also under torch.inference_mode().

The launch is a registered custom op (``fastmamba::rmsnorm_fn_``), opaque to the compiler; the
tests use the "aot_eager" backend (functionalization of the ``out`` write without Inductor's C++
build, which would add ~20 s on a CPU).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from fastmamba.ops.gated_rmsnorm import RMSNormGated, rmsnorm_fn
from tests.helpers import nan_like, seeded

BACKEND = "aot_eager"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def inputs(device, dtype=torch.float32):
    g = seeded(0)
    x = torch.randn(3, 2, 96, generator=g).to(device, dtype)
    z = torch.randn(3, 2, 96, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(device, torch.float32)  # fp32 weight, as mamba_ssm allows
    b = (0.1 * torch.randn(96, generator=g)).to(device, torch.float32)
    return x, z, w, b


def norm_call(x, z, w, b):
    return rmsnorm_fn(x, w, b, z, eps=1e-5, group_size=32, norm_before_gate=False) * 3


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_rmsnorm_fn_compiles_to_one_graph(inference: bool, device):
    mode = torch.inference_mode() if inference else contextlib.nullcontext()
    with mode:
        args = inputs(device, torch.bfloat16)
        explained = torch._dynamo.explain(norm_call)(*args)
        assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
        compiled = torch.compile(norm_call, fullgraph=True, backend=BACKEND)
        assert torch.equal(compiled(*args), norm_call(*args))


def test_rmsnorm_fn_out_compiles(device):
    """With ``out=``: the compiled call writes the caller's buffer."""
    x, z, w, b = inputs(device)

    def call(x, z, w, b, out):
        rmsnorm_fn(x, w, b, z, eps=1e-5, group_size=48, out=out)
        return out

    out_c, out_e = nan_like(x), nan_like(x)
    compiled = torch.compile(call, fullgraph=True, backend=BACKEND)
    compiled(x, z, w, b, out_c)
    call(x, z, w, b, out_e)
    assert not out_c.isnan().any()
    assert torch.equal(out_c, out_e)


def test_rmsnorm_module_compiles_under_inference_mode(device):
    norm = RMSNormGated(96, eps=1e-5, group_size=96, device=device, bias=True)
    x, z, _, _ = inputs(device)
    with torch.inference_mode():
        compiled = torch.compile(norm, fullgraph=True, backend=BACKEND)
        assert torch.equal(compiled(x, z), norm(x, z))


def test_rmsnorm_registered_op_declares_its_mutation(device):
    x, z, w, b = inputs(device)
    out = torch.empty_like(x)
    torch.library.opcheck(
        torch.ops.fastmamba.rmsnorm_fn_.default, (x, z, w, b, out, 1e-5, 32, True),
        test_utils=("test_schema", "test_faketensor"),
    )
