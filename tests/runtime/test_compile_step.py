"""torch.compile of the mixer's decode step, with slot indices: one graph, no breaks, equal to eager.

CPU: the "aot_eager" backend (dynamo + AOTAutograd tracing, then eager kernels): inductor's C++
code generation on this machine adds minutes and tests nothing of ours. The slot check of the
state-update and conv ops is skipped while dynamo traces (``host_values.host_reads_allowed``).

The gated RMSNorm (``fastmamba.ops.gated_rmsnorm``) launches its Triton kernel from Python rather
than through a ``torch.library`` custom op, so under the Triton interpreter dynamo traces into the
interpreter and fails (on a GPU dynamo captures the launch itself). Until that op is a custom op,
the test routes the norm through a test-local custom op; the rest of the step is the layer's own.
"""
from __future__ import annotations

import pytest
import torch

import fastmamba
from fastmamba.ops import rmsnorm_fn
from fastmamba.ops.gated_rmsnorm import api as norm_api


def _norm_is_custom_op() -> bool:
    return isinstance(getattr(norm_api, "_gated_rmsnorm_", None), torch._library.custom_ops.CustomOpDef)


@torch.library.custom_op("fastmamba_tests::gated_rmsnorm", mutates_args=())
def _norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int) -> torch.Tensor:
    return rmsnorm_fn(x, weight, None, z=None, eps=eps, group_size=group_size, norm_before_gate=False)


@_norm_op.register_fake
def _(x, weight, eps, group_size):
    return torch.empty_like(x)


@pytest.fixture(scope="module")
def mixer():
    model = fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cpu")
    mixer = model.backbone.layers[0].mixer
    if not _norm_is_custom_op():
        norm = mixer.norm
        norm.forward = lambda x, z=None: _norm_op(x, norm.weight, norm.eps, norm.group_size)
    return mixer


def _inputs(mixer, seed: int):
    c = mixer.cfg
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(3, c.d_model, generator=g)
    conv = torch.randn(5, c.conv_dim, c.d_conv, generator=g)
    ssm = torch.randn(5, c.nheads, c.headdim, c.d_state, generator=g)
    slots = torch.tensor([4, -1, 1], dtype=torch.int32)  # a pad row in the middle, slots not in order
    return u, conv, ssm, slots


def test_mixer_step_traces_as_one_graph(mixer):
    torch._dynamo.reset()
    explained = torch._dynamo.explain(mixer.step)(*_inputs(mixer, 0))
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


def test_compiled_mixer_step_equals_eager(mixer):
    torch._dynamo.reset()
    step = torch.compile(mixer.step, fullgraph=True, backend="aot_eager")
    u, conv, ssm, slots = _inputs(mixer, 1)
    conv_e, ssm_e = conv.clone(), ssm.clone()
    with torch.no_grad():
        got = step(u, conv, ssm, slots)
        want = mixer.step(u, conv_e, ssm_e, slots)
        # a second call with new values reuses the graph: nothing about the slots was baked in
        slots2 = torch.tensor([0, 2, -1], dtype=torch.int32)
        got2 = step(u * 0.5, conv, ssm, slots2)
        want2 = mixer.step(u * 0.5, conv_e, ssm_e, slots2)
    for a, b in ((got, want), (got2, want2), (conv, conv_e), (ssm, ssm_e)):
        torch.testing.assert_close(a, b, atol=0.0, rtol=0.0)
    assert torch.equal(got[1], torch.zeros_like(got[1]))  # the pad row
