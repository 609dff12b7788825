"""The Hopper chunk-states kernel (ops/ssd_scan/hopper/states_kernel.py: chunk states and state passing
in one walk) against the two Triton kernels and the fp32 reference, through the public scans, with the
Hopper chunk-output kernel on in both runs (``FASTMAMBA_HOPPER_SCAN=1``) and the states kernel on or off
(``FASTMAMBA_HOPPER_STATES``). GPU-only (sm_90); its sm_90 compile is tested on the CPU in
test_hopper_states_compile.py.

The two paths do not give the same bits: the walk keeps the running state in fp32 registers and sums
each chunk 64 tokens per matmul, the Triton kernels sum 32 at a time and store each chunk's state in
the state dtype. So states are compared with an fp32 tolerance, outputs against the reference's error
baseline, and the Triton path's states where its chunk states are fp32."""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops.ssd_scan import mamba_chunk_scan_combined, ssd_scan_varlen
from fastmamba.ops.ssd_scan.ref import mamba_chunk_scan_combined_ref, ssd_scan_varlen_ref
from tests.helpers import seeded
from tests.ops.ssd_scan.hopper_cases import (
    LENS, NEEDS_SM90, PAD, SLOTS, floats, run_both, spy_launches, varlen_case,
)
from tests.ops.ssd_scan.test_ssd_scan import _error_baseline_check, _inputs

pytestmark = NEEDS_SM90


@pytest.fixture
def states_calls(monkeypatch):
    """Counts launches of the Hopper states kernel; ``use(flag)`` turns it on or off (the Hopper
    chunk-output kernel stays on)."""
    monkeypatch.setenv("FASTMAMBA_HOPPER_SCAN", "1")
    return spy_launches(monkeypatch, "chunk_states_sm90", "FASTMAMBA_HOPPER_STATES")


def _both(calls, fn):
    """fn() with the Hopper states kernel, then with the Triton ones."""
    return run_both(calls, fn, "Hopper states kernel")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# a partial last chunk, two rows (the second row's tokens follow the first's partial chunk), G > 1,
# N = 64 / 128, chunks of 64 / 128 / 256, fp16 and bf16, the chunk states in fp32 or bf16
@pytest.mark.parametrize("nb,L,H,G,N,Q,dtype,state_dtype", [
    (1, 2048, 4, 1, 128, 256, torch.bfloat16, torch.float32),
    (2, 1037, 4, 2, 64, 128, torch.float16, torch.float32),
    (1, 1100, 2, 1, 128, 64, torch.bfloat16, torch.bfloat16),
    (1, 1500, 8, 8, 128, 256, torch.bfloat16, torch.float32),
], ids=["2048-bf16", "2x1037-fp16", "1100-Q64-bf16-states", "1500-G8"])
def test_dense_matches_reference_and_triton_states(states_calls, nb, L, H, G, N, Q, dtype, state_dtype):
    device = torch.device("cuda")
    inp = _inputs((nb, L), H, 64, G, N, dtype, device, seed=L + Q, dt_scale=0.5)
    init = torch.randn(nb, H, 64, N, generator=seeded(4)).to(device)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], Q)
    kw = dict(D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], dt_softplus=True, initial_states=init,
              return_final_states=True)
    (out, final), (out_t, final_t) = _both(
        states_calls, lambda: mamba_chunk_scan_combined(*args, **kw, state_dtype=state_dtype))
    ref, ref_final = mamba_chunk_scan_combined_ref(*(floats(a) for a in args),
                                                   **{k: floats(v) for k, v in kw.items()})
    low, _ = mamba_chunk_scan_combined_ref(*args, **kw)
    _error_baseline_check(out, ref, low)
    assert _rel(final, ref_final) <= max(2 * _rel(final_t, ref_final), 1e-3)
    if state_dtype == torch.float32:  # same fp32 arithmetic in another order
        torch.testing.assert_close(final, final_t, rtol=1e-4, atol=1e-4)
    assert _rel(out, out_t) < 1e-2


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_varlen_slots_pads_and_empty_sequences(states_calls, state_dtype):
    device = torch.device("cuda")
    args, states, cu, kw = varlen_case(device, LENS, SLOTS, seed=21, state_dtype=state_dtype)

    def run():
        st = states.clone()
        return ssd_scan_varlen(*args, st, cu, **kw), st

    (out, st), (out_t, st_t) = _both(states_calls, run)
    ref_states = states.float().clone()
    ref = ssd_scan_varlen_ref(*(floats(a) for a in args), ref_states, cu, **{k: floats(v) for k, v in kw.items()})
    low = ssd_scan_varlen_ref(*args, states.clone(), cu, **kw)
    _error_baseline_check(out, ref, low)
    untouched = [s for s in range(states.shape[0]) if s not in SLOTS]
    assert torch.equal(st[untouched], states[untouched])  # nobody's slots and the pad's: not written
    written = [s for s in SLOTS if s != PAD]
    if state_dtype == torch.float32:
        torch.testing.assert_close(st[written], st_t[written], rtol=1e-4, atol=1e-4)
    else:  # the walk's fp32 state is rounded once, the Triton path's chunk states at every chunk
        assert _rel(st[written], ref_states[written]) <= max(2 * _rel(st_t[written], ref_states[written]), 1e-3)
    bounds = cu.tolist()
    for b, slot in enumerate(SLOTS):
        if slot == PAD:
            assert torch.all(out[bounds[b]:bounds[b + 1]] == 0)


def test_varlen_states_of_every_sequence(states_calls):
    """``return_varlen_states`` (the kernel's per-segment final states) through the dense entry with
    cu_seqlens, one of them empty."""
    device = torch.device("cuda")
    lens = (300, 0, 1, 1200, 555)
    T = sum(lens)
    inp = _inputs((1, T), 4, 64, 1, 128, torch.bfloat16, device, seed=61, dt_scale=0.5)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    seq_idx = torch.repeat_interleave(torch.arange(len(lens), device=device),
                                      torch.tensor(lens, device=device))[None].int()
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 256)
    kw = dict(D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], dt_softplus=True, seq_idx=seq_idx, cu_seqlens=cu,
              return_varlen_states=True)
    (out, vs), (out_t, vs_t) = _both(states_calls, lambda: mamba_chunk_scan_combined(*args, **kw))
    assert vs.shape == (len(lens), 4, 64, 128)
    torch.testing.assert_close(vs, vs_t, rtol=1e-4, atol=1e-4)
    assert torch.all(vs[1] == 0)  # the empty sequence: its (zero) initial state
    assert _rel(out, out_t) < 1e-2


def test_non_finite_values_of_the_next_sequence_stay_there(states_calls):
    """NaN and inf in the x and B of the token right after a sequence's last, partial block (the next
    sequence's first token): that sequence's state and the states of the sequences before are the clean
    run's, bit for bit; the flag sends the output to the Triton fallback, whose rows before the bad token
    are the clean Hopper run's."""
    device = torch.device("cuda")
    lens, slots = (700, 300, 500), (0, 1, 2)
    args, states, cu, kw = varlen_case(device, lens, slots, G=1, seed=71)
    states_calls.use(True)
    clean_states = states.clone()
    clean = ssd_scan_varlen(*args, clean_states, cu, **kw)
    x, dt, A, B, C = (a.clone() for a in args)
    x[700, 1] = float("nan")
    B[700, 0, :5] = float("inf")
    bad_states = states.clone()
    out = ssd_scan_varlen(x, dt, A, B, C, bad_states, cu, **kw)
    assert len(states_calls) == 2
    assert torch.equal(bad_states[0], clean_states[0])
    assert not torch.isfinite(bad_states[1]).all()
    assert torch.isfinite(out[:700]).all()
    assert _rel(out[:700], clean[:700]) < 1e-2
    assert torch.equal(bad_states[2], clean_states[2])


def test_nan_in_x_sets_the_flag_and_matches_the_triton_path(states_calls):
    """A NaN x in a live chunk: the walk's state turns NaN, the flag is set and the Triton chunk-output
    kernel redoes the stage; NaN lands where the all-Triton-states path puts it, nothing earlier."""
    device = torch.device("cuda")
    nb, L, H, G, N, Q = 1, 1100, 2, 1, 128, 256
    inp = _inputs((nb, L), H, 64, G, N, torch.bfloat16, device, seed=41, dt_scale=0.5)
    for t in (3, 511, 1090):
        x = inp["x"].clone()
        x[0, t, 1, 5] = float("nan")
        args = (x, inp["dt"], inp["A"], inp["B"], inp["C"], Q)
        kw = dict(D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], dt_softplus=True)
        out, out_t = _both(states_calls, lambda: mamba_chunk_scan_combined(*args, **kw))
        assert torch.equal(torch.isnan(out), torch.isnan(out_t))
        assert torch.isnan(out[0, t, 1, 5]) and torch.isfinite(out[0, :t]).all()
        torch.testing.assert_close(out[0, :, 0], out_t[0, :, 0], atol=2e-2, rtol=2e-2)


def test_repeated_runs_are_bit_identical(states_calls):
    device = torch.device("cuda")
    args, states, cu, kw = varlen_case(device, LENS, SLOTS, H=8, G=1, seed=31)
    states_calls.use(True)
    runs = []
    for _ in range(5):
        st = states.clone()
        runs.append((ssd_scan_varlen(*args, st, cu, **kw), st))
    assert len(states_calls) == 5
    for o, st in runs[1:]:
        assert torch.equal(o, runs[0][0]) and torch.equal(st, runs[0][1])


@pytest.mark.parametrize("co_dtype", [torch.float32, torch.bfloat16])
def test_state_after_every_chunk(states_calls, co_dtype):
    """``chunk_states_out`` (the prefix cache's snapshots) from the walk: every live chunk's row is the
    Triton kernels' (fp32 rows to fp32 accuracy; bf16 rows are that state rounded once), rows of the
    padding sequence and past the last chunk stay as they were; outputs and slots as without it."""
    device = torch.device("cuda")
    args, states, cu, kw = varlen_case(device, LENS, SLOTS, H=4, G=1, seed=91)
    n_chunks = sum(-(-n // 256) for n in LENS)
    poison = torch.full((n_chunks + 2, 4, 64, 128), float("nan"), device=device, dtype=co_dtype)

    def call():
        co, st = poison.clone(), states.clone()
        return ssd_scan_varlen(*args, st, cu, **kw, chunk_states_out=co), st, co

    (out, st, co), (out_t, st_t, co_t) = _both(states_calls, call)
    pad_rows = torch.zeros(n_chunks + 2, dtype=torch.bool)
    first = 0
    for n, slot in zip(LENS, SLOTS):
        if slot == PAD:
            pad_rows[first:first + -(-n // 256)] = True
        first += -(-n // 256)
    pad_rows[n_chunks:] = True
    assert torch.isnan(co[pad_rows]).all() and torch.isnan(co_t[pad_rows]).all()
    live = ~pad_rows
    assert torch.isfinite(co[live]).all()
    assert _rel(co[live], co_t[live]) < (1e-5 if co_dtype == torch.float32 else 8e-3)
    # with the chunk states out or not, the same outputs and slots
    states_calls.use(True)
    plain_st = states.clone()
    plain = ssd_scan_varlen(*args, plain_st, cu, **kw)
    assert torch.equal(out, plain) and torch.equal(st, plain_st)
    torch.testing.assert_close(st_t, st, atol=1e-4, rtol=1e-4)


def test_calls_it_does_not_cover_take_the_triton_kernels(states_calls):
    """Stochastic rounding of 16-bit cache states, and a ``chunk_states_out`` that is not contiguous,
    are the Triton kernels' only."""
    device = torch.device("cuda")
    args, states, cu, kw = varlen_case(device, (700, 500), (0, 1), seed=81)  # >= hopper.MIN_TOKENS
    states_calls.use(True)
    n_chunks = 3 + 2
    chunk_out = torch.zeros(4, 64, 128, n_chunks, device=device).permute(3, 0, 1, 2)
    ssd_scan_varlen(*args, states.clone(), cu, **kw, chunk_states_out=chunk_out)
    ssd_scan_varlen(*args, states.clone().bfloat16(), cu, **kw,
                    rand_seed=torch.tensor([7], dtype=torch.int64, device=device))
    assert len(states_calls) == 0
    ssd_scan_varlen(*args, states.clone(), cu, **kw, chunk_states_out=chunk_out.contiguous())
    assert len(states_calls) == 1
