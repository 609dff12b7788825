"""selective_state_update vs the fp32 reference (CPU: Triton interpreter; GPU: full shapes)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fastmamba.ops import selective_state_update
from fastmamba.ops._common.jit_math import stochastic_round
from fastmamba.ops.decode_params import SlotIndexBuffer
from fastmamba.ops.state_update.ref import selective_state_update_ref
from tests.helpers import nan_like, tol


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    batch: int = 2
    heads: int = 4
    headdim: int = 24  # not a multiple of the interpreter's 16-wide P block
    dstate: int = 16
    groups: int = 2
    tokens: int = 0  # 0: single-token form (B, H, P); else (B, T, H, P)
    act: torch.dtype = torch.float32
    state_dtype: torch.dtype = torch.float32
    has_z: bool = True
    has_D: bool = True
    has_dt_bias: bool = True
    tied: bool = True  # A/dt/D/dt_bias as stride-0 broadcasts of per-head values
    slots: str = "shuffled-pad"  # "shuffled-pad" | "none" | "shuffled"
    strided_x: bool = False
    headless: bool = False  # mamba_ssm's (B, D) form


BASE = Case("B2-H4-P24-N16-G2-fp32")
CASES = [
    BASE,
    dataclasses.replace(BASE, id="B1", batch=1, slots="shuffled"),
    dataclasses.replace(BASE, id="bf16-act", act=torch.bfloat16),
    dataclasses.replace(BASE, id="fp16-act", act=torch.float16),
    dataclasses.replace(BASE, id="bf16-act-bf16-state", act=torch.bfloat16, state_dtype=torch.bfloat16),
    dataclasses.replace(BASE, id="fp16-act-fp16-state", act=torch.float16, state_dtype=torch.float16),
    dataclasses.replace(BASE, id="bf16-act-fp16-state", act=torch.bfloat16, state_dtype=torch.float16),
    dataclasses.replace(BASE, id="fp32-act-bf16-state", state_dtype=torch.bfloat16),
    dataclasses.replace(BASE, id="no-z", has_z=False),
    dataclasses.replace(BASE, id="no-D-no-dt_bias", has_D=False, has_dt_bias=False),
    dataclasses.replace(BASE, id="G1", groups=1),
    dataclasses.replace(BASE, id="G4-H4", groups=4),
    dataclasses.replace(BASE, id="N12-P10", dstate=12, headdim=10),
    dataclasses.replace(BASE, id="untied", tied=False),
    dataclasses.replace(BASE, id="no-slots", slots="none"),
    dataclasses.replace(BASE, id="strided-x", strided_x=True),
    dataclasses.replace(BASE, id="headless", headless=True, heads=1, groups=1),
    dataclasses.replace(BASE, id="T3", tokens=3),
    dataclasses.replace(BASE, id="T3-bf16-state", tokens=3, act=torch.bfloat16, state_dtype=torch.bfloat16),
]


def make_inputs(c: Case, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    H, P, N, G = c.heads, c.headdim, c.dstate, c.groups
    nslots = 2 * c.batch + 1
    lead = (c.batch, c.tokens) if c.tokens else (c.batch,)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    state = rnd(nslots, H, P, N).to(c.state_dtype)
    if c.strided_x:  # a slice of a wider tensor: non-unit stride over heads
        x = rnd(*lead, H, 2 * P).to(c.act)[..., :P]
    else:
        x = rnd(*lead, H, P).to(c.act)
    dt_h = F.softplus(rnd(*lead, H) - 4.0)  # physically plausible step sizes
    A_h = -torch.exp(rnd(H, scale=0.5))
    D_h, dt_bias_h = rnd(H), rnd(H, scale=0.5)
    if c.tied:
        dt = dt_h.unsqueeze(-1).expand(*lead, H, P).to(c.act)
        A = A_h[:, None, None].expand(H, P, N)
        D = D_h[:, None].expand(H, P)
        dt_bias = dt_bias_h[:, None].expand(H, P)
    else:
        dt = (dt_h.unsqueeze(-1) + 0.1 * rnd(*lead, H, P).abs()).to(c.act)
        A = A_h[:, None, None] * (1 + 0.1 * rnd(H, P, N).abs())
        D = D_h[:, None] + rnd(H, P)
        dt_bias = dt_bias_h[:, None] + 0.1 * rnd(H, P)
    Bm = rnd(*lead, G, N, scale=0.3).to(c.act)
    Cm = rnd(*lead, G, N, scale=0.3).to(c.act)
    z = rnd(*lead, H, P).to(c.act)
    perm = torch.randperm(nslots, generator=g)[: c.batch].to(torch.int32)
    if c.slots == "shuffled-pad":
        perm[-1] = -1
    idx = None if c.slots == "none" else perm.to(device)
    kwargs = dict(
        D=D if c.has_D else None,
        z=z if c.has_z else None,
        dt_bias=dt_bias if c.has_dt_bias else None,
        dt_softplus=True,
        state_batch_indices=idx,
    )
    if c.headless:  # drop the heads axis everywhere (H == G == 1)
        state, x, dt, Bm, Cm = state[:, 0], x[:, 0], dt[:, 0], Bm[:, 0], Cm[:, 0]
        A = A[0]
        kwargs["D"] = kwargs["D"][0] if c.has_D else None
        kwargs["dt_bias"] = kwargs["dt_bias"][0] if c.has_dt_bias else None
        kwargs["z"] = kwargs["z"][:, 0] if c.has_z else None
    return state, (x, dt, A, Bm, Cm), kwargs


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_matches_reference(c: Case, device):
    state, args, kwargs = make_inputs(c, device)
    ref_state = state.clone()
    out = nan_like(args[0])
    y = selective_state_update(state, *args, **kwargs, out=out)
    y_ref = selective_state_update_ref(ref_state, *args, **kwargs)
    assert y.data_ptr() == out.data_ptr()
    t = tol(c.act, c.state_dtype)
    torch.testing.assert_close(y.float(), y_ref.float(), **t)
    torch.testing.assert_close(state.float(), ref_state.float(), **t)

    idx = kwargs["state_batch_indices"]
    touched = set(idx.tolist()) if idx is not None else set(range(c.batch))
    untouched = [s for s in range(state.shape[0]) if s not in touched]
    assert torch.equal(state[untouched], ref_state[untouched])
    if c.slots == "shuffled-pad":  # pad row: output zeroed
        assert torch.equal(y[-1], torch.zeros_like(y[-1]))


def test_allocates_output_and_accepts_per_head_vectors(device):
    c = BASE
    state, (x, dt, A, Bm, Cm), kw = make_inputs(c, device, seed=1)
    ref_state = state.clone()
    y_ref = selective_state_update_ref(ref_state, x, dt, A, Bm, Cm, **kw)
    # (H,) forms for A, D, dt_bias and a (B, H) dt, as callers often hold them
    kw2 = dict(kw, D=kw["D"][:, 0].contiguous(), dt_bias=kw["dt_bias"][:, 0].contiguous())
    y = selective_state_update(state, x, dt[..., 0].contiguous(), A[:, 0, 0].contiguous(), Bm, Cm, **kw2)
    torch.testing.assert_close(y, y_ref, **tol(c.act))
    torch.testing.assert_close(state, ref_state, **tol(c.act))


def test_multi_token_intermediate_states_and_dst_slots(device):
    c = dataclasses.replace(BASE, tokens=4, slots="shuffled")
    state, args, kw = make_inputs(c, device, seed=2)
    T, H, P, N = c.tokens, c.heads, c.headdim, c.dstate
    dst = torch.tensor([3, -1], dtype=torch.int32, device=device)  # second row: state not written
    inter = torch.full((c.batch, T, H, P, N), float("nan"), device=device)
    inter_ref = torch.empty_like(inter)
    ref_state = state.clone()
    y = selective_state_update(state, *args, **kw, dst_state_batch_indices=dst, intermediate_states=inter)
    y_ref = selective_state_update_ref(ref_state, *args, **kw, dst_state_batch_indices=dst,
                                       intermediate_states=inter_ref)
    torch.testing.assert_close(y, y_ref, **tol(c.act))
    torch.testing.assert_close(inter, inter_ref, **tol(c.act))
    torch.testing.assert_close(state, ref_state, **tol(c.act))
    # the last intermediate state is the final state, written to the dst slot only
    torch.testing.assert_close(state[3], inter[0, -1], **tol(c.act))


def test_T_tokens_equal_T_single_steps(device):
    c = dataclasses.replace(BASE, tokens=3, slots="shuffled")
    state, (x, dt, A, Bm, Cm), kw = make_inputs(c, device, seed=3)
    s_multi, s_steps = state.clone(), state.clone()
    y_multi = selective_state_update(s_multi, x, dt, A, Bm, Cm, **kw)
    for t in range(c.tokens):
        kw_t = dict(kw, z=kw["z"][:, t])
        y_t = selective_state_update(s_steps, x[:, t], dt[:, t], A, Bm[:, t], Cm[:, t], **kw_t)
        torch.testing.assert_close(y_multi[:, t], y_t, **tol(c.act))
    torch.testing.assert_close(s_multi, s_steps, **tol(c.act))


@pytest.mark.parametrize("tokens", [0, 3], ids=["single-token", "T3"])
@pytest.mark.parametrize("A_form", ["H", "HPN-broadcast"])
def test_A_is_log_equals_minus_exp(tokens, A_form, device):
    """A_is_log=True with A = A_log gives what A = -exp(A_log) gives (kernel and reference), so a
    caller needs no cached -exp(A_log) that an in-place weight change could leave stale."""
    c = dataclasses.replace(BASE, tokens=tokens)
    state, (x, dt, A, Bm, Cm), kw = make_inputs(c, device, seed=11)
    A_log = torch.log(-A[:, 0, 0]).contiguous()  # A = -exp(A_log)
    if A_form == "HPN-broadcast":
        A_log = A_log[:, None, None].expand(c.heads, c.headdim, c.dstate)
    A_ref = -torch.exp(A_log.float())
    s_log, s_exp, s_ref = state.clone(), state.clone(), state.clone()
    out = nan_like(x)
    y_log = selective_state_update(s_log, x, dt, A_log, Bm, Cm, **kw, out=out, A_is_log=True)
    y_exp = selective_state_update(s_exp, x, dt, A_ref, Bm, Cm, **kw)
    y_ref = selective_state_update_ref(s_ref, x, dt, A_log, Bm, Cm, **kw, A_is_log=True)
    torch.testing.assert_close(y_log, y_exp, **tol(c.act))
    torch.testing.assert_close(s_log, s_exp, **tol(c.act))
    torch.testing.assert_close(y_ref, y_exp, **tol(c.act))
    torch.testing.assert_close(s_ref, s_exp, **tol(c.act))
    if A_form == "H":  # an in-place weight change is seen by the next call (nothing derived is cached)
        with torch.no_grad():
            A_log.sub_(1.0)
        s2, s2_exp = state.clone(), state.clone()
        selective_state_update(s2, x, dt, A_log, Bm, Cm, **kw, A_is_log=True)
        selective_state_update(s2_exp, x, dt, -torch.exp(A_log), Bm, Cm, **kw)
        torch.testing.assert_close(s2, s2_exp, **tol(c.act))
        assert not torch.allclose(s2, s_log)


@pytest.mark.parametrize("tokens", [0, 2], ids=["single-token", "T2"])
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp32_B_C_D_dt_bias_dt_with_16bit_x(act, tokens, device):
    """The drop-in dtype mix of mamba_ssm's callers: fp32 B, C, D, dt_bias and dt next to a 16-bit
    x (and z). Computed in fp32 from those fp32 tensors: equal to the reference run on the same
    fp32 tensors."""
    c = dataclasses.replace(BASE, tokens=tokens)  # fp32 inputs, then x and z rounded to `act`
    state, (x, dt, A, Bm, Cm), kw = make_inputs(c, device, seed=12)
    x16 = x.to(act)
    kw = dict(kw, z=kw["z"].to(act))
    assert Bm.dtype == Cm.dtype == dt.dtype == kw["D"].dtype == kw["dt_bias"].dtype == torch.float32
    state0, ref_state = state.clone(), state.clone()
    out = nan_like(x16)
    y = selective_state_update(state, x16, dt, A, Bm, Cm, **kw, out=out)
    y_ref = selective_state_update_ref(ref_state, x16, dt, A, Bm, Cm, **kw)
    assert y.dtype == act
    torch.testing.assert_close(y.float(), y_ref.float(), **tol(act))
    torch.testing.assert_close(state, ref_state, **tol(torch.float32))  # fp32 state: every input was fp32 or exact
    # rounding B and C to 16 bits first (what a same-dtype API forces on callers) changes the state
    s16 = state0.clone()
    selective_state_update_ref(s16, x16, dt, A, Bm.to(act), Cm.to(act), **kw)
    assert not torch.allclose(s16, ref_state, atol=1e-6, rtol=1e-6)


@pytest.fixture(params=[True, False], ids=["store-early", "store-late"])
def store_placement(request, monkeypatch):
    """Both places the kernel may store the final state (configs.STORE_EARLY; the small shapes
    here would always take the early one)."""
    import fastmamba.ops.state_update.configs as ssu_configs

    monkeypatch.setattr(ssu_configs, "STORE_EARLY", request.param)
    return request.param


@pytest.mark.parametrize("c", [CASES[0], dataclasses.replace(BASE, tokens=3, slots="shuffled-pad")],
                         ids=["base", "T3-pad"])
def test_both_store_placements_match_reference(c: Case, store_placement, device):
    test_matches_reference(c, device)


def test_both_store_placements_multi_token_dst_slots(store_placement, device):
    test_multi_token_intermediate_states_and_dst_slots(device)


def test_both_store_placements_stochastic_rounding(store_placement, device):
    test_stochastic_rounding_through_the_op(torch.bfloat16, device)


# ---- stochastic rounding -------------------------------------------------------------------

@triton.jit
def _stochastic_round_kernel(v_ptr, out_ptr, seed, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(v_ptr + offs, mask=m, other=0.0)
    u = tl.rand(seed, offs)
    tl.store(out_ptr + offs, stochastic_round(v, u, out_ptr.dtype.element_ty), mask=m)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_stochastic_rounding_is_unbiased(dtype, device):
    """Values 0.3 ulp above a representable number: round-to-nearest always goes down (bias -0.3
    ulp); stochastic rounding goes up 30% of the time and its mean residual is ~0."""
    n, block = 1 << 20, 1 << 16
    g = torch.Generator().manual_seed(7)
    base = (torch.rand(n, generator=g) + 0.5).to(dtype)  # in [0.5, 1.5): subnormals aside
    base = torch.where(torch.rand(n, generator=g) < 0.5, -base, base)  # both signs
    up = torch.nextafter(base.float().to(dtype), torch.full_like(base, float("inf"))).float()
    down = base.float()
    # step away from zero so that the 0.3 fraction is of the gap on the far side
    nxt = torch.where(down > 0, up, torch.nextafter(base, torch.full_like(base, -float("inf"))).float())
    ulp = (nxt - down).abs()
    v = (down + 0.3 * (nxt - down)).to(device)
    out = torch.full((n,), float("nan"), dtype=dtype, device=device)
    _stochastic_round_kernel[(n // block,)](v, out, 1234, n, BLOCK=block)
    out = out.float().cpu()
    v, ulp = v.cpu(), ulp
    assert torch.all((out == down) | (out == nxt)), "every result is one of the two neighbours"
    rel = (out - v) / ulp
    se = 0.5 / n**0.5
    assert abs(rel.mean().item()) < 6 * se, f"mean residual {rel.mean().item():.2e} ulp is biased"
    frac_up = (out == nxt).float().mean().item()
    assert abs(frac_up - 0.3) < 6 * (0.3 * 0.7 / n) ** 0.5, f"rounded away {frac_up:.4f} of the time, expected 0.3"
    rn = v.to(dtype).float()
    assert torch.equal(rn, down), "round-to-nearest is biased here (always down)"


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_stochastic_rounding_through_the_op(state_dtype, device):
    """The stored 16-bit state is one of the two neighbours of the exact fp32 result, differs from
    round-to-nearest in the expected number of elements (sum of per-element probabilities), and
    depends on the seed."""
    c = dataclasses.replace(BASE, heads=4, headdim=64, dstate=64, batch=4, slots="shuffled",
                            state_dtype=state_dtype)
    state, args, kw = make_inputs(c, device, seed=4)
    exact = state.float()
    selective_state_update(exact, *args, **kw)  # fp32 state: stored exactly
    rows = kw["state_batch_indices"].long()
    v = exact[rows].cpu()
    rn = v.to(state_dtype)
    rn_below = rn.float().abs() <= v.abs()  # is round-to-nearest the neighbour nearer zero?
    toward_zero = torch.nextafter(rn, torch.zeros_like(rn)).float()
    away = torch.nextafter(rn, torch.where(v < 0, -1.0, 1.0).to(state_dtype) * float("inf")).float()
    lo = torch.where(rn_below, rn.float(), toward_zero)  # neighbour nearer zero
    hi = torch.where(rn_below, away, rn.float())  # neighbour farther from zero
    p_hi = ((v - lo).abs() / (hi - lo).abs().clamp_min(1e-30)).clamp(0, 1)
    p_not_rn = torch.where(rn_below, p_hi, 1 - p_hi)

    results = []
    for seed in (11, 12):
        s = state.clone()
        selective_state_update(s, *args, **kw, rand_seed=torch.tensor([seed], device=device))
        sr = s[rows].float().cpu()
        assert torch.all((sr == lo) | (sr == hi)), "stochastic result must be a neighbour of the exact value"
        n_diff = (sr != rn.float()).sum().item()
        mean, var = p_not_rn.sum().item(), (p_not_rn * (1 - p_not_rn)).sum().item()
        assert abs(n_diff - mean) < 6 * var**0.5 + 1, f"{n_diff} differ from round-to-nearest, expected {mean:.0f}"
        results.append(sr)
    assert not torch.equal(results[0], results[1]), "a different seed must give different roundings"


def test_slot_index_buffer_reuses_memory():
    buf = SlotIndexBuffer(8, "cpu")
    v1 = buf.fill([3, 1, 4])
    ptr = v1.data_ptr()
    v2 = buf.fill(torch.tensor([5, 9, 2, 6]))
    assert v2.data_ptr() == ptr and v2.tolist() == [5, 9, 2, 6] and v2.dtype == torch.int32
    with pytest.raises(ValueError, match="capacity 8"):
        buf.fill(list(range(9)))


# ---- bad input: clear errors, nothing written ------------------------------------------------

def _bad(mutate, match, exc=ValueError):
    state, (x, dt, A, Bm, Cm), kw = make_inputs(BASE, "cpu", seed=5)
    before = state.clone()
    args = dict(state=state, x=x, dt=dt, A=A, B=Bm, C=Cm, **kw)
    mutate(args)
    with pytest.raises(exc, match=match):
        selective_state_update(**args)
    assert torch.equal(state, before)


@pytest.mark.parametrize("mutate,match,exc", [
    (lambda a: a.update(x=a["x"][0]), r"`state` expected shape \(S, H=1, P=24, N\)", ValueError),
    (lambda a: a.update(x=a["x"].unsqueeze(0).unsqueeze(0)), r"`x` must be", ValueError),
    (lambda a: a.update(B=a["B"][:, :, :8]), r"`B` expected shape .*N=16", ValueError),
    (lambda a: a.update(C=a["C"][:, :1]), r"`C` expected shape", ValueError),
    (lambda a: a.update(B=torch.randn(2, 3, 16), C=torch.randn(2, 3, 16)), r"G=3 .* must divide .* H=4", ValueError),
    (lambda a: a.update(B=a["B"].int()), r"`B` expected dtype", TypeError),
    (lambda a: a.update(x=a["x"].int()), r"`x` expected dtype", TypeError),
    (lambda a: a.update(state_batch_indices=torch.tensor([0, 99], dtype=torch.int32)), r"\[0, 5\).*\[99\]", ValueError),
    (lambda a: a.update(state_batch_indices=torch.tensor([0, 1.0])), r"expected dtype in \(int32, int64\)", TypeError),
    (lambda a: a.update(dt_bias=torch.randn(3)), r"`dt_bias` expected shape \(H=4\)", ValueError),
    (lambda a: a.update(z=a["z"][:1]), r"`z` expected shape", ValueError),
    (lambda a: a.update(z=a["z"].to("meta")), r"`z` is on meta", ValueError),
    (lambda a: a.update(out=torch.empty(2, 4, 24, dtype=torch.float16)), r"`out` has dtype float16", TypeError),
    (lambda a: a.update(rand_seed=torch.tensor([1, 2])), r"`rand_seed` must hold one element", ValueError),
    (lambda a: a.update(state=a["state"].tolist()), r"`state` expected a torch.Tensor, got list", TypeError),
    (lambda a: a.update(x=None), r"`x` expected a torch.Tensor, got NoneType", TypeError),
    (lambda a: a.update(rand_seed=3), r"`rand_seed` expected a torch.Tensor or None, got int", TypeError),
    (lambda a: a.update(pad_slot_id=1.5), r"`pad_slot_id` expected an int, got float", TypeError),
    (lambda a: a.update(dt_softplus="no"), r"`dt_softplus` expected a bool, got str", TypeError),
    (lambda a: a.update(A_is_log=None), r"`A_is_log` expected a bool, got NoneType", TypeError),
    (lambda a: a.update(A=a["A"].int()), r"`A` expected dtype", TypeError),
    (lambda a: a.update(D=a["D"].long()), r"`D` expected dtype", TypeError),
    (lambda a: a.update(dt_bias=a["dt_bias"].int()), r"`dt_bias` expected dtype", TypeError),
    (lambda a: a.update(z=a["z"].half()), r"`z` has dtype float16 but `x` has float32", TypeError),
], ids=["x-rank", "x-rank5", "B-N", "C-G", "G-divides-H", "B-int", "int-x", "slot-range",
        "float-index", "dt_bias", "z-shape", "device", "out-dtype", "seed", "state-list", "x-None", "seed-int",
        "pad-float", "softplus-str", "A_is_log-None", "A-int", "D-int", "dt_bias-int", "z-dtype"])
def test_bad_input(mutate, match, exc):
    _bad(mutate, match, exc)


# ---- GPU: full shapes, CUDA graphs -------------------------------------------------------------

SHAPES = {"mamba2-2.7b": (80, 64, 128, 1), "nemotron-h": (128, 64, 128, 8)}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_full_shapes(shape, state_dtype, batch):
    H, P, N, G = SHAPES[shape]
    c = Case(f"{shape}", batch=batch, heads=H, headdim=P, dstate=N, groups=G, act=torch.bfloat16,
             state_dtype=state_dtype)
    state, args, kw = make_inputs(c, "cuda", seed=6)
    ref_state = state.clone()
    out = nan_like(args[0])
    selective_state_update(state, *args, **kw, out=out)
    y_ref = selective_state_update_ref(ref_state, *args, **kw)
    torch.testing.assert_close(out.float(), y_ref.float(), **tol(torch.bfloat16))
    torch.testing.assert_close(state.float(), ref_state.float(), **tol(torch.bfloat16, state_dtype))


@pytest.mark.gpu
def test_gpu_multi_token_full_shape():
    H, P, N, G = SHAPES["nemotron-h"]
    c = Case("nemotron-T6", batch=8, heads=H, headdim=P, dstate=N, groups=G, tokens=6, act=torch.bfloat16,
             slots="shuffled")
    state, args, kw = make_inputs(c, "cuda", seed=8)
    inter = torch.full((8, 6, H, P, N), float("nan"), device="cuda")
    inter_ref = torch.empty_like(inter)
    ref_state = state.clone()
    y = selective_state_update(state, *args, **kw, intermediate_states=inter)
    y_ref = selective_state_update_ref(ref_state, *args, **kw, intermediate_states=inter_ref)
    torch.testing.assert_close(y.float(), y_ref.float(), **tol(torch.bfloat16))
    torch.testing.assert_close(inter, inter_ref, **tol(torch.bfloat16))


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_seed_update():
    H, P, N, G = SHAPES["mamba2-2.7b"]
    c = Case("graph", batch=8, heads=H, headdim=P, dstate=N, groups=G, act=torch.bfloat16,
             state_dtype=torch.bfloat16, slots="shuffled")
    state, args, kw = make_inputs(c, "cuda", seed=9)
    seed = torch.tensor([1], dtype=torch.int64, device="cuda")
    out = torch.empty_like(args[0])
    eager_state = state.clone()
    selective_state_update(eager_state, *args, **kw, out=out, rand_seed=seed)
    eager_out = out.clone()
    graph_state = state.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        selective_state_update(graph_state.clone(), *args, **kw, out=out, rand_seed=seed)  # warm-up/compile
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        selective_state_update(graph_state, *args, **kw, out=out, rand_seed=seed)
    g.replay()
    assert torch.equal(out, eager_out) and torch.equal(graph_state, eager_state)
    seed.fill_(2)  # new random numbers without re-capture
    graph_state.copy_(state)
    g.replay()
    assert not torch.equal(graph_state, eager_state)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_drop_in_parity_with_mamba_ssm(shape):
    """Same positional call as mamba_ssm's selective_state_update, same answer."""
    from fastmamba.bench.peers import mamba_ssm_selective_state_update  # without mamba_ssm's __init__

    peer = mamba_ssm_selective_state_update()
    if peer.fn is None:
        pytest.skip(f"mamba_ssm's selective_state_update is not importable ({peer.reason}); parity not checked")
    H, P, N, G = SHAPES[shape]
    c = Case(shape, batch=16, heads=H, headdim=P, dstate=N, groups=G, act=torch.bfloat16, slots="shuffled")
    state, args, kw = make_inputs(c, "cuda", seed=10)
    theirs_state = state.clone()
    ours = selective_state_update(state, *args, kw["D"], kw["z"], kw["dt_bias"], True, kw["state_batch_indices"])
    theirs = peer.fn(theirs_state, *args, kw["D"], kw["z"], kw["dt_bias"], True, kw["state_batch_indices"])
    torch.testing.assert_close(ours.float(), theirs.float(), **tol(torch.bfloat16))
    torch.testing.assert_close(state, theirs_state, **tol(torch.bfloat16))


def test_pick_config_table(monkeypatch):
    """The launch table on a GPU (pick_config's interpreter branch switched off): latency-bound
    sizes get more warps, PDL changes the batch-1 tile and the fp32 batch-8 tile."""
    import fastmamba.ops.state_update.configs as ssu_configs

    monkeypatch.setattr(ssu_configs, "interpreter_enabled", lambda: False)

    def pick(programs, state_bytes, pdl):
        return ssu_configs.pick_config(programs_per_block=programs, headdim=64, dstate=128,
                                       state_bytes=state_bytes, pdl=pdl)

    assert pick(80, 4, False) == (8, 8) and pick(80, 2, False) == (16, 8)
    assert pick(80, 4, True) == (32, 8) and pick(80, 2, True) == (32, 8)
    assert pick(640, 4, False) == (8, 2) and pick(640, 4, True) == (16, 1)
    assert pick(640, 2, False) == (16, 1) and pick(640, 2, True) == (16, 1)
    assert pick(5120, 4, True) == (16, 1) and pick(20480, 2, False) == (16, 1)
    assert ssu_configs.pick_config(programs_per_block=640, headdim=32, dstate=256, state_bytes=4, pdl=True) == (16, 2)


def test_registered_op_declares_its_mutations(device):
    """Schema (state, out, intermediate_states mutated) and fake impl, as torch.compile uses them."""
    c = dataclasses.replace(BASE, tokens=2, slots="shuffled")
    state, (x, dt, A, Bm, Cm), kw = make_inputs(c, device, seed=13)
    H, P, N = c.heads, c.headdim, c.dstate
    out = torch.empty_like(x)
    inter = torch.empty(c.batch, 2, H, P, N, device=device)
    A_log = torch.log(-A[:, :1, :1]).expand(H, P, N)
    args = (state, x, dt, A_log, Bm, Cm, kw["D"], kw["z"], kw["dt_bias"], True, kw["state_batch_indices"], -1, out,
            None, inter, None, True)
    torch.library.opcheck(torch.ops.fastmamba.selective_state_update_.default, args,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("state_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_stochastic_rounding_of_per_position_states(state_dtype, device):
    """Multi-token mode with 16-bit ``intermediate_states`` (the speculative legacy path): each stored
    per-position state is one of the two neighbours of the fp32 one, a seed reproduces them, another
    seed rounds some differently, and without a seed they round to nearest."""
    g = torch.Generator().manual_seed(31)
    S, B, T, H, P, N = 3, 2, 3, 2, 16, 16
    state = (torch.randn(S, H, P, N, generator=g) * 0.5).to(device)
    x = torch.randn(B, T, H, P, generator=g).to(device)
    dt = (torch.rand(B, T, H, generator=g) * 0.1).to(device)
    A = (-torch.rand(H, generator=g) - 0.5).to(device)
    Bm, Cm = ((torch.randn(B, T, 1, N, generator=g) * 0.3).to(device) for _ in range(2))
    slots = torch.tensor([2, 0], dtype=torch.int32, device=device)

    def run(inter_dtype, seed):
        inter = torch.full((B, T, H, P, N), float("nan"), device=device, dtype=inter_dtype)
        st = state.to(state_dtype)
        rs = None if seed is None else torch.tensor([seed], dtype=torch.int64, device=device)
        selective_state_update(st, x, dt, A, Bm, Cm, state_batch_indices=slots, intermediate_states=inter, rand_seed=rs)
        return inter

    # the fp32 per-position states from the same 16-bit starting state
    exact = torch.full((B, T, H, P, N), float("nan"), device=device)
    selective_state_update(state.to(state_dtype), x, dt, A, Bm, Cm, state_batch_indices=slots,
                           intermediate_states=exact)
    down = exact.to(state_dtype)
    up = torch.nextafter(down, torch.where(exact > down.float(), torch.inf, -torch.inf).to(state_dtype))
    a, again, other, nearest = run(state_dtype, 5), run(state_dtype, 5), run(state_dtype, 6), run(state_dtype, None)
    if device.type == "cuda" or state_dtype == torch.float16:  # the interpreter's fp32 -> bf16 casts truncate
        assert torch.equal(nearest, down)  # (docs/interpreter_bf16.md)
    for got in (a, other, nearest):
        assert bool(((got.float() == down.float()) | (got.float() == up.float())).all())
    assert torch.equal(a, again) and not torch.equal(a, other) and not torch.equal(a, nearest)
