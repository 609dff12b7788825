"""The fused one-launch varlen scan (ssd_scan/fused/kernel.py) against the reference and the five-kernel path,
and the rule that picks it (issue 19 item 4)."""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops.ssd_scan import num_chunks, ssd_scan_varlen
from fastmamba.ops.ssd_scan.fused import api as fused
from fastmamba.ops.ssd_scan.fused import configs as fused_configs
from fastmamba.ops.ssd_scan import api as scan_api
from fastmamba.ops.ssd_scan import plan as scan_plan
from fastmamba.ops.ssd_scan.ref import ssd_scan_varlen_ref
from tests.helpers import nan_like, seeded, tol
from tests.ops.ssd_scan.test_ssd_scan import _error_baseline_check, _inputs

PAD = -1


def _case(device, lens, *, H=4, P=16, G=2, N=16, dtype=torch.float32, state_dtype=torch.float32, seed=0, S=None):
    T = sum(lens)
    inp = _inputs((T,), H, P, G, N, dtype, device, seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    S = S if S is not None else len(lens) + 3
    states = torch.randn(S, H, P, N, generator=seeded(seed + 1)).to(device=device, dtype=state_dtype)
    return inp, cu, states


def _close(got, want, dtype):
    torch.testing.assert_close(got.float(), want.float(), **tol(dtype))


# base row: three sequences of odd lengths (1 token, less than a chunk, two chunks and a bit), a pad
# slot, a shuffled pool larger than the batch, initial states on and off, G = 2, D, z and dt_bias
BASE = dict(lens=(1, 7, 19), slots=(4, PAD, 2, 0), flags=(1, 1, 0, 1), Q=8, D="H", z=True, A_is_log=False,
            dt_limit=(0.0, float("inf")), state_dtype=torch.float32)
ROWS = {
    "base": {},
    "no-D-no-z": dict(D=None, z=False),
    "A_is_log-per-channel-D-dt-limit": dict(A_is_log=True, D="HP", dt_limit=(0.05, 2.0)),
    "chunk16-no-pad": dict(Q=16, slots=(1, 3, 0, 5)),
    # a chunk of 24 tokens: blocks of 16 then 8 (the flat block loop's short last block of a chunk)
    "chunk24-short-blocks": dict(Q=24, lens=(1, 7, 53)),
    "P12-N10": dict(P=12, N=10),
    "fp16-state-pool": dict(state_dtype=torch.float16),
    "bf16-state-pool": dict(state_dtype=torch.bfloat16),
}


def _run_row(device, row, *, seed):
    c = {**BASE, **row}
    lens = (*c["lens"], 0) if len(c["slots"]) == 4 else c["lens"]  # an empty fourth sequence: slot untouched
    inp, cu, states = _case(device, lens, P=c.get("P", 16), N=c.get("N", 16), state_dtype=c["state_dtype"], seed=seed)
    H, P = inp["x"].shape[1:]
    D = {None: None, "H": inp["D"], "HP": torch.randn(H, P, generator=seeded(seed + 2)).to(device)}[c["D"]]
    A = torch.log(-inp["A"]) if c["A_is_log"] else inp["A"]  # A_log: the kernel takes -exp
    kw = dict(chunk_size=c["Q"], D=D, z=inp["z"] if c["z"] else None, dt_bias=inp["dt_bias"], dt_limit=c["dt_limit"],
              cache_indices=torch.tensor(c["slots"], dtype=torch.int32, device=device),
              has_initial_state=torch.tensor(c["flags"], dtype=torch.bool, device=device), pad_slot_id=PAD,
              A_is_log=c["A_is_log"])
    args = (inp["x"], inp["dt"], A, inp["B"], inp["C"])
    return c, lens, inp, cu, states, args, kw


@pytest.mark.parametrize("row", list(ROWS.values()), ids=list(ROWS))
def test_fused_matches_reference(device, row):
    c, lens, inp, cu, states, args, kw = _run_row(device, row, seed=11)
    n = num_chunks(cu, c["Q"])
    mine, theirs = states.clone(), states.clone()
    out = nan_like(inp["x"])
    chunks = torch.full((n, *states.shape[1:]), float("nan"), device=device)
    ref_chunks = chunks.clone()
    ssd_scan_varlen(*args, mine, cu, out=out, chunk_states_out=chunks, fused=True, **kw)
    ref = ssd_scan_varlen_ref(*args, theirs, cu, chunk_states_out=ref_chunks, **kw)
    _close(out, ref, torch.float32)  # the fused kernel keeps its state in fp32 whatever the pool's dtype
    pad = [b for b, s in enumerate(c["slots"][:len(lens)]) if s == PAD]
    for b in pad:
        rows = out[int(cu[b]):int(cu[b + 1])]
        assert torch.equal(rows, torch.zeros_like(rows))
    touched = [s for s, n_tok in zip(c["slots"], lens) if s != PAD and n_tok > 0]
    _close(mine[touched], theirs[touched], c["state_dtype"])
    others = [s for s in range(states.shape[0]) if s not in touched]
    assert torch.equal(mine[others], states[others])  # pad, the empty sequence's slot and the rest: bit for bit
    # every live chunk's state matches; the pad sequence's chunks are never written (NaN stays)
    assert torch.equal(torch.isnan(chunks), torch.isnan(ref_chunks))
    live = ~torch.isnan(ref_chunks)
    _close(chunks[live], ref_chunks[live], torch.float32)


@pytest.mark.parametrize("row", ["base", "A_is_log-per-channel-D-dt-limit", "bf16-state-pool"])
def test_fused_matches_the_chunked_path(device, row):
    c, lens, inp, cu, states, args, kw = _run_row(device, ROWS[row], seed=12)
    n = num_chunks(cu, c["Q"])
    got = {}
    for path in (True, False):
        st = states.clone()
        chunks = torch.full((n, *states.shape[1:]), float("nan"), device=device)
        out = ssd_scan_varlen(*args, st, cu, out=nan_like(inp["x"]), chunk_states_out=chunks, fused=path, **kw)
        got[path] = (out, st, chunks)
    # the chunked path keeps the states between its kernels in the pool's dtype: its tolerance
    _close(got[True][0], got[False][0], c["state_dtype"])
    _close(got[True][1], got[False][1], c["state_dtype"])
    assert torch.equal(torch.isnan(got[True][2]), torch.isnan(got[False][2]))
    live = ~torch.isnan(got[False][2])
    _close(got[True][2][live], got[False][2][live], c["state_dtype"])


def test_fused_fp16_activations(device):
    """16-bit activations: the tensor-core dots take fp16 operands (the state is cast for C S^T)."""
    lens = (5, 23)
    inp, cu, states = _case(device, lens, dtype=torch.float16, seed=13)
    kw = dict(chunk_size=16, D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"],
              has_initial_state=torch.tensor([1, 0], dtype=torch.bool, device=device))
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    mine, theirs = states.clone(), states.clone()
    out = ssd_scan_varlen(*args, mine, cu, out=nan_like(inp["x"]), fused=True, **kw)
    ref = ssd_scan_varlen_ref(*args, theirs, cu, out=torch.empty(out.shape, device=device), **kw)
    _error_baseline_check(out, ref, ref.to(torch.float16))
    _close(mine[:2], theirs[:2], torch.float16)


@pytest.mark.parametrize("name", ["x", "dt", "B", "C"])
def test_fused_nan_input_does_not_reach_earlier_positions(device, name):
    """A NaN at position t (3 and 21 of a 40-token sequence) leaves the outputs before t bit-identical
    and gives the reference's NaN pattern from t on."""
    lens = (40,)
    inp, cu, states = _case(device, lens, H=2, G=1, seed=14)
    args = dict(x=inp["x"], dt=inp["dt"], A=inp["A"], B=inp["B"], C=inp["C"])
    kw = dict(chunk_size=32, dt_bias=inp["dt_bias"], fused=True)
    clean = ssd_scan_varlen(*args.values(), states.clone(), cu, **kw)
    for t in (3, 21):
        bad = dict(args)
        bad[name] = args[name].clone()
        if name == "dt":
            bad[name][t, 0] = float("nan")
        else:
            bad[name][t, 0, 0] = float("nan")
        out = ssd_scan_varlen(*bad.values(), states.clone(), cu, **kw)
        ref = ssd_scan_varlen_ref(*bad.values(), states.clone(), cu, chunk_size=32, dt_bias=inp["dt_bias"])
        assert torch.equal(out[:t], clean[:t]), f"NaN in {name} at {t} reached earlier positions"
        assert torch.equal(torch.isnan(out), torch.isnan(ref)), f"NaN pattern differs from the reference ({name}, {t})"


def test_fused_out_of_range_slot_in_trusted_inputs_acts_as_pad(device):
    """Unchecked indices (trusted_inputs) outside [0, S) read and write nothing, output zeros."""
    from fastmamba.ops._common.host_values import trusted_inputs

    lens = (9, 14, 5)
    H, P, N = 2, 16, 16
    inp, cu, _ = _case(device, lens, H=H, P=P, G=1, N=N, seed=15)
    S = 4
    big = torch.randn(S + 4, H, P, N, generator=seeded(16)).to(device)
    before = big.clone()
    pool = big[2:2 + S]  # guard rows 0, 1 and S + 2, S + 3
    slots = torch.tensor([S + 1, 1, -3], dtype=torch.int32, device=device)
    kw = dict(chunk_size=16, dt_bias=inp["dt_bias"], has_initial_state=torch.ones(3, dtype=torch.bool, device=device))
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    out = nan_like(inp["x"])
    with trusted_inputs():
        ssd_scan_varlen(*args, pool, cu, cache_indices=slots, out=out, fused=True, **kw)
    assert torch.equal(big[[0, 1, S + 2, S + 3]], before[[0, 1, S + 2, S + 3]])
    want_pool = before[2:2 + S].clone()
    want = ssd_scan_varlen_ref(*args, want_pool, cu, cache_indices=torch.tensor([PAD, 1, PAD], dtype=torch.int32,
                                                                                device=device), **kw)
    _close(out, want, torch.float32)
    assert torch.equal(out[:9], torch.zeros_like(out[:9])) and torch.equal(out[23:], torch.zeros_like(out[23:]))
    _close(pool, want_pool, torch.float32)


# ---- stochastic rounding of the stored 16-bit states -------------------------------------------

def _seed(v, device):
    return torch.tensor([v], dtype=torch.int64, device=device)


@pytest.mark.parametrize("state_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fused_rand_seed_rounds_to_a_neighbour_and_reproduces(device, state_dtype):
    lens = (21, 9)
    inp, cu, states = _case(device, lens, H=2, G=1, state_dtype=state_dtype, seed=17)
    slots = torch.tensor([3, 0], dtype=torch.int32, device=device)
    kw = dict(chunk_size=16, D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], cache_indices=slots,
              has_initial_state=torch.ones(2, dtype=torch.bool, device=device), fused=True)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    exact_st = states.float()  # an fp32 pool stores the fp32 state that a 16-bit pool rounds
    exact_out = ssd_scan_varlen(*args, exact_st, cu, **kw)
    runs = {}
    for name, seed in (("rn", None), ("s1", 1), ("s1again", 1), ("s2", 2)):
        st = states.clone()
        out = ssd_scan_varlen(*args, st, cu, rand_seed=None if seed is None else _seed(seed, device), **kw)
        runs[name] = (out, st)
    others = [s for s in range(states.shape[0]) if s not in (3, 0)]
    down = exact_st.to(state_dtype)
    up = torch.nextafter(down, torch.where(exact_st > down.float(), torch.inf, -torch.inf).to(state_dtype))
    for name, (out, st) in runs.items():
        assert torch.equal(st[others], states[others]), name
        assert torch.equal(out, exact_out), name  # the fused path's outputs never depend on the pool's dtype
        assert bool(((st.float() == down.float()) | (st.float() == up.float()))[[3, 0]].all()), name
    assert torch.equal(runs["s1"][1], runs["s1again"][1])  # the same seed reproduces bit for bit
    assert not torch.equal(runs["s1"][1], runs["s2"][1])  # another seed rounds differently
    assert not torch.equal(runs["s1"][1][[3, 0]], down[[3, 0]])  # not round to nearest


def test_fused_rand_seed_draws_the_chunked_paths_random_numbers(device):
    """Both paths round the same fp32 state with the same stream (seed, element index): where their
    fp32 states agree to well within a unit of the 16-bit format, the stored states agree bit for bit
    except where the fp32 value sits within rounding noise of a rounding threshold."""
    lens = (12, 12)
    inp, cu, states = _case(device, lens, H=2, G=1, state_dtype=torch.bfloat16, seed=18)
    kw = dict(chunk_size=16, dt_bias=inp["dt_bias"], has_initial_state=torch.ones(2, dtype=torch.bool, device=device),
              rand_seed=_seed(7, device))
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    a, b = states.clone(), states.clone()
    ssd_scan_varlen(*args, a, cu, fused=True, **kw)
    ssd_scan_varlen(*args, b, cu, fused=False, **kw)
    same = (a == b).float().mean().item()
    assert same > 0.99, f"only {same:.4f} of the stored states agree"


# ---- the automatic choice ------------------------------------------------------------------------

@pytest.fixture
def launches(monkeypatch):
    """Counts launches of each path (the kernels still run)."""
    count = {"fused": 0, "chunked": 0}

    def wrap(fn, key):
        def counted(*a, **k):
            count[key] += 1
            return fn(*a, **k)
        return counted

    monkeypatch.setattr(fused, "ssd_scan_fused_launch", wrap(fused.ssd_scan_fused_launch, "fused"))
    monkeypatch.setattr(scan_api, "ssd_scan_launch", wrap(scan_api.ssd_scan_launch, "chunked"))
    monkeypatch.setattr(fused_configs, "MAX_FUSED_LEN", 10)
    return count


def _dispatch_case(device, lens):
    inp, cu, states = _case(device, lens, H=2, G=1, seed=19)
    return (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], states, cu), dict(chunk_size=16)


def test_automatic_choice_from_host_cu_seqlens(device, launches):
    """CPU tensors: the lengths come from the cu_seqlens values the host check reads. GPU tensors
    are checked on the device (no host read): without max_seqlen, T = 13 > 10 bounds the longest."""
    args, kw = _dispatch_case(device, (10, 3))  # longest 10 <= 10: fused
    ssd_scan_varlen(*args, **kw)
    if device.type == "cuda":
        assert launches == {"fused": 0, "chunked": 1}
        ssd_scan_varlen(*args, max_seqlen=10, **kw)
        assert launches == {"fused": 1, "chunked": 1}
        return
    assert launches == {"fused": 1, "chunked": 0}
    args, kw = _dispatch_case(device, (3, 11))  # longest 11 > 10: chunked
    ssd_scan_varlen(*args, **kw)
    assert launches == {"fused": 1, "chunked": 1}


def test_keyword_forces_either_path(device, launches):
    args, kw = _dispatch_case(device, (3, 11))
    ssd_scan_varlen(*args, fused=True, **kw)
    assert launches == {"fused": 1, "chunked": 0}
    args, kw = _dispatch_case(device, (3, 4))
    ssd_scan_varlen(*args, fused=False, **kw)
    assert launches == {"fused": 1, "chunked": 1}


def test_choice_without_a_host_read(device, launches, monkeypatch):
    """Inside trusted_inputs() the choice reads nothing on the device: max_seqlen when given, else
    the token count T bounds every sequence."""
    from fastmamba.ops._common.host_values import trusted_inputs

    def no_read(t):
        raise AssertionError("cu_seqlens read on the host inside trusted_inputs()")

    monkeypatch.setattr(scan_plan, "host_list", no_read)
    with trusted_inputs():
        args, kw = _dispatch_case(device, (3, 6))  # T = 9 <= 10
        ssd_scan_varlen(*args, **kw)
        assert launches == {"fused": 1, "chunked": 0}
        args, kw = _dispatch_case(device, (6, 6))  # T = 12 > 10, lengths unknown: chunked
        ssd_scan_varlen(*args, **kw)
        assert launches == {"fused": 1, "chunked": 1}
        ssd_scan_varlen(*args, max_seqlen=6, **kw)  # the caller knows better
        assert launches == {"fused": 2, "chunked": 1}


def test_choice_where_the_chunked_path_runs_the_hopper_kernels():
    """Above MAX_FUSED_LEN_HOPPER tokens the fused kernel yields to a chunked path that runs the Hopper
    kernels; the predicate (host time) is asked only there."""
    def never():
        raise AssertionError("asked for the Hopper kernels below MAX_FUSED_LEN_HOPPER or above MAX_FUSED_LEN")

    lo, hi = fused_configs.MAX_FUSED_LEN_HOPPER, fused_configs.MAX_FUSED_LEN
    assert fused.choose_fused(None, lo, never)
    assert not fused.choose_fused(None, hi + 1, never)
    assert fused.choose_fused(True, hi + 1, never) and not fused.choose_fused(False, 1, never)
    assert not fused.choose_fused(None, hi, lambda: True)
    assert fused.choose_fused(None, hi, lambda: False)


def test_dispatch_asks_whether_the_chunked_path_runs_the_hopper_kernels(device, launches, monkeypatch):
    """ssd_scan_varlen passes its tensors as the chunked launch sees them ([1, T, ...]) to the Hopper
    predicate; a yes sends a call the fused kernel would take to the chunked path."""
    seen = []

    def fake_ok(x, z, out, C, chunk_size):
        seen.append((tuple(x.shape), None if z is None else tuple(z.shape), tuple(out.shape), tuple(C.shape),
                     chunk_size))
        return True

    monkeypatch.setattr(scan_api, "hopper_chunk_output_ok", fake_ok)
    monkeypatch.setattr(fused_configs, "MAX_FUSED_LEN_HOPPER", 4)
    args, kw = _dispatch_case(device, (3, 4))  # longest 4 <= 4: fused, not asked
    ssd_scan_varlen(*args, max_seqlen=4, **kw)
    assert launches == {"fused": 1, "chunked": 0} and seen == []
    args, kw = _dispatch_case(device, (3, 6))  # 4 < 6 <= 10: asked, and the chunked path runs
    ssd_scan_varlen(*args, max_seqlen=6, **kw)
    assert launches == {"fused": 1, "chunked": 1}
    assert seen == [((1, 9, 2, 16), None, (1, 9, 2, 16), (1, 9, 1, 16), 16)]


def test_bad_max_seqlen_or_fused_raises_before_writing(device):
    args, kw = _dispatch_case(device, (3, 4))
    before = args[5].clone()
    with pytest.raises(ValueError, match="ssd_scan_varlen: `max_seqlen` expected a non-negative int or None, got -1"):
        ssd_scan_varlen(*args, max_seqlen=-1, **kw)
    with pytest.raises(TypeError, match="ssd_scan_varlen: `fused` expected None, True or False, got 'yes'"):
        ssd_scan_varlen(*args, fused="yes", **kw)
    with pytest.raises(ValueError, match=r"ssd_scan_varlen: `live_seqs` expected an int in \[0, B=2\] or None, got 3"):
        ssd_scan_varlen(*args, live_seqs=3, **kw)
    assert torch.equal(args[5], before)


def test_live_seqs_changes_tiles_only(device):
    """``live_seqs`` (how many sequences are not padding) sizes the fused tiles; the results are the
    same whatever it says, a padding sequence still gets zeros and its slot is untouched."""
    lens = (9, 5)
    inp, cu, _ = _case(device, lens, H=2, P=16, G=1, N=16, seed=21)
    pool = torch.randn(3, 2, 16, 16, generator=seeded(22)).to(device)
    slots = torch.tensor([1, PAD], dtype=torch.int32, device=device)
    kw = dict(chunk_size=16, dt_bias=inp["dt_bias"], cache_indices=slots, fused=True,
              has_initial_state=torch.ones(2, dtype=torch.bool, device=device))
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    outs, pools = [], []
    for live in (None, 1, 2):
        p, out = pool.clone(), nan_like(inp["x"])
        ssd_scan_varlen(*args, p, cu, out=out, live_seqs=live, **kw)
        outs.append(out)
        pools.append(p)
    want_pool = pool.clone()
    want = ssd_scan_varlen_ref(*args, want_pool, cu, **{k: v for k, v in kw.items() if k != "fused"})
    for out, p in zip(outs, pools):
        _close(out, want, torch.float32)
        _close(p, want_pool, torch.float32)
        assert torch.equal(out[9:], torch.zeros_like(out[9:]))
        assert torch.equal(p[[0, 2]], pool[[0, 2]])


# ---- GPU: the mamba2-2.7b layer shape -----------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("lens", [(16,), (130, 1, 64), (512,), (64,) * 16], ids=["1x16", "mixed", "1x512", "16x64"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_gpu_fused_2p7b_shape(device, lens, state_dtype):
    H, P, G, N = 80, 64, 1, 128
    T = sum(lens)
    inp = _inputs((T,), H, P, G, N, torch.bfloat16, device, seed=20)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    states = torch.randn(len(lens) + 2, H, P, N, generator=seeded(21)).to(device=device, dtype=state_dtype)
    flags = (torch.arange(len(lens), device=device) % 2 == 0)
    kw = dict(chunk_size=256, D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], has_initial_state=flags)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    mine, chunked = states.clone(), states.clone()
    # max_seqlen: the same tiles as the graph's call below (which cannot read cu_seqlens)
    out = ssd_scan_varlen(*args, mine, cu, fused=True, max_seqlen=max(lens), **kw)
    out_chunked = ssd_scan_varlen(*args, chunked, cu, fused=False, **kw)
    ref_states = states.float().clone()  # (.float() of an fp32 tensor is the tensor: the ref must not touch it)
    ref = ssd_scan_varlen_ref(*(t.float() for t in args), ref_states, cu, **{
        k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()})
    low = ssd_scan_varlen_ref(*args, states.clone(), cu, **kw)
    _error_baseline_check(out, ref, low)
    n = len(lens)
    err = (mine.float()[:n] - ref_states[:n]).norm() / ref_states[:n].norm()
    assert err < (2e-2 if state_dtype == torch.bfloat16 else 5e-3), f"final states: relative error {err:.2e}"
    rel = (out.float() - out_chunked.float()).norm() / out_chunked.float().norm()
    assert rel < 1e-2, f"fused vs chunked path: relative error {rel:.2e}"
    # inside a CUDA graph, replayed on new inputs
    g = torch.cuda.CUDAGraph()
    st_g = states.clone()
    ssd_scan_varlen(*args, st_g, cu, fused=True, max_seqlen=max(lens), **kw)  # warm-up (compile) outside the capture
    st_g.copy_(states)
    out_g = torch.empty_like(out)
    with torch.cuda.graph(g):
        ssd_scan_varlen(*args, st_g, cu, out=out_g, fused=True, max_seqlen=max(lens), **kw)
    st_g.copy_(states)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_g, out) and torch.equal(st_g, mine)


def test_fused_under_torch_compile_matches_eager(device):
    """torch.compile(fullgraph=True) traces the public op into the fused custom op, without host reads."""
    lens = (9, 14)
    inp, cu, states = _case(device, lens, H=2, G=1, state_dtype=torch.float16, seed=22)
    slots = torch.tensor([3, 0], dtype=torch.int32, device=device)
    flags = torch.tensor([1, 0], dtype=torch.bool, device=device)

    def call(x, dt, A, B, C, st, cu, slots, flags, D, dt_bias, seed):
        return ssd_scan_varlen(x, dt, A, B, C, st, cu, chunk_size=16, D=D, dt_bias=dt_bias, cache_indices=slots,
                               has_initial_state=flags, rand_seed=seed, fused=True, max_seqlen=14)

    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    rest = (cu, slots, flags, inp["D"], inp["dt_bias"], _seed(3, device))
    torch._dynamo.reset()
    try:
        compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
        mine = states.clone()
        out = compiled(*args, mine, *rest)
    finally:
        torch._dynamo.reset()
    eager = states.clone()
    want = call(*args, eager, *rest)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    assert torch.equal(mine, eager)  # the slot writes happen under compile too, with the same seed
