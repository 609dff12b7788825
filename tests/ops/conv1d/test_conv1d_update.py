"""causal_conv1d_update (conv1d decode step) against its fp32 reference.

CPU runs the Triton kernel in the interpreter (BLOCK_D=32), so D=72 covers two full blocks and a
partial one. Outputs are compared with dtype tolerances; the conv state is pure data movement and
is compared with torch.equal, including slots the call must not touch.
"""
from __future__ import annotations

import dataclasses
import doctest

import pytest
import torch
import torch.nn.functional as F

import fastmamba.ops.conv1d.api as conv1d_api
from fastmamba.ops._common.dispatch import interpreter_enabled
from fastmamba.ops.conv1d import causal_conv1d_update
from fastmamba.ops.conv1d.ref import causal_conv1d_update_ref
from tests.helpers import nan_like, seeded, tol

INTERPRET = interpreter_enabled()

PAD = -1


@dataclasses.dataclass(frozen=True)
class Case:
    B: int = 3
    D: int = 72
    L: int | None = None  # None: x is [B, D]; else [B, D, L]
    W: int = 4
    extra_state: int = 0  # state_len = W - 1 + extra_state
    dtype: torch.dtype = torch.float32  # x, weight, bias, y
    state_dtype: torch.dtype = torch.float32
    bias: bool = True
    activation: str | None = "silu"
    slots: str = "shuffled"  # "shuffled": S = B + 3, random slots, row 1 padded; "none": slot b
    idx_dtype: torch.dtype = torch.int32
    x_layout: str = "contiguous"  # "channel_last": [B, L, D] memory; "slice": every other channel
    state_layout: str = "contiguous"  # "channel_last": [S, state_len, D] memory, viewed [S, D, state_len]
    mode: str = "shift"  # "shift", "circular" (cache_seqlens), "accepted" (num_accepted_tokens)

    @property
    def state_len(self) -> int:
        return self.W - 1 + self.extra_state


def make_inputs(case: Case, device: torch.device, seed: int = 0) -> dict:
    g = seeded(seed)
    B, D, W, SL = case.B, case.D, case.W, case.state_len
    L = case.L or 1

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    if case.x_layout == "channel_last":
        x = randn(B, L, D).transpose(1, 2)
    elif case.x_layout == "slice":
        x = randn(B, 2 * D, L)[:, ::2]
    else:
        x = randn(B, D, L)
    x = x[..., 0] if case.L is None else x  # [B, D] keeps the strides of the chosen layout
    x = x.to(device=device, dtype=case.dtype)

    if case.slots == "shuffled":
        S = B + 3
        idx = torch.randperm(S, generator=g)[:B]
        if B > 1:
            idx[1] = PAD
        idx = idx.to(device=device, dtype=case.idx_dtype)
    else:
        S, idx = B, None
    if case.state_layout == "channel_last":
        state = randn(S, SL, D).transpose(1, 2)
    else:
        state = randn(S, D, SL)
    state = state.to(device=device, dtype=case.state_dtype)

    weight = (randn(D, W) / W**0.5).to(device=device, dtype=case.dtype)
    bias = (0.1 * randn(D)).to(device=device, dtype=case.dtype) if case.bias else None
    cache_seqlens = num_accepted = None
    if case.mode == "circular":
        cache_seqlens = torch.randint(0, 3 * SL, (B,), generator=g, dtype=torch.int32)
        cache_seqlens[0] = 0
        cache_seqlens = cache_seqlens.to(device)
    elif case.mode == "accepted":
        num_accepted = torch.randint(1, SL - W + 3, (B,), generator=g, dtype=torch.int32)
        num_accepted[0] = 1  # the shortest history: with state_len > W + L - 1 its oldest columns are zero-filled
        num_accepted[-1] = SL - W + 2  # the longest: the window ends at the state's last column
        num_accepted = num_accepted.to(device)
    return dict(
        x=x, conv_state=state, weight=weight, bias=bias, activation=case.activation,
        cache_seqlens=cache_seqlens, conv_state_indices=idx, num_accepted_tokens=num_accepted,
    )


def run_both(inp: dict, out: torch.Tensor | None = None):
    """(y, y_ref, state, state_ref): the op and the reference, each on its own copy of the state."""
    kw = dict(inp)
    state0 = kw.pop("conv_state")
    x, weight, bias = kw.pop("x"), kw.pop("weight"), kw.pop("bias")
    idx = kw.pop("conv_state_indices")
    state_op, state_ref = state0.clone(), state0.clone()
    y = causal_conv1d_update(x, state_op, weight, bias, conv_state_indices=idx, out=out, **kw)
    y_ref = causal_conv1d_update_ref(x, state_ref, weight, bias, conv_state_indices=idx, **kw)
    return y, y_ref, state_op, state_ref


def assert_state_equal(state: torch.Tensor, state_ref: torch.Tensor, x_dtype: torch.dtype) -> None:
    if INTERPRET and state.dtype == torch.bfloat16 and x_dtype != torch.bfloat16:
        # The Triton interpreter rounds fp32 -> bf16 by truncation (the GPU and torch round to
        # nearest even), so the x values written into a bf16 state may differ by one bf16 ulp.
        torch.testing.assert_close(state, state_ref, atol=0, rtol=2**-7)
    else:
        assert torch.equal(state, state_ref)


def check_against_ref(case: Case, device: torch.device, seed: int = 0) -> None:
    inp = make_inputs(case, device, seed)
    out = nan_like(torch.empty(inp["x"].shape, dtype=case.dtype, device=device))
    y, y_ref, state_op, state_ref = run_both(inp, out=out)

    assert y is out
    torch.testing.assert_close(y.float(), y_ref.float(), **tol(case.dtype))
    # exact data movement: shifted rows, untouched slots and pad rows all equal the reference
    assert_state_equal(state_op, state_ref, x_dtype=case.dtype)
    idx = inp["conv_state_indices"]
    if idx is not None:
        touched = idx[idx != PAD].long()
        untouched = torch.ones(state_op.shape[0], dtype=torch.bool, device=device)
        untouched[touched] = False
        assert untouched.any()
        assert torch.equal(state_op[untouched], inp["conv_state"][untouched])
        assert (y[idx == PAD] == 0).all()


BASE = Case()


def row(id_: str, **change) -> pytest.param:
    return pytest.param(dataclasses.replace(BASE, **change), id=id_)


# Base row: B3-D72-W4-SL3 (vLLM layout, state_len = W-1), fp32, bias, silu, shuffled slots + a pad.
CASES = [
    pytest.param(BASE, id="base-B3-D72-W4-SL3"),
    row("B1-noslots", B=1, slots="none"),
    row("D40", D=40),
    row("W2", W=2),
    row("W3", W=3),
    row("W5", W=5),
    row("W6", W=6),
    row("SL=W", extra_state=1),
    row("SL=W+3", extra_state=4),
    row("L1-3d", L=1),
    row("L3", L=3),
    row("L3-SL=W", L=3, extra_state=1),
    row("L5-gt-SL", L=5),
    row("nobias", bias=False),
    row("act-none", activation=None),
    row("act-swish", activation="swish"),
    row("idx-int64", idx_dtype=torch.int64),
    row("x-channel-last-L3", L=3, x_layout="channel_last"),
    row("x-slice", x_layout="slice"),
    row("x-slice-L3", L=3, x_layout="slice"),
    row("state-channel-last", state_layout="channel_last"),
    row("state-channel-last-SL=W", state_layout="channel_last", extra_state=1),
    row("bf16", dtype=torch.bfloat16, state_dtype=torch.bfloat16),
]


@pytest.mark.parametrize("case", CASES)
def test_update_matches_ref(case: Case, device):
    check_against_ref(case, device)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("state_name", DTYPES)
@pytest.mark.parametrize("x_name", DTYPES)
def test_update_dtypes(x_name: str, state_name: str, device):
    case = dataclasses.replace(BASE, L=2, dtype=DTYPES[x_name], state_dtype=DTYPES[state_name])
    check_against_ref(case, device)


# The 16-byte row kernel (rows_kernel.py): one token, 16-bit state with contiguous channel rows,
# state_len != 4, contiguous weight, D % 8 == 0. D=72 under the interpreter (64 channels per
# program): one full block and a partial one.
ROWS = dataclasses.replace(BASE, dtype=torch.bfloat16, state_dtype=torch.bfloat16)
ROWS_CASES = [
    pytest.param(ROWS, id="rows-base-SL3"),
    pytest.param(dataclasses.replace(ROWS, state_dtype=torch.float16, dtype=torch.float16), id="rows-fp16"),
    pytest.param(dataclasses.replace(ROWS, dtype=torch.float32), id="rows-x-fp32"),
    pytest.param(dataclasses.replace(ROWS, W=2), id="rows-W2-SL1"),
    pytest.param(dataclasses.replace(ROWS, W=3), id="rows-W3-SL2"),
    pytest.param(dataclasses.replace(ROWS, W=6), id="rows-W6-SL5"),
    pytest.param(dataclasses.replace(ROWS, extra_state=3), id="rows-SL6"),
    pytest.param(dataclasses.replace(ROWS, W=5, extra_state=1), id="rows-W5-SL5"),
    pytest.param(dataclasses.replace(ROWS, D=40, B=1, slots="none"), id="rows-B1-D40-noslots"),
    pytest.param(dataclasses.replace(ROWS, bias=False, activation=None), id="rows-nobias-noact"),
    pytest.param(dataclasses.replace(ROWS, x_layout="slice", L=1), id="rows-x-slice-3d"),
    pytest.param(dataclasses.replace(ROWS, idx_dtype=torch.int64, B=5), id="rows-idx64-B5"),
]


@pytest.mark.parametrize("case", ROWS_CASES)
def test_rows_kernel_matches_ref(case: Case, device, monkeypatch):
    import fastmamba.ops.conv1d.kernel as conv_kernel

    calls = []
    plan = conv_kernel.rows_update_plan
    monkeypatch.setattr(conv_kernel, "rows_update_plan", lambda *a, **k: calls.append(1) or plan(*a, **k))
    monkeypatch.setattr(conv_kernel, "use_rows_kernel", lambda D, B: True)
    check_against_ref(case, device)
    if device.type == "cuda" or INTERPRET:
        assert calls, "the case did not reach the row kernel"


@pytest.mark.parametrize(
    "change",
    [dict(D=44), dict(state_dtype=torch.float32), dict(extra_state=1), dict(state_layout="channel_last"), dict(L=2)],
    ids=["D44", "fp32-state", "SL4", "state-channel-last", "L2"],
)
def test_rows_kernel_not_taken_outside_its_conditions(change: dict, device, monkeypatch):
    import fastmamba.ops.conv1d.kernel as conv_kernel

    calls = []
    plan = conv_kernel.rows_update_plan
    monkeypatch.setattr(conv_kernel, "rows_update_plan", lambda *a, **k: calls.append(1) or plan(*a, **k))
    monkeypatch.setattr(conv_kernel, "use_rows_kernel", lambda D, B: True)
    check_against_ref(dataclasses.replace(ROWS, **change), device)
    assert not calls


CIRCULAR = dataclasses.replace(BASE, mode="circular")
CIRCULAR_CASES = [
    pytest.param(CIRCULAR, id="circ-base-SL3"),
    pytest.param(dataclasses.replace(CIRCULAR, extra_state=4), id="circ-SL=W+3"),
    pytest.param(dataclasses.replace(CIRCULAR, L=3, extra_state=4), id="circ-L3-SL=W+3"),
    pytest.param(dataclasses.replace(CIRCULAR, L=5), id="circ-L5-gt-SL"),
    pytest.param(dataclasses.replace(CIRCULAR, W=2, L=2), id="circ-W2-L2"),
    pytest.param(
        dataclasses.replace(CIRCULAR, state_layout="channel_last", extra_state=1), id="circ-state-channel-last"
    ),
    pytest.param(dataclasses.replace(CIRCULAR, dtype=torch.bfloat16, state_dtype=torch.bfloat16), id="circ-bf16"),
]


@pytest.mark.parametrize("case", CIRCULAR_CASES)
def test_update_circular_buffer(case: Case, device):
    check_against_ref(case, device)
    inp = make_inputs(case, device)
    seqlens = inp["cache_seqlens"].clone()
    run_both(inp)
    assert torch.equal(inp["cache_seqlens"], seqlens)  # the op never advances cache_seqlens


# vLLM speculative layout: state_len = W - 1 + K, L = K + 1 tokens per step
ACCEPTED = dataclasses.replace(BASE, mode="accepted", L=3, extra_state=2)
ACCEPTED_CASES = [
    pytest.param(ACCEPTED, id="acc-base-K2-L3"),
    pytest.param(dataclasses.replace(ACCEPTED, L=1), id="acc-L1"),
    pytest.param(dataclasses.replace(ACCEPTED, L=1, extra_state=4), id="acc-L1-SL=W+3-zero-fill"),
    pytest.param(dataclasses.replace(ACCEPTED, W=2), id="acc-W2"),
    pytest.param(dataclasses.replace(ACCEPTED, W=6), id="acc-W6"),
    pytest.param(dataclasses.replace(ACCEPTED, state_layout="channel_last"), id="acc-state-channel-last"),
    pytest.param(dataclasses.replace(ACCEPTED, dtype=torch.bfloat16, state_dtype=torch.bfloat16), id="acc-bf16"),
]


@pytest.mark.parametrize("case", ACCEPTED_CASES)
def test_update_num_accepted_tokens(case: Case, device):
    check_against_ref(case, device)


@pytest.mark.parametrize("extra_state", [0, 1], ids=["SL=W-1", "SL=W"])
def test_single_token_steps_equal_one_multi_token_step(extra_state: int, device):
    case = dataclasses.replace(BASE, L=4, extra_state=extra_state)
    inp = make_inputs(case, device)
    x, idx = inp["x"], inp["conv_state_indices"]
    args = (inp["weight"], inp["bias"], "silu")
    state_multi, state_steps = inp["conv_state"].clone(), inp["conv_state"].clone()
    y_multi = causal_conv1d_update(x, state_multi, *args, conv_state_indices=idx)
    y_steps = torch.stack(
        [causal_conv1d_update(x[:, :, t], state_steps, *args, conv_state_indices=idx) for t in range(4)], dim=-1
    )
    torch.testing.assert_close(y_multi, y_steps, **tol(case.dtype))
    assert torch.equal(state_multi, state_steps)


@pytest.mark.parametrize("accepted", [1, 2, 3])
def test_num_accepted_tokens_continues_the_accepted_sequence(accepted: int, device):
    """Verify K+1 draft tokens, accept some, verify the next K+1: the second step must equal a
    plain causal conv over the accepted sequence (vLLM's rollback-by-offset)."""
    g = seeded(1)
    B, D, W, K = 2, 40, 4, 2
    L, SL = K + 1, W - 1 + K
    weight = torch.randn(D, W, generator=g).to(device)
    bias = torch.randn(D, generator=g).to(device)
    prefix = torch.randn(B, D, W - 1, generator=g).to(device)
    draft1 = torch.randn(B, D, L, generator=g).to(device)
    draft2 = torch.randn(B, D, L, generator=g).to(device)
    state = torch.randn(B, D, SL, generator=g).to(device)  # columns >= W-1 are stale garbage
    state[:, :, : W - 1] = prefix
    ones = torch.ones(B, dtype=torch.int32, device=device)

    causal_conv1d_update(draft1, state, weight, bias, "silu", num_accepted_tokens=ones)
    n_acc = torch.full((B,), accepted, dtype=torch.int32, device=device)
    state_ref = state.clone()
    y = causal_conv1d_update(draft2, state, weight, bias, "silu", num_accepted_tokens=n_acc)

    seq = torch.cat([prefix, draft1[:, :, :accepted], draft2], dim=-1)
    expected = F.silu(F.conv1d(seq, weight.unsqueeze(1), bias, groups=D))[:, :, -L:]
    torch.testing.assert_close(y, expected, **tol(torch.float32))
    y_ref = causal_conv1d_update_ref(draft2, state_ref, weight, bias, "silu", num_accepted_tokens=n_acc)
    torch.testing.assert_close(y, y_ref, **tol(torch.float32))
    assert torch.equal(state, state_ref)
    # the new state holds the last state_len inputs of the accepted history + draft2
    torch.testing.assert_close(state, seq[:, :, -SL:], atol=0, rtol=0)


def test_out_may_alias_x(device):
    inp = make_inputs(dataclasses.replace(BASE, L=3), device)
    y_ref = causal_conv1d_update_ref(**{**inp, "conv_state": inp["conv_state"].clone()})
    x = inp.pop("x").clone()
    y = causal_conv1d_update(x, **inp, out=x)
    assert y is x
    torch.testing.assert_close(y, y_ref, **tol(torch.float32))


def test_out_strided(device):
    inp = make_inputs(dataclasses.replace(BASE, L=2), device)
    out = nan_like(torch.empty(3, 2, 72, dtype=torch.float32, device=device)).transpose(1, 2)  # [B, D, L] view
    y_ref = causal_conv1d_update_ref(**{**inp, "conv_state": inp["conv_state"].clone()})
    y = causal_conv1d_update(**inp, out=out)
    assert y is out
    torch.testing.assert_close(y, y_ref, **tol(torch.float32))


def test_out_allocated_like_x(device):
    inp = make_inputs(dataclasses.replace(BASE, dtype=torch.float16, x_layout="slice"), device)
    y = causal_conv1d_update(**inp)
    assert y.shape == inp["x"].shape and y.dtype == torch.float16 and y.is_contiguous()


def test_registered_op_declares_its_mutations(device):
    inp = make_inputs(dataclasses.replace(BASE, B=2, D=40), device)
    out = torch.empty_like(inp["x"])
    args = (
        inp["x"], inp["conv_state"], inp["weight"], inp["bias"], None, inp["conv_state_indices"], None, out, True, PAD
    )
    torch.library.opcheck(
        torch.ops.fastmamba.causal_conv1d_update_.default, args,
        test_utils=("test_schema", "test_faketensor"),
    )


def test_docstring_examples():
    assert doctest.testmod(conv1d_api, raise_on_error=False).failed == 0


# ---- drop-in dtypes: fp32 weight / bias next to 16-bit activations (as causal-conv1d accepts) ------

@pytest.mark.parametrize("kernel", ["columns", "rows", "vec4", "L2-accepted"])
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp32_weight_and_bias_with_16bit_x(act, kernel, device):
    """Computed in fp32 from the fp32 weight and bias: equal to the reference run on the same fp32
    tensors (not on 16-bit copies of them)."""
    case = dataclasses.replace(BASE, dtype=act, state_dtype=act)
    if kernel == "vec4":
        case = dataclasses.replace(case, extra_state=1)
    elif kernel == "L2-accepted":
        case = dataclasses.replace(case, L=2, mode="accepted", extra_state=2)
    elif kernel == "columns":
        case = dataclasses.replace(case, state_dtype=torch.float32)
    inp = make_inputs(case, device, seed=7)
    g = seeded(8)
    inp["weight"] = (torch.randn(case.D, case.W, generator=g) / case.W**0.5).to(device)  # fp32, not 16-bit exact
    inp["bias"] = (0.1 * torch.randn(case.D, generator=g)).to(device)
    out = nan_like(inp["x"])
    y, y_ref, state_op, state_ref = run_both(inp, out=out)
    assert y.dtype == act
    torch.testing.assert_close(y.float(), y_ref.float(), **tol(act))
    assert_state_equal(state_op, state_ref, x_dtype=act)
    # the fp32 weight is used as it is: rounding it to x's dtype first gives a different answer
    y16 = causal_conv1d_update_ref(inp["x"], inp["conv_state"].clone(), inp["weight"].to(act), inp["bias"].to(act),
                                   inp["activation"], inp["cache_seqlens"], inp["conv_state_indices"],
                                   num_accepted_tokens=inp["num_accepted_tokens"])
    assert not torch.equal(y16, y)


# ---- bad input: each raises before any write ---------------------------------------------------


def _bad(**change):
    def mutate(inp):
        for key, fn in change.items():
            inp[key] = fn(inp)
        return inp

    return mutate


BAD_INPUTS = [
    pytest.param(_bad(x=lambda i: i["x"][:, :, None, None]), ValueError, "`x` expected shape", id="x-rank4"),
    pytest.param(_bad(x=lambda i: i["x"][:, :40]), ValueError, "`weight` expected shape", id="x-D-mismatch"),
    pytest.param(_bad(x=lambda i: i["x"].long()), TypeError, "`x`", id="x-int"),
    pytest.param(_bad(x=lambda i: None), TypeError, "`x` expected a torch.Tensor, got NoneType", id="x-None"),
    pytest.param(_bad(weight=lambda i: i["weight"].tolist()), TypeError, "`weight` expected a torch.Tensor, got list",
                 id="weight-list"),
    pytest.param(_bad(bias=lambda i: 0.5), TypeError, "`bias` expected a torch.Tensor or None, got float", id="bias-float"),
    pytest.param(_bad(pad_slot_id=lambda i: 0.5), TypeError, "`pad_slot_id` expected an int, got float", id="pad-float"),
    pytest.param(_bad(weight=lambda i: i["weight"].int()), TypeError, "`weight` expected dtype", id="weight-int"),
    pytest.param(_bad(weight=lambda i: i["weight"].repeat(1, 2)[:, :7]), ValueError, "got 7", id="width-7"),
    pytest.param(_bad(weight=lambda i: i["weight"][:, :1]), ValueError, "got 1", id="width-1"),
    pytest.param(_bad(bias=lambda i: i["bias"][:10]), ValueError, "`bias`", id="bias-shape"),
    pytest.param(_bad(bias=lambda i: i["bias"].int()), TypeError, "`bias` expected dtype", id="bias-int"),
    pytest.param(_bad(activation=lambda i: "relu"), ValueError, "`activation`", id="act-relu"),
    pytest.param(_bad(conv_state=lambda i: i["conv_state"][:, :40]), ValueError, "`conv_state`", id="state-D-mismatch"),
    pytest.param(_bad(conv_state=lambda i: i["conv_state"][:, :, :2]), ValueError, "state_len", id="state-too-short"),
    pytest.param(_bad(conv_state=lambda i: i["conv_state"].long()), TypeError, "`conv_state`", id="state-int"),
    pytest.param(_bad(weight=lambda i: i["weight"].to("meta")), ValueError, "`weight` is on meta", id="device"),
    pytest.param(
        _bad(conv_state_indices=lambda i: torch.tensor([0, PAD, 6], dtype=torch.int32)),
        ValueError, "`conv_state_indices` values", id="slot-out-of-range",
    ),
    pytest.param(
        _bad(conv_state_indices=lambda i: i["conv_state_indices"][:2]), ValueError, "`conv_state_indices`",
        id="idx-shape",
    ),
    pytest.param(
        _bad(conv_state_indices=lambda i: i["conv_state_indices"].float()), TypeError, "`conv_state_indices`",
        id="idx-float",
    ),
    pytest.param(
        _bad(conv_state_indices=lambda i: None, conv_state=lambda i: i["conv_state"][:2]), ValueError, "S >= B",
        id="no-idx-too-few-slots",
    ),
    pytest.param(_bad(out=lambda i: torch.empty(3, 72, 2)), ValueError, "`out`", id="out-shape"),
    pytest.param(_bad(out=lambda i: torch.empty(3, 72, dtype=torch.half)), TypeError, "`out`", id="out-dtype"),
    pytest.param(
        _bad(
            cache_seqlens=lambda i: torch.zeros(3, dtype=torch.int32),
            num_accepted_tokens=lambda i: torch.ones(3, dtype=torch.int32),
        ),
        ValueError, "cannot be combined", id="circular-and-accepted",
    ),
    pytest.param(
        _bad(num_accepted_tokens=lambda i: torch.tensor([1, 1, 0], dtype=torch.int32)),
        ValueError, "`num_accepted_tokens` values", id="accepted-zero",
    ),
    pytest.param(
        _bad(num_accepted_tokens=lambda i: torch.tensor([2, 1, 1], dtype=torch.int32)),
        ValueError, "`num_accepted_tokens` values", id="accepted-too-many",
    ),
    pytest.param(
        _bad(cache_seqlens=lambda i: torch.zeros(2, dtype=torch.int32)), ValueError, "`cache_seqlens`",
        id="seqlens-shape",
    ),
]


@pytest.mark.parametrize("mutate, exc, match", BAD_INPUTS)
def test_bad_input_raises_before_writing(mutate, exc, match):
    # CPU on purpose: errors come from the host-side checks, before any kernel or reference runs
    inp = make_inputs(BASE, torch.device("cpu"))
    inp["out"] = None
    inp = mutate(inp)
    state = inp["conv_state"]
    state_before = state.clone()
    out = inp.pop("out")
    with pytest.raises(exc, match=match):
        causal_conv1d_update(**inp, out=out)
    assert torch.equal(state, state_before)


# ---- full shapes on a GPU ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("extra_state", [0, 1], ids=["SL3", "SL4"])
def test_update_full_shape_gpu(extra_state: int, device):
    case = Case(B=256, D=10240, W=4, extra_state=extra_state, dtype=torch.bfloat16, state_dtype=torch.bfloat16)
    check_against_ref(case, device)
    check_against_ref(dataclasses.replace(case, state_layout="channel_last"), device, seed=1)


def test_rows_config_under_pdl_prefers_a_one_wave_grid():
    from fastmamba.ops.conv1d.configs import pick_rows_config

    def one_wave(sms):  # the launcher's rule on a GPU of `sms` SMs: <= 32 programs and 64 warps per SM
        return lambda c: -(-5376 // c.block_d) * 256 <= sms * min(32, 64 // c.num_warps)

    assert pick_rows_config(5376, 256, interpreter=False) == (256, 1)  # PDL off
    assert pick_rows_config(5376, 256, interpreter=False, one_wave=one_wave(132)) == (1024, 4)
    assert pick_rows_config(5376, 256, interpreter=False, one_wave=one_wave(1000)) == (256, 1)  # fits as is
    assert pick_rows_config(5376, 256, interpreter=False, one_wave=one_wave(60)) == (256, 1)  # neither fits
