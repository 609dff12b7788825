"""torch.compile of the mixer's decode step, with slot indices: one graph, no breaks, equal to eager.

CPU: the "aot_eager" backend (dynamo + AOTAutograd tracing, then eager kernels): inductor's C++
code generation on this machine adds minutes and tests nothing of ours. The slot check of the
state-update and conv ops is skipped while dynamo traces (``host_values.host_reads_allowed``).

Every op of the step (conv update, state update, gated RMSNorm, the projections) is a registered
custom op or a plain torch op, so the layer's own step traces whole, the norm included.
"""
from __future__ import annotations

import pytest
import torch

import fastmamba

pytestmark = pytest.mark.kernels  # the kernels inside the custom ops (the interpreter on a CPU)


@pytest.fixture(scope="module")
def mixer():
    model = fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cpu")
    return model.backbone.layers[0].mixer


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
