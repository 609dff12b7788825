"""causal_conv1d_fn (dense prefill) and causal_conv1d_varlen (packed prefill into a slot cache)
against their fp32 references.

CPU runs the Triton kernels in the interpreter with 64-channel blocks and 8-token tiles (2V
tokens for the channel-first kernel), so D=40 is one partial block, D=72 a full one and a part,
and L=19 / 37 spans several tiles with a partial last one. Outputs are compared with dtype
tolerances; final states and conv states are pure data movement and are compared exactly,
including slots the call must not touch.
"""
from __future__ import annotations

import dataclasses
import doctest

import pytest
import torch

import fastmamba.ops.conv1d_fn.api as conv1d_fn_api
from fastmamba.ops import causal_conv1d_update
from fastmamba.ops._common.dispatch import interpreter_enabled
from fastmamba.ops.conv1d_fn import causal_conv1d_fn, causal_conv1d_varlen
from fastmamba.ops.conv1d_fn.ref import causal_conv1d_fn_ref, causal_conv1d_varlen_ref
from tests.helpers import nan_like, seeded, tol

INTERPRET = interpreter_enabled()

PAD = -1


def assert_moved_equal(got: torch.Tensor, want: torch.Tensor, src_dtype: torch.dtype) -> None:
    """Exact data movement. The Triton interpreter rounds fp32 -> bf16 by truncation (the GPU and
    torch round to nearest even), so values converted into bf16 may differ by one bf16 ulp."""
    if INTERPRET and got.dtype == torch.bfloat16 and src_dtype != torch.bfloat16:
        torch.testing.assert_close(got, want, atol=0, rtol=2**-7)
    else:
        assert torch.equal(got, want)


def make_x(layout: str, B: int, D: int, L: int, g: torch.Generator) -> torch.Tensor:
    """x [B, D, L] in the named memory layout (fp32, CPU)."""
    if layout == "channel_last":  # [B, L, D] memory
        return torch.randn(B, L, D, generator=g).transpose(1, 2)
    if layout == "slice":  # columns 16 .. 16+D of a wider [B, L, D+24] buffer (Mamba-2's in_proj)
        return torch.randn(B, L, D + 24, generator=g)[:, :, 16 : 16 + D].transpose(1, 2)
    if layout == "channel_first":
        return torch.randn(B, D, L, generator=g)
    if layout == "strided":  # neither dimension contiguous
        return torch.randn(B, 2 * D, 2 * L, generator=g)[:, ::2, ::2]
    raise ValueError(layout)


# ---- causal_conv1d_fn ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    B: int = 2
    D: int = 40
    L: int = 19
    W: int = 4
    dtype: torch.dtype = torch.float32  # x, weight, bias, y
    bias: bool = True
    activation: str | bool | None = "silu"
    layout: str = "channel_last"  # "slice", "channel_first", "strided"
    seq_idx: bool = False
    init: bool = False
    init_dtype: torch.dtype | None = None  # None: x's dtype
    final: str = "none"  # "return", "out" (final_states_out), "inplace" (final_states_out = initial_states)


def make_fn_inputs(case: Case, device: torch.device, seed: int = 0) -> dict:
    g = seeded(seed)
    B, D, L, W = case.B, case.D, case.L, case.W
    x = make_x(case.layout, B, D, L, g).to(device=device, dtype=case.dtype)
    weight = (torch.randn(D, W, generator=g) / W**0.5).to(device=device, dtype=case.dtype)
    bias = (0.1 * torch.randn(D, generator=g)).to(device=device, dtype=case.dtype) if case.bias else None
    seq_idx = None
    if case.seq_idx:
        # non-decreasing ids, new sequences at random tokens (lengths 1, < W-1 and longer occur);
        # row 0 starts a new sequence at token 1, so its history belongs to a one-token sequence
        starts = torch.rand(B, L, generator=g) < 0.25
        starts[0, min(1, L - 1)] = True
        seq_idx = torch.cumsum(starts, dim=1).to(device=device, dtype=torch.int32)
    init = None
    if case.init:
        init = torch.randn(B, W - 1, D, generator=g).transpose(1, 2)  # channel-last, as causal_conv1d wants
        init = init.to(device=device, dtype=case.init_dtype or case.dtype)
    return dict(x=x, weight=weight, bias=bias, seq_idx=seq_idx, initial_states=init, activation=case.activation)


def check_fn(case: Case, device: torch.device, seed: int = 0) -> None:
    inp = make_fn_inputs(case, device, seed)
    init = inp["initial_states"]
    B, D, L, W = case.B, case.D, case.L, case.W
    kw = dict(inp)
    final_out = None
    if case.final == "return":
        kw["return_final_states"] = True
    elif case.final == "out":
        final_out = nan_like(torch.empty(B, D, W - 1, dtype=case.dtype, device=device))
        kw["final_states_out"] = final_out
    elif case.final == "inplace":
        kw["initial_states"] = final_out = init.clone()
        kw["final_states_out"] = final_out

    res = causal_conv1d_fn(**kw)
    ref_kw = dict(inp, return_final_states=case.final != "none")
    ref = causal_conv1d_fn_ref(**ref_kw)

    y, y_ref = (res[0], ref[0]) if case.final != "none" else (res, ref)
    assert y.shape == (B, D, L) and y.dtype == case.dtype
    if case.layout in ("channel_last", "slice"):
        assert y.transpose(1, 2).is_contiguous()  # the transposed view of a new [B, L, D] buffer
    else:
        assert y.is_contiguous()
    torch.testing.assert_close(y.float(), y_ref.float(), **tol(case.dtype))

    if case.final == "none":
        assert not isinstance(res, tuple)
        return
    final = res[1]
    if final_out is not None:
        assert final is final_out
    assert final.shape == (B, D, W - 1)
    src_dtype = case.dtype if init is None or L >= W - 1 else init.dtype
    assert_moved_equal(final, ref[1].to(final.dtype), src_dtype)


BASE = Case()


def row(id_: str, **change) -> pytest.param:
    return pytest.param(dataclasses.replace(BASE, **change), id=id_)


ALL_STATES = dict(seq_idx=True, init=True, final="return")

# Base row: B2-D40-L19-W4, fp32, bias, silu, channel-last x, no seq_idx / states.
FN_CASES = [
    pytest.param(BASE, id="base-B2-D40-L19-W4-channel-last"),
    row("B1", B=1),
    row("D72", D=72),
    row("D43-odd", D=43),  # no vector alignment (ALIGN=1)
    row("L1", L=1),
    row("L37", L=37),
    row("W2", W=2),
    row("W3", W=3),
    row("W5", W=5),
    row("W6", W=6),
    row("nobias", bias=False),
    row("act-none", activation=None),
    row("act-swish", activation="swish"),
    row("act-True", activation=True),
    row("bf16", dtype=torch.bfloat16),
    row("fp16", dtype=torch.float16),
    row("slice", layout="slice"),
    row("slice-bf16", layout="slice", dtype=torch.bfloat16),
    row("channel-first", layout="channel_first"),
    row("channel-first-L37-D72", layout="channel_first", L=37, D=72),
    row("channel-first-bf16-L37", layout="channel_first", dtype=torch.bfloat16, L=37),
    row("channel-first-W2", layout="channel_first", W=2),
    row("channel-first-W6", layout="channel_first", W=6),  # fp32 W=6: 8-token chunks
    row("channel-first-L16", layout="channel_first", L=16),  # L % 4 == 0: the vector masks
    row("strided", layout="strided"),
    row("strided-bf16-W5", layout="strided", dtype=torch.bfloat16, W=5),
    # states
    row("seq_idx", seq_idx=True),
    row("init", init=True),
    row("final-return", final="return"),
    row("final-out", final="out"),
    row("init-final-inplace", init=True, final="inplace"),
    row("init-fp32-x-bf16", init=True, init_dtype=torch.float32, dtype=torch.bfloat16, final="return"),
    row("all-states", **ALL_STATES),
    row("all-states-B1-L1", B=1, L=1, **ALL_STATES),
    row("all-states-L2-lt-W-1", L=2, **ALL_STATES),
    row("all-states-W6-L3", W=6, L=3, **ALL_STATES),
    row("all-states-W2", W=2, **ALL_STATES),
    row("all-states-bf16", dtype=torch.bfloat16, **ALL_STATES),
    row("all-states-slice-inplace", layout="slice", seq_idx=True, init=True, final="inplace"),
    row("all-states-channel-first", layout="channel_first", L=37, **ALL_STATES),
    row("all-states-channel-first-bf16-out", layout="channel_first", dtype=torch.bfloat16, seq_idx=True, init=True,
        final="out"),
    row("all-states-channel-first-L2", layout="channel_first", L=2, **ALL_STATES),
    row("all-states-strided", layout="strided", **ALL_STATES),
]


@pytest.mark.parametrize("case", FN_CASES)
def test_fn_matches_ref(case: Case, device):
    check_fn(case, device)


@pytest.mark.parametrize("layout", ["channel_last", "channel_first", "strided"])
def test_fn_writes_every_output(layout: str, device):
    """The registered op on NaN-poisoned out / final buffers: every element gets written."""
    case = dataclasses.replace(BASE, layout=layout, L=21, **ALL_STATES)
    inp = make_fn_inputs(case, device)
    x = inp["x"]
    out = nan_like(torch.empty(x.shape, dtype=x.dtype, device=device))
    if layout == "channel_last":
        out = nan_like(torch.empty(2, 21, 40, device=device)).transpose(1, 2)
    final = nan_like(torch.empty(2, 40, 3, device=device))
    torch.ops.fastmamba.causal_conv1d_fn_(
        x, inp["weight"], inp["bias"], inp["seq_idx"], inp["initial_states"], final, out, True
    )
    y_ref, final_ref = causal_conv1d_fn_ref(**inp, return_final_states=True)
    torch.testing.assert_close(out, y_ref, **tol(torch.float32))
    assert torch.equal(final, final_ref)


@pytest.mark.parametrize("layout", ["channel_last", "channel_first"])
@pytest.mark.parametrize("k", [2, 9])
def test_fn_continues_from_final_states(layout: str, k: int, device):
    """Tokens 0..L-1 in one call == tokens 0..k-1, then k..L-1 from the returned final states
    (k=2 < W-1: the first call's final states still hold an initial-state column)."""
    case = dataclasses.replace(BASE, layout=layout, init=True, final="return")
    inp = make_fn_inputs(case, device)
    x, w, bias, init = inp["x"], inp["weight"], inp["bias"], inp["initial_states"]
    y, final = causal_conv1d_fn(x, w, bias, None, init, True, activation="silu")
    y1, mid = causal_conv1d_fn(x[:, :, :k], w, bias, None, init, True, activation="silu")
    y2, final2 = causal_conv1d_fn(x[:, :, k:], w, bias, None, mid, True, activation="silu")
    torch.testing.assert_close(torch.cat([y1, y2], dim=-1), y, **tol(torch.float32))
    assert torch.equal(final2, final)


@pytest.mark.parametrize("layout", ["channel_last", "channel_first"])
def test_fn_equals_single_token_updates(layout: str, device):
    """causal_conv1d_fn over L tokens == L decode steps (causal_conv1d_update) from the same state."""
    case = dataclasses.replace(BASE, layout=layout, L=9, init=True, final="return")
    inp = make_fn_inputs(case, device)
    x, w, bias, init = inp["x"], inp["weight"], inp["bias"], inp["initial_states"]
    y, final = causal_conv1d_fn(x, w, bias, None, init, True, activation="silu")
    state = init.contiguous()  # [S=B, D, W-1]
    steps = [causal_conv1d_update(x[:, :, t], state, w, bias, "silu") for t in range(case.L)]
    torch.testing.assert_close(torch.stack(steps, dim=-1), y, **tol(torch.float32))
    assert torch.equal(state, final)


def test_fn_seq_idx_equals_separate_calls(device):
    """Two sequences packed in one row with seq_idx == each sequence on its own: the second
    starts from zeros, its final states are the row's."""
    g = seeded(3)
    D, W, n0, n1 = 40, 4, 7, 12
    x = torch.randn(1, n0 + n1, D, generator=g).transpose(1, 2).to(device)
    w = torch.randn(D, W, generator=g).to(device)
    init = torch.randn(1, D, W - 1, generator=g).to(device)
    seq_idx = torch.tensor([[0] * n0 + [1] * n1], dtype=torch.int32, device=device)
    y, final = causal_conv1d_fn(x, w, None, seq_idx, init, True)
    y0 = causal_conv1d_fn(x[:, :, :n0], w, None, None, init)
    y1, final1 = causal_conv1d_fn(x[:, :, n0:], w, None, None, None, True)
    torch.testing.assert_close(y, torch.cat([y0, y1], dim=-1), **tol(torch.float32))
    assert torch.equal(final, final1)


def test_fn_registered_op_declares_its_mutations(device):
    inp = make_fn_inputs(dataclasses.replace(BASE, **ALL_STATES), device)
    out = torch.empty_like(inp["x"])
    final = torch.empty(2, 40, 3, device=device)
    args = (inp["x"], inp["weight"], inp["bias"], inp["seq_idx"], inp["initial_states"], final, out, True)
    torch.library.opcheck(
        torch.ops.fastmamba.causal_conv1d_fn_.default, args, test_utils=("test_schema", "test_faketensor")
    )


# ---- causal_conv1d_varlen --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VarCase:
    lens: tuple[int, ...] = (7, 0, 1, 2, 13)  # tokens per sequence; T = 23
    D: int = 40
    W: int = 4
    extra_state: int = 0  # state_len = W - 1 + extra_state
    dtype: torch.dtype = torch.float32  # x, weight, bias, y
    state_dtype: torch.dtype = torch.float32
    bias: bool = True
    activation: str | None = "silu"
    slots: str = "shuffled"  # "shuffled": S = B + 3, random slots, sequence 2 padded; "none": slot b
    idx_dtype: torch.dtype = torch.int32
    has_init: str = "mixed"  # "mixed" (bool), "int32", "none" (argument left out)
    x_layout: str = "slice"  # "slice": columns of a wider [T, D+24] buffer; "contiguous"; "strided"
    state_layout: str = "contiguous"  # "channel_last": [S, state_len, D] memory
    out: str = "poisoned"  # "poisoned": NaN-filled out=; "strided": out= a column slice; "none"

    @property
    def state_len(self) -> int:
        return self.W - 1 + self.extra_state


def make_varlen_inputs(case: VarCase, device: torch.device, seed: int = 0) -> dict:
    g = seeded(seed)
    B, D, W, SL = len(case.lens), case.D, case.W, case.state_len
    T = sum(case.lens)
    if case.x_layout == "slice":
        x = torch.randn(T, D + 24, generator=g)[:, 16 : 16 + D]
    elif case.x_layout == "strided":
        x = torch.randn(D, T, generator=g).T
    else:
        x = torch.randn(T, D, generator=g)
    x = x.to(device=device, dtype=case.dtype)
    cu = torch.tensor([0, *torch.tensor(case.lens).cumsum(0).tolist()], dtype=case.idx_dtype, device=device)
    if case.slots == "shuffled":
        S = B + 3
        idx = torch.randperm(S, generator=g)[:B]
        if B > 2:
            idx[2] = PAD
        idx = idx.to(device=device, dtype=case.idx_dtype)
    else:
        S, idx = B, None
    if case.state_layout == "channel_last":
        state = torch.randn(S, SL, D, generator=g).transpose(1, 2)
    else:
        state = torch.randn(S, D, SL, generator=g)
    state = state.to(device=device, dtype=case.state_dtype)
    has_init = None
    if case.has_init != "none":
        flags = torch.tensor([i % 3 != 1 for i in range(B)])  # True, False, True, True, False, ...
        has_init = flags.to(device=device, dtype=torch.bool if case.has_init == "mixed" else torch.int32)
    weight = (torch.randn(D, W, generator=g) / W**0.5).to(device=device, dtype=case.dtype)
    bias = (0.1 * torch.randn(D, generator=g)).to(device=device, dtype=case.dtype) if case.bias else None
    return dict(
        x=x, weight=weight, bias=bias, conv_states=state, cu_seqlens=cu, cache_indices=idx,
        has_initial_state=has_init, activation=case.activation,
    )


def check_varlen(case: VarCase, device: torch.device, seed: int = 0) -> None:
    inp = make_varlen_inputs(case, device, seed)
    x, state0, idx = inp["x"], inp["conv_states"], inp["cache_indices"]
    T, D = x.shape
    out = None
    if case.out == "poisoned":
        out = nan_like(torch.empty(T, D, dtype=case.dtype, device=device))
    elif case.out == "strided":
        out = nan_like(torch.empty(T, 2 * D, dtype=case.dtype, device=device))[:, D:]
    state_op, state_ref = state0.clone(), state0.clone()
    y = causal_conv1d_varlen(**{**inp, "conv_states": state_op}, out=out)
    y_ref = causal_conv1d_varlen_ref(**{**inp, "conv_states": state_ref})

    if out is not None:
        assert y is out
    else:
        assert y.is_contiguous() and y.dtype == case.dtype
    torch.testing.assert_close(y.float(), y_ref.float(), **tol(case.dtype))
    assert_moved_equal(state_op, state_ref, case.dtype)
    if idx is not None:  # untouched slots (and the pad sequence's) keep their exact bits
        touched = idx[idx != PAD].long()
        untouched = torch.ones(state_op.shape[0], dtype=torch.bool, device=device)
        untouched[touched] = False
        assert untouched.any()
        assert torch.equal(state_op[untouched], state0[untouched])
        cu = inp["cu_seqlens"].tolist()
        for b in (idx == PAD).nonzero().flatten().tolist():
            assert (y[cu[b] : cu[b + 1]] == 0).all()


VBASE = VarCase()


def vrow(id_: str, **change) -> pytest.param:
    return pytest.param(dataclasses.replace(VBASE, **change), id=id_)


# Base row: lengths (7, 0, 1, 2, 13) (an empty one, one token, fewer than W-1, two tiles), D40-W4,
# state_len W-1 (vLLM layout), fp32, bias, silu, shuffled slots with sequence 2 padded, mixed
# has_initial_state, x a column slice of a wider buffer, NaN-poisoned out.
VARLEN_CASES = [
    pytest.param(VBASE, id="base-lens7,0,1,2,13-D40-W4-SL3"),
    vrow("SL=W", extra_state=1),
    vrow("SL=W+2", extra_state=3),
    vrow("state-channel-last-SL=W", state_layout="channel_last", extra_state=1),
    vrow("W2", W=2),
    vrow("W6-SL=W", W=6, extra_state=1),
    vrow("D72", D=72),
    vrow("bf16", dtype=torch.bfloat16, state_dtype=torch.bfloat16),
    vrow("x-bf16-state-fp32", dtype=torch.bfloat16),
    vrow("x-fp32-state-bf16", state_dtype=torch.bfloat16),
    vrow("fp16", dtype=torch.float16, state_dtype=torch.float16),
    vrow("noslots", slots="none"),
    vrow("has-init-none", has_init="none"),
    vrow("has-init-int32", has_init="int32"),
    vrow("int64-indices", idx_dtype=torch.int64),
    vrow("nobias-act-none", bias=False, activation=None),
    vrow("x-contiguous-out-none", x_layout="contiguous", out="none"),
    vrow("x-strided-out-strided", x_layout="strided", out="strided"),
    vrow("one-seq-L37", lens=(37,), slots="none"),
    vrow("all-short", lens=(1, 2, 0, 3, 1, 2), extra_state=2),
    vrow("empty-all", lens=(0, 0, 0)),
]


@pytest.mark.parametrize("case", VARLEN_CASES)
def test_varlen_matches_ref(case: VarCase, device):
    check_varlen(case, device)


@pytest.mark.parametrize("extra_state", [0, 1, 3], ids=["SL=W-1", "SL=W", "SL=W+2"])
@pytest.mark.parametrize("k", [1, 2, 6])
def test_varlen_continues_from_the_slot(k: int, extra_state: int, device):
    """A sequence in one call == its first k tokens, then the rest continuing from the slot
    (k < state_len: the slot then still holds part of the older state)."""
    case = dataclasses.replace(VBASE, lens=(11,), slots="none", extra_state=extra_state)
    inp = make_varlen_inputs(case, device)
    x, state = inp["x"], inp["conv_states"]
    args = (inp["weight"], inp["bias"])
    yes = torch.ones(1, dtype=torch.bool, device=device)
    whole, split = state.clone(), state.clone()
    cu = torch.tensor([0, 11], dtype=torch.int32, device=device)
    y = causal_conv1d_varlen(x, *args, whole, cu, None, yes, "silu")
    cu1 = torch.tensor([0, k], dtype=torch.int32, device=device)
    cu2 = torch.tensor([0, 11 - k], dtype=torch.int32, device=device)
    y1 = causal_conv1d_varlen(x[:k], *args, split, cu1, None, yes, "silu")
    y2 = causal_conv1d_varlen(x[k:], *args, split, cu2, None, yes, "silu")
    torch.testing.assert_close(torch.cat([y1, y2]), y, **tol(torch.float32))
    assert torch.equal(split, whole)


@pytest.mark.parametrize("extra_state", [0, 1], ids=["SL=W-1", "SL=W"])
def test_varlen_equals_single_token_updates(extra_state: int, device):
    """Each packed sequence == its tokens fed one by one to causal_conv1d_update from the same slot."""
    case = dataclasses.replace(VBASE, lens=(6, 3), slots="shuffled", extra_state=extra_state, has_init="none")
    inp = make_varlen_inputs(case, device)
    x, idx, weight, bias = inp["x"], inp["cache_indices"], inp["weight"], inp["bias"]
    state0 = inp["conv_states"]
    yes = torch.ones(2, dtype=torch.bool, device=device)
    packed, stepped = state0.clone(), state0.clone()
    y = causal_conv1d_varlen(x, weight, bias, packed, inp["cu_seqlens"], idx, yes, "silu")
    for b, (start, n) in enumerate([(0, 6), (6, 3)]):
        slot = idx[b : b + 1]
        for t in range(n):
            y_t = causal_conv1d_update(x[start + t][None], stepped, weight, bias, "silu", conv_state_indices=slot)
            torch.testing.assert_close(y_t[0], y[start + t], **tol(torch.float32))
    assert torch.equal(packed, stepped)


def test_varlen_registered_op_declares_its_mutations(device):
    inp = make_varlen_inputs(VBASE, device)
    out = torch.empty_like(inp["x"])
    args = (
        inp["x"], inp["weight"], inp["bias"], inp["conv_states"], inp["cu_seqlens"], inp["cache_indices"],
        inp["has_initial_state"], out, True, PAD,
    )
    torch.library.opcheck(
        torch.ops.fastmamba.causal_conv1d_varlen_.default, args, test_utils=("test_schema", "test_faketensor")
    )


def test_docstring_examples():
    assert doctest.testmod(conv1d_fn_api, raise_on_error=False).failed == 0


def test_public_names():
    import fastmamba.ops as ops

    assert ops.causal_conv1d_fn is causal_conv1d_fn and ops.causal_conv1d_varlen is causal_conv1d_varlen
    assert {"causal_conv1d_fn", "causal_conv1d_varlen"} <= set(ops.__all__)


# ---- bad input: each raises before any write ---------------------------------------------------------


def _bad(**change):
    def mutate(inp):
        for key, fn in change.items():
            inp[key] = fn(inp)
        return inp

    return mutate


FN_BAD = [
    pytest.param(_bad(x=lambda i: i["x"][0]), ValueError, "`x` expected shape", id="x-rank2"),
    pytest.param(_bad(x=lambda i: i["x"][:, :, :0]), ValueError, "at least one token", id="L0"),
    pytest.param(_bad(x=lambda i: i["x"].long()), TypeError, "`x`", id="x-int"),
    pytest.param(_bad(x=lambda i: i["x"][:, :20]), ValueError, "`weight` expected shape", id="x-D-mismatch"),
    pytest.param(_bad(weight=lambda i: i["weight"].repeat(1, 2)[:, :7]), ValueError, "got 7", id="width-7"),
    pytest.param(_bad(weight=lambda i: i["weight"][:, :1]), ValueError, "got 1", id="width-1"),
    pytest.param(_bad(weight=lambda i: i["weight"].long()), TypeError, "`weight` expected dtype", id="weight-int"),
    pytest.param(_bad(bias=lambda i: i["bias"][:10]), ValueError, "`bias`", id="bias-shape"),
    pytest.param(_bad(bias=lambda i: i["bias"].int()), TypeError, "`bias` expected dtype", id="bias-int"),
    pytest.param(_bad(activation=lambda i: "relu"), ValueError, "`activation`", id="act-relu"),
    pytest.param(_bad(seq_idx=lambda i: i["seq_idx"][:, :5]), ValueError, "`seq_idx`", id="seq_idx-shape"),
    pytest.param(_bad(seq_idx=lambda i: i["seq_idx"].float()), TypeError, "`seq_idx`", id="seq_idx-float"),
    pytest.param(
        _bad(initial_states=lambda i: i["initial_states"][:, :, :2]), ValueError, "`initial_states`", id="init-shape"
    ),
    pytest.param(
        _bad(initial_states=lambda i: i["initial_states"].long()), TypeError, "`initial_states`", id="init-int"
    ),
    pytest.param(
        _bad(final_states_out=lambda i: torch.zeros(2, 40, 4)), ValueError, "`final_states_out`", id="final-shape"
    ),
    pytest.param(_bad(weight=lambda i: i["weight"].to("meta")), ValueError, "`weight` is on meta", id="device"),
]


@pytest.mark.parametrize("mutate, exc, match", FN_BAD)
def test_fn_bad_input_raises(mutate, exc, match):
    # CPU on purpose: errors come from the host-side checks, before any kernel or reference runs
    inp = make_fn_inputs(dataclasses.replace(BASE, seq_idx=True, init=True), torch.device("cpu"))
    inp["final_states_out"] = torch.full((2, 40, 3), 7.0)
    inp = mutate(inp)
    final = inp["final_states_out"]
    final_before = final.clone()
    with pytest.raises(exc, match=match):
        causal_conv1d_fn(**inp)
    assert torch.equal(final, final_before)


VARLEN_BAD = [
    pytest.param(_bad(x=lambda i: i["x"][None]), ValueError, "`x` expected shape", id="x-rank3"),
    pytest.param(_bad(x=lambda i: i["x"].long()), TypeError, "`x`", id="x-int"),
    pytest.param(_bad(x=lambda i: i["x"][:, :20]), ValueError, "`weight` expected shape", id="x-D-mismatch"),
    pytest.param(_bad(weight=lambda i: i["weight"].repeat(1, 2)[:, :7]), ValueError, "got 7", id="width-7"),
    pytest.param(_bad(weight=lambda i: i["weight"].long()), TypeError, "`weight` expected dtype", id="weight-int"),
    pytest.param(_bad(bias=lambda i: i["bias"][:10]), ValueError, "`bias`", id="bias-shape"),
    pytest.param(_bad(bias=lambda i: i["bias"].bool()), TypeError, "`bias` expected dtype", id="bias-bool"),
    pytest.param(_bad(activation=lambda i: "gelu"), ValueError, "`activation`", id="act-gelu"),
    pytest.param(_bad(conv_states=lambda i: i["conv_states"][:, :20]), ValueError, "`conv_states`", id="state-D"),
    pytest.param(_bad(conv_states=lambda i: i["conv_states"][:, :, :2]), ValueError, "state_len", id="state-short"),
    pytest.param(_bad(conv_states=lambda i: i["conv_states"].long()), TypeError, "`conv_states`", id="state-int"),
    pytest.param(
        _bad(cu_seqlens=lambda i: torch.tensor([1, 7, 7, 8, 10, 23], dtype=torch.int32)),
        ValueError, "`cu_seqlens` expected to start at 0", id="cu-not-from-0",
    ),
    pytest.param(
        _bad(cu_seqlens=lambda i: torch.tensor([0, 7, 5, 8, 10, 23], dtype=torch.int32)),
        ValueError, "never decrease", id="cu-decreasing",
    ),
    pytest.param(
        _bad(cu_seqlens=lambda i: torch.tensor([0, 7, 7, 8, 10, 22], dtype=torch.int32)),
        ValueError, "end at T = 23", id="cu-not-T",
    ),
    pytest.param(
        _bad(cu_seqlens=lambda i: i["cu_seqlens"][None]), ValueError, "`cu_seqlens` expected shape", id="cu-rank2"
    ),
    pytest.param(
        _bad(cu_seqlens=lambda i: i["cu_seqlens"][:0]), ValueError, "`cu_seqlens` expected shape", id="cu-empty"
    ),
    pytest.param(_bad(cu_seqlens=lambda i: i["cu_seqlens"].float()), TypeError, "`cu_seqlens`", id="cu-float"),
    pytest.param(
        _bad(cache_indices=lambda i: torch.tensor([0, 1, PAD, 3, 8], dtype=torch.int32)),
        ValueError, "`cache_indices` values", id="slot-out-of-range",
    ),
    pytest.param(
        _bad(cache_indices=lambda i: i["cache_indices"][:3]), ValueError, "`cache_indices`", id="idx-shape"
    ),
    pytest.param(
        _bad(cache_indices=lambda i: None, conv_states=lambda i: i["conv_states"][:4]), ValueError, "S >= B",
        id="no-idx-too-few-slots",
    ),
    pytest.param(
        _bad(has_initial_state=lambda i: i["has_initial_state"][:2]), ValueError, "`has_initial_state`",
        id="has-init-shape",
    ),
    pytest.param(
        _bad(has_initial_state=lambda i: i["has_initial_state"].float()), TypeError, "`has_initial_state`",
        id="has-init-float",
    ),
    pytest.param(_bad(out=lambda i: torch.zeros(23, 41)), ValueError, "`out`", id="out-shape"),
    pytest.param(_bad(out=lambda i: torch.zeros(23, 40, dtype=torch.half)), TypeError, "`out`", id="out-dtype"),
    pytest.param(_bad(weight=lambda i: i["weight"].to("meta")), ValueError, "`weight` is on meta", id="device"),
    pytest.param(_bad(pad_slot_id=lambda i: -1.0), TypeError, "`pad_slot_id` expected an int", id="pad-float"),
    pytest.param(
        _bad(pad_slot_id=lambda i: torch.tensor(-1)), TypeError, "`pad_slot_id` expected an int", id="pad-tensor"
    ),
]


@pytest.mark.parametrize("mutate, exc, match", VARLEN_BAD)
def test_varlen_bad_input_raises_before_writing(mutate, exc, match):
    inp = make_varlen_inputs(VBASE, torch.device("cpu"))
    inp["out"] = torch.full((23, 40), 7.0)
    inp = mutate(inp)
    state, out = inp["conv_states"], inp["out"]
    state_before, out_before = state.clone(), out.clone()
    with pytest.raises(exc, match=match):
        causal_conv1d_varlen(**inp)
    assert torch.equal(state, state_before)
    assert torch.equal(out, out_before)


# ---- full shapes on a GPU ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["slice", "channel_first"])
def test_fn_full_shape_gpu(layout: str, device):
    case = Case(B=2, D=5376, L=2048, dtype=torch.bfloat16, layout=layout)
    check_fn(case, device)
    check_fn(dataclasses.replace(case, D=10240, L=1000, **ALL_STATES), device, seed=1)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(16, 128, 1), (16, 128, 2)], ids=["1warp", "2warps"])
def test_fn_rows_tiles_gpu(tile: tuple[int, int, int], device):
    """Both tiles the channel-last launcher picks between (by input size), each on a full shape."""
    from fastmamba.ops.conv1d_fn import configs

    with configs.forced_config(*tile):
        check_fn(Case(B=3, D=5376, L=1111, dtype=torch.bfloat16, layout="slice", **ALL_STATES), device, seed=2)


@pytest.mark.gpu
@pytest.mark.parametrize("extra_state", [0, 1], ids=["SL3", "SL4"])
def test_varlen_full_shape_gpu(extra_state: int, device):
    lens = (1000, 0, 1, 2, 517, 528)  # 2048 tokens
    case = VarCase(lens=lens, D=5376, extra_state=extra_state, dtype=torch.bfloat16, state_dtype=torch.bfloat16)
    check_varlen(case, device)
    check_varlen(dataclasses.replace(case, state_layout="channel_last", state_dtype=torch.float32), device, seed=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs a Hopper (sm_90) or newer GPU")
@pytest.mark.parametrize("layout", ["channel_last", "channel_first", "varlen"])
def test_pdl_chain_matches_eager_gpu(layout: str):
    """Under programmatic dependent launch every program waits for the kernel before it: a CUDA
    graph of a producer (x * 2), a conv of its output, a conv of that conv's output (multi-wave
    grids: the channel-last rows kernel lets its dependents launch early, the others as their
    programs exit) and one of a single-wave size (dependents launch early), captured with PDL on,
    gives exactly what eager launches without PDL give."""
    from fastmamba.ops._common.pdl import programmatic_dependent_launch

    g = torch.Generator().manual_seed(11)
    D, L, W = 5376, 2048, 4
    w = (torch.randn(D, W, generator=g) * 0.3).to("cuda", torch.bfloat16)
    bias = torch.randn(D, generator=g).to("cuda", torch.bfloat16)
    if layout == "varlen":
        src = torch.randn(L, D, generator=g).to("cuda", torch.bfloat16)
        cu = torch.tensor([0, 5, 700, L], device="cuda", dtype=torch.int32)
        states = torch.randn(4, D, W - 1, generator=g).to("cuda", torch.bfloat16)
        slots = torch.tensor([2, 0, 3], device="cuda", dtype=torch.int32)
        flags = torch.tensor([True, False, True], device="cuda")
        small, cu_small = src[:3], torch.tensor([0, 3], device="cuda", dtype=torch.int32)  # one wave

        def step():
            x = src * 2
            y = causal_conv1d_varlen(x, w, bias, states, cu, slots, flags, "silu")
            y = causal_conv1d_varlen(y, w, bias, states, cu, slots, flags, "silu")
            return y, causal_conv1d_varlen(small * 2, w, bias, states, cu_small, slots[:1], flags[:1], "silu")
    else:
        src = make_x(layout, 1, D, L, g).to("cuda", torch.bfloat16)
        small = src[:, :, :16]

        def step():
            x = src * 2
            y, final = causal_conv1d_fn(x, w, bias, return_final_states=True, activation="silu")
            y = causal_conv1d_fn(y, w, bias, initial_states=final, activation="silu")
            return y, causal_conv1d_fn(small * 2, w, bias, activation="silu")

    states0 = states.clone() if layout == "varlen" else None
    eager = []
    for _ in range(2):
        eager.append(tuple(t.clone() for t in step()))
    states_eager = states.clone() if layout == "varlen" else None
    if layout == "varlen":
        states.copy_(states0)
    with programmatic_dependent_launch():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles the PDL variants (on the varlen states: restored below)
            step()
        torch.cuda.current_stream().wait_stream(side)
        if layout == "varlen":
            states.copy_(states0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
    for expected in eager:
        for t in outs:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outs, expected):
            assert torch.equal(got, want)
    if layout == "varlen":
        assert torch.equal(states, states_eager)
