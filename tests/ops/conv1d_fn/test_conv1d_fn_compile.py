"""torch.compile(fullgraph=True) of causal_conv1d_fn and causal_conv1d_varlen (with slot indices):
one graph, no breaks (torch._dynamo.explain), equal to eager, also under torch.inference_mode().

The registered custom ops are opaque to the compiler, so the backend barely matters; most tests
use "aot_eager" (functionalization and the mutation bookkeeping, without Inductor's C++ build,
~20 s on a CPU), one uses the default backend (Inductor) end to end.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from fastmamba.ops.conv1d_fn import causal_conv1d_fn, causal_conv1d_varlen
from fastmamba.ops.conv1d_fn.ref import causal_conv1d_varlen_ref
from tests.helpers import seeded, tol
from tests.ops.conv1d_fn.test_conv1d_fn import make_x

BACKEND = "aot_eager"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def assert_one_graph(fn, *args) -> None:
    explained = torch._dynamo.explain(fn)(*args)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


def fn_inputs(layout: str, device, seed: int = 0):
    g = seeded(seed)
    B, D, L, W = 2, 40, 11, 4  # two token tiles per row under the interpreter
    x = make_x(layout, B, D, L, g).to(device)
    w = torch.randn(D, W, generator=g).to(device)
    bias = torch.randn(D, generator=g).to(device)
    seq_idx = torch.tensor([[-1, -1] + [0] * 5 + [1] * 4, [0] * 11], dtype=torch.int32, device=device)
    h0 = torch.randn(B, D, W - 1, generator=g).to(device)
    return x, w, bias, seq_idx, h0


def conv_fn_call(x, w, bias, seq_idx, h0):
    y, final = causal_conv1d_fn(x, w, bias, seq_idx, h0, return_final_states=True, activation="silu")
    return y * 2, final  # an op around it stays in the same graph


@pytest.mark.parametrize(
    "layout, inference",
    [("channel_last", False), ("channel_first", False), ("channel_last", True)],
    ids=["channel-last", "channel-first", "channel-last-inference-mode"],
)
def test_fn_compiles_to_one_graph(layout: str, inference: bool, device):
    mode = torch.inference_mode() if inference else contextlib.nullcontext()
    with mode:
        args = fn_inputs(layout, device)
        if not inference:
            assert_one_graph(conv_fn_call, *args)
        compiled = torch.compile(conv_fn_call, fullgraph=True, backend=BACKEND)
        y, final = compiled(*args)
        y_eager, final_eager = conv_fn_call(*args)
        assert torch.equal(y, y_eager) and torch.equal(final, final_eager)


def varlen_inputs(device, seed: int = 0):
    g = seeded(seed)
    D, W, S = 40, 4, 6
    x = torch.randn(11, D + 8, generator=g)[:, 4 : 4 + D].to(device)
    w = torch.randn(D, W, generator=g).to(device)
    bias = torch.randn(D, generator=g).to(device)
    states = torch.randn(S, D, W - 1, generator=g).to(device)
    cu = torch.tensor([0, 2, 9, 9, 11], dtype=torch.int32, device=device)
    idx = torch.tensor([3, 0, 5, -1], dtype=torch.int32, device=device)
    has_init = torch.tensor([True, False, True, True], device=device)
    return x, w, bias, states, cu, idx, has_init


def varlen_call(x, w, bias, states, cu, idx, has_init):
    return causal_conv1d_varlen(x, w, bias, states, cu, idx, has_init, "silu") + 1


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_varlen_with_slots_compiles_to_one_graph(inference: bool, device):
    """The serving form (slot indices, has_initial_state): the index checks need host reads, which
    are skipped while tracing (the kernel treats slots outside [0, S) as pad slots)."""
    mode = torch.inference_mode() if inference else contextlib.nullcontext()
    with mode:
        x, w, bias, states, cu, idx, has_init = varlen_inputs(device)
        if not inference:
            assert_one_graph(varlen_call, x, w, bias, states.clone(), cu, idx, has_init)
        compiled = torch.compile(varlen_call, fullgraph=True, backend=BACKEND)
        s_c, s_e = states.clone(), states.clone()
        for _ in range(2):  # the second call continues from the updated slots
            y = compiled(x, w, bias, s_c, cu, idx, has_init)
            y_eager = varlen_call(x, w, bias, s_e, cu, idx, has_init)
            assert torch.equal(y, y_eager)
            assert torch.equal(s_c, s_e)
        s_r = states.clone()
        y_ref = causal_conv1d_varlen_ref(x, w, bias, s_r, cu, idx, has_init, "silu") + 1
        torch.testing.assert_close(compiled(x, w, bias, states, cu, idx, has_init), y_ref, **tol(torch.float32))
        assert torch.equal(states, s_r)


def test_varlen_compiled_bad_slot_writes_nothing_outside_the_pool(device):
    """A compiled call runs no host check: an out-of-range slot acts as the pad slot."""
    x, w, bias, states, cu, idx, has_init = varlen_inputs(device)
    big = torch.randn(states.shape[0] + 4, *states.shape[1:], device=device)
    pool = big[2:-2]
    compiled = torch.compile(varlen_call, fullgraph=True, backend=BACKEND)
    compiled(x, w, bias, pool, cu, idx, has_init)  # traced with good indices
    before = big.clone()
    bad = torch.tensor([3, 0, 6 + 40, -1], dtype=torch.int32, device=device)  # slot 46 of a 6-slot pool
    y = compiled(x, w, bias, pool, cu, bad, has_init)
    assert torch.equal(big[:2], before[:2]) and torch.equal(big[-2:], before[-2:])
    padded = bad.clone()
    padded[2] = -1
    want_pool = before[2:-2].clone()
    y_ref = causal_conv1d_varlen_ref(x, w, bias, want_pool, cu, padded, has_init, "silu") + 1
    torch.testing.assert_close(y, y_ref, **tol(torch.float32))
    assert torch.equal(pool, want_pool)


def test_varlen_compiles_with_inductor(device):
    """The default backend (Inductor) on the mutating op: same values and slot updates as eager."""
    x, w, bias, states, cu, idx, has_init = varlen_inputs(device)
    compiled = torch.compile(varlen_call, fullgraph=True)
    s_c, s_e = states.clone(), states.clone()
    assert torch.equal(compiled(x, w, bias, s_c, cu, idx, has_init), varlen_call(x, w, bias, s_e, cu, idx, has_init))
    assert torch.equal(s_c, s_e)
