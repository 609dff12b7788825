"""The serving form of the decode ops under torch.compile and torch.inference_mode (issue 20 item 3).

``torch.compile(fullgraph=True)`` of ``causal_conv1d_update`` and ``selective_state_update`` called
with slot indices traces (no host read of the indices while compiling: the kernels treat a slot
outside [0, S) as the pad slot instead), runs the registered custom ops through their fake
impls, and equals eager. The tests use backend="aot_eager": it traces with dynamo and
functionalizes through AOTAutograd (what needs the fake impls and the mutated-argument
declarations) without inductor's C++ codegen, which takes minutes on a small CPU machine for
no extra coverage of our code (the ops are opaque to inductor).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastmamba.ops import (
    allocate_replay_cache,
    causal_conv1d_update,
    replay_selective_state_update,
    selective_state_update,
)

S, B, H, P, N, G, D_CONV, W = 6, 3, 4, 24, 16, 2, 40, 4
# CUDA when present (the kernels), else the CPU under the interpreter (CPU tensors on a GPU machine
# without the interpreter would run the references, which refuse an out-of-range slot instead)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(seed: int = 0, tokens: int = 0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    lead = (B, tokens) if tokens else (B,)
    return {k: v.to(DEVICE) for k, v in dict(
        conv_state=rnd(S, D_CONV, W - 1),
        xc=rnd(B, D_CONV),
        weight=rnd(D_CONV, W, scale=0.5),
        bias=rnd(D_CONV, scale=0.1),
        state=rnd(S, H, P, N),
        x=rnd(*lead, H, P),
        dt=F.softplus(rnd(*lead, H) - 4.0),
        A_log=rnd(H, scale=0.5),
        Bm=rnd(*lead, G, N, scale=0.3),
        Cm=rnd(*lead, G, N, scale=0.3),
        D=rnd(H),
        z=rnd(*lead, H, P),
        dt_bias=rnd(H, scale=0.5),
        slots=torch.tensor([4, -1, 1], dtype=torch.int32),
        dst=torch.tensor([2, -1, 1], dtype=torch.int32),
    ).items()}


def decode_step(conv_state, xc, weight, bias, state, x, dt, A_log, Bm, Cm, D, z, dt_bias, slots, dst):
    """A mixer-like step: the conv update, then the state update reading and writing by slot."""
    yc = causal_conv1d_update(xc, conv_state, weight, bias, "silu", conv_state_indices=slots)
    y = selective_state_update(state, x, dt, A_log, Bm, Cm, D, z, dt_bias, True, slots,
                               dst_state_batch_indices=dst, A_is_log=True)
    return yc * 2, y + 1


def _run(fn, inp):
    conv_state, state = inp["conv_state"].clone(), inp["state"].clone()
    args = dict(inp, conv_state=conv_state, state=state)
    yc, y = fn(**args)
    return yc, y, conv_state, state


def _assert_same(a, b):
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def test_dynamo_explain_finds_no_graph_break():
    inp = _inputs(seed=1)
    explanation = torch._dynamo.explain(decode_step)(**dict(inp, conv_state=inp["conv_state"].clone(),
                                                             state=inp["state"].clone()))
    assert explanation.graph_break_count == 0, [str(r.reason) for r in explanation.break_reasons]
    assert explanation.graph_count == 1


def test_compiled_decode_ops_equal_eager():
    """fullgraph=True (a graph break would raise); the same kernels run, so results are identical.
    A second call with new slot values reuses the graph (nothing about index values is baked in),
    and an out-of-range slot, unchecked while compiled, acts as the pad slot."""
    torch._dynamo.reset()
    compiled = torch.compile(decode_step, fullgraph=True, backend="aot_eager")
    inp = _inputs(seed=2)
    _assert_same(_run(compiled, inp), _run(decode_step, inp))
    for slots, dst in (([0, 5, -1], [3, 5, -1]), ([S + 2, 0, 3], [1, 0, 3])):
        inp2 = dict(inp, slots=torch.tensor(slots, dtype=torch.int32, device=DEVICE),
                    dst=torch.tensor(dst, dtype=torch.int32, device=DEVICE))
        expect = dict(inp2)
        if slots[0] >= S:  # the eager reference of the out-of-range row: a pad row
            expect["slots"] = torch.tensor([-1] + slots[1:], dtype=torch.int32, device=DEVICE)
        with torch.inference_mode():  # compiled code under inference mode too
            got = _run(compiled, inp2)
        _assert_same(got, _run(decode_step, expect))


def test_compiled_multi_token_state_update_equals_eager():
    torch._dynamo.reset()
    inp = _inputs(seed=3, tokens=2)

    def step(state, x, dt, A_log, Bm, Cm, D, z, dt_bias, slots):
        return selective_state_update(state, x, dt, A_log, Bm, Cm, D, z, dt_bias, True, slots, A_is_log=True)

    args = {k: inp[k] for k in ("x", "dt", "A_log", "Bm", "Cm", "D", "z", "dt_bias", "slots")}
    s_eager, s_comp = inp["state"].clone(), inp["state"].clone()
    y_eager = step(s_eager, **args)
    y_comp = torch.compile(step, fullgraph=True, backend="aot_eager")(s_comp, **args)
    assert torch.equal(y_comp, y_eager) and torch.equal(s_comp, s_eager)


def test_eager_ops_under_inference_mode():
    """Every wrapper of the decode ops runs under torch.inference_mode() (inference tensors have no
    version counter) and gives what it gives outside it."""
    inp = _inputs(seed=4)
    expect = _run(decode_step, inp)
    with torch.inference_mode():
        inf = {k: v.clone() for k, v in inp.items()}  # inference tensors
        got = _run(decode_step, inf)
    _assert_same(got, expect)

    # the replay op, its commit and flush
    T = 2
    results = []
    for mode in (False, True):
        with torch.inference_mode(mode):
            g = torch.Generator().manual_seed(5)
            cache = allocate_replay_cache(S, T, H, P, G, N, torch.float32, torch.float32, DEVICE)
            cache.state.copy_(torch.randn(cache.state.shape, generator=g))
            x = torch.randn(B, T, H, P, generator=g).to(DEVICE)
            dt = torch.randn(B, T, H, generator=g).to(DEVICE) - 3
            Bm, Cm = ((torch.randn(B, T, G, N, generator=g) * 0.3).to(DEVICE) for _ in range(2))
            slots = torch.tensor([4, -1, 1], dtype=torch.int32, device=DEVICE)
            y1 = replay_selective_state_update(*cache, x, dt, inp["A_log"], Bm, Cm, inp["D"], None, inp["dt_bias"],
                                               True, slots, A_is_log=True)
            cache.commit(slots, torch.tensor([1, 0, 2], dtype=torch.int32, device=DEVICE), T)
            y2 = replay_selective_state_update(*cache, x.flip(1), dt, inp["A_log"], Bm, Cm, inp["D"], None,
                                               inp["dt_bias"], True, slots, A_is_log=True)
            cache.flush(slots)
            results.append((y1, y2, *cache))
    _assert_same(results[1], results[0])


def test_eager_calls_skip_the_dispatcher_but_fake_mode_does_not(monkeypatch):
    """Plain eager calls run the op's implementation directly (host time, issue 19); under a Python
    dispatch mode (FakeTensorMode, as tracing uses) the registered custom op and its fake impl run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import fastmamba.ops.conv1d.api as conv1d_api
    import fastmamba.ops.state_update.api as ssu_api
    from fastmamba.ops._common.host_values import trusted_inputs

    inp = _inputs(seed=6)
    calls = []
    for mod, name in ((ssu_api, "_selective_state_update_op"), (conv1d_api, "_causal_conv1d_update_")):
        registered = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=registered, **k: (calls.append(_r), _r(*a, **k))[1])
    expect = _run(decode_step, inp)
    assert calls == []  # eager: straight to the implementation
    with FakeTensorMode() as mode, trusted_inputs():
        fake = {k: mode.from_tensor(v) for k, v in inp.items()}
        yc, y = decode_step(**fake)
    assert len(calls) == 2  # both through the registered ops (fake impls: no kernel ran on fake tensors)
    assert yc.shape == expect[0].shape and y.shape == expect[1].shape
