"""Chunked SSD scan (dense mamba_ssm call and packed varlen serving call) against the sequential
fp32 recurrence, plus consistency with itself and with single-token selective_state_update.

CPU runs the Triton kernels in the interpreter with 16-wide tiles, so chunk sizes of 16-32 and
sequence lengths around 40 cover partial chunks, several chunks and partial tiles. GPU-marked
tests run full Mamba-2 shapes in bf16 and compare against an error baseline.
"""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops import selective_state_update
from fastmamba.ops.ssd_scan import chunk_offsets, mamba_chunk_scan_combined, num_chunks, ssd_scan_varlen
from fastmamba.ops.ssd_scan.ref import mamba_chunk_scan_combined_ref, ssd_scan_varlen_ref
from tests.helpers import nan_like, raises_now_or_at_next_call, seeded, tol

PAD = -1


def _inputs(lead, H, P, G, N, dtype, device, seed, *, dt_scale=1.0):
    g = seeded(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    return dict(
        x=rnd(*lead, H, P).to(dtype),
        dt=rnd(*lead, H, scale=dt_scale),
        A=-(torch.rand(H, generator=g) * 2 + 0.2).to(device),
        B=rnd(*lead, G, N, scale=0.5).to(dtype),
        C=rnd(*lead, G, N, scale=0.5).to(dtype),
        D=rnd(H),
        z=rnd(*lead, H, P).to(dtype),
        dt_bias=rnd(H, scale=0.3),
    )


def _close(got, want, dtype):
    torch.testing.assert_close(got.float(), want.float(), **tol(dtype))


@pytest.mark.parametrize(
    "nb,L,H,P,G,N,Q",
    [
        (1, 1, 2, 8, 1, 8, 16),  # a single token
        (2, 37, 4, 8, 2, 8, 16),  # partial last chunk, G=2
        (1, 48, 2, 16, 1, 16, 16),  # exact multiple of the chunk
        (3, 20, 2, 12, 1, 10, 32),  # P and N not powers of 2, one partial chunk
    ],
)
@pytest.mark.parametrize("options", ["full", "bare"])
def test_dense_matches_reference(device, nb, L, H, P, G, N, Q, options):
    inp = _inputs((nb, L), H, P, G, N, torch.float32, device, seed=L + H)
    if options == "bare":  # no D, z, dt_bias, initial state; no softplus
        inp["dt"] = inp["dt"].abs() * 0.5
        kw = dict(dt_softplus=False)
        init = None
    else:
        kw = dict(D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], dt_softplus=True)
        init = torch.randn(nb, H, P, N, generator=seeded(1)).to(device)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], Q)
    out, final = mamba_chunk_scan_combined(*args, initial_states=init, return_final_states=True, **kw)
    ref_out, ref_final = mamba_chunk_scan_combined_ref(*args, initial_states=init, return_final_states=True, **kw)
    _close(out, ref_out, torch.float32)
    assert final.dtype == torch.float32
    _close(final, ref_final, torch.float32)


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_dense_steep_and_gentle_decays(device):
    """Heads whose decay spans hundreds of e-folds inside one row block, heads near the fp32 range
    over a block and gentle ones, in one launch: the chunk scan's rank-1 split of the decay for the
    blocks before a row block (both factors <= 1) and the exact per-element decay on its own block
    must stay finite and exact. Under the interpreter, numpy's overflow warnings are errors: rows
    past a chunk's end must not compute exp of large positive numbers either."""
    nb, L, H, P, G, N, Q = 2, 37, 4, 8, 2, 8, 16
    inp = _inputs((nb, L), H, P, G, N, torch.float32, device, seed=74)
    inp["A"] = torch.tensor([-0.3, -30.0, -4.0, -0.05], device=device)
    inp["dt"] = inp["dt"].abs() * 0.2 + 0.6  # dt' in about [0.6, 1.4] without softplus
    init = torch.randn(nb, H, P, N, generator=seeded(75)).to(device)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], Q)
    kw = dict(D=inp["D"], z=inp["z"], initial_states=init, return_final_states=True)
    out, final = mamba_chunk_scan_combined(*args, **kw)
    ref_out, ref_final = mamba_chunk_scan_combined_ref(*args, **kw)
    assert torch.isfinite(out).all()
    _close(out, ref_out, torch.float32)
    _close(final, ref_final, torch.float32)


def test_dense_strided_inputs_and_per_channel_D_and_dt_limit(device):
    nb, L, H, P, G, N = 2, 25, 4, 8, 1, 8
    inp = _inputs((nb, L), H, P, G, N, torch.float32, device, seed=5)
    # x and z as slices of one wider buffer (as a fused in_proj produces), B/C with a head gap
    xz = torch.randn(nb, L, H, 2 * P, generator=seeded(6)).to(device)
    x, z = xz[..., :P], xz[..., P:]
    BC = torch.randn(nb, L, 2 * G + 1, N, generator=seeded(7)).to(device)
    B, C = BC[:, :, 0:G], BC[:, :, G + 1:2 * G + 1]
    dt = torch.randn(nb, H, L, generator=seeded(8)).to(device).transpose(1, 2)  # token stride != H
    D = torch.randn(H, P, generator=seeded(9)).to(device)
    kw = dict(D=D, z=z, dt_bias=inp["dt_bias"], dt_softplus=True, dt_limit=(0.05, 0.8))
    out = mamba_chunk_scan_combined(x, dt, inp["A"], B, C, 16, **kw)
    ref = mamba_chunk_scan_combined_ref(x, dt, inp["A"], B, C, 16, **kw)
    _close(out, ref, torch.float32)


def test_dense_seq_idx_and_varlen_states(device):
    nb, L, H, P, G, N = 2, 30, 2, 8, 1, 8
    inp = _inputs((nb, L), H, P, G, N, torch.float32, device, seed=11)
    seq_idx = torch.zeros(nb, L, dtype=torch.int32)
    seq_idx[0, 7:] = 1
    seq_idx[0, 20:] = 2
    seq_idx[1, 1:] = 5  # a one-token first sequence
    seq_idx = seq_idx.to(device)
    init = torch.randn(nb, H, P, N, generator=seeded(12)).to(device)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 16)
    kw = dict(D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], initial_states=init, seq_idx=seq_idx, dt_softplus=True,
              return_final_states=True, return_varlen_states=True)
    out, final, varlen = mamba_chunk_scan_combined(*args, **kw)
    r_out, r_final, r_varlen = mamba_chunk_scan_combined_ref(*args, **kw)
    _close(out, r_out, torch.float32)
    _close(final, r_final, torch.float32)
    assert varlen.shape == (5, H, P, N)
    _close(varlen, r_varlen, torch.float32)


def test_dense_cu_seqlens_batch1(device):
    L, H, P, G, N = 40, 2, 8, 1, 8
    inp = _inputs((1, L), H, P, G, N, torch.float32, device, seed=13)
    cu = torch.tensor([0, 3, 3, 21, 40], dtype=torch.int32, device=device)  # includes an empty sequence
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 16)
    kw = dict(D=inp["D"], dt_bias=inp["dt_bias"], cu_seqlens=cu, dt_softplus=True, return_varlen_states=True)
    out, varlen = mamba_chunk_scan_combined(*args, **kw)
    r_out, r_varlen = mamba_chunk_scan_combined_ref(*args, **kw)
    _close(out, r_out, torch.float32)
    _close(varlen, r_varlen, torch.float32)


def _varlen_case(device, lens, *, H=4, P=8, G=2, N=8, dtype=torch.float32, state_dtype=torch.float32, seed=0):
    T = sum(lens)
    inp = _inputs((T,), H, P, G, N, dtype, device, seed)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
    S = len(lens) + 3
    states = torch.randn(S, H, P, N, generator=seeded(seed + 1)).to(device=device, dtype=state_dtype)
    return inp, cu, states


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_varlen_slots_flags_and_pad(device, state_dtype):
    lens = [37, 1, 0, 16, 5, 20]
    inp, cu, states = _varlen_case(device, lens, state_dtype=state_dtype, seed=21)
    nseq = len(lens)
    slots = torch.tensor([4, 0, 7, PAD, 2, 8], dtype=torch.int32, device=device)
    flags = torch.tensor([1, 0, 1, 1, 1, 0], dtype=torch.bool, device=device)
    Q = 16
    n_chunks = num_chunks(cu, Q)
    assert n_chunks == 3 + 1 + 0 + 1 + 1 + 2
    kw = dict(chunk_size=Q, D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], cache_indices=slots,
              has_initial_state=flags, pad_slot_id=PAD)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    mine, theirs = states.clone(), states.clone()
    out = nan_like(inp["x"])
    chunks = torch.full((n_chunks, *states.shape[1:]), float("nan"), device=device)
    ssd_scan_varlen(*args, mine, cu, out=out, chunk_states_out=chunks, **kw)
    ref_chunks = torch.full_like(chunks, float("nan"))
    ref = ssd_scan_varlen_ref(*args, theirs, cu, chunk_states_out=ref_chunks, **kw)
    # the states passed between chunks are kept in the cache dtype, so outputs carry its rounding
    _close(out, ref, state_dtype)
    pad_rows = slice(int(cu[3]), int(cu[4]))
    assert torch.equal(out[pad_rows], torch.zeros_like(out[pad_rows]))
    # touched slots: the sequences' (state tolerance: the cache dtype); untouched: bit for bit
    touched = [4, 0, 2, 8]
    _close(mine[touched], theirs[touched], state_dtype)
    others = [s for s in range(states.shape[0]) if s not in touched]
    assert torch.equal(mine[others], states[others])  # includes slot 7 (empty sequence) and pad
    offsets = chunk_offsets(cu, Q).tolist()
    assert offsets == [0, 3, 4, 4, 5, 6]
    live = [i for b in range(nseq) if int(slots[b]) != PAD for i in range(offsets[b], offsets[b] + -(-lens[b] // Q))]
    _close(chunks[live], ref_chunks[live], state_dtype)
    assert nseq == 6


def test_varlen_bf16_activations(device):
    if device.type == "cpu":
        pytest.skip("the interpreter's fp32 -> bf16 casts truncate (docs/interpreter_bf16.md), beyond this "
                    "error baseline; the interpreter runs test_dense_bf16_at_the_issue_shape instead")
    lens = [100, 3, 300]
    inp, cu, states = _varlen_case(device, lens, H=8, P=64, G=1, N=128, dtype=torch.bfloat16, seed=3)
    flags = torch.tensor([1, 0, 1], dtype=torch.bool, device=device)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    kw = dict(chunk_size=64, D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], has_initial_state=flags)
    mine, theirs = states.clone(), states.clone()
    out = ssd_scan_varlen(*args, mine, cu, **kw)
    # fp32 reference from the same bf16 inputs; the baseline is the reference's own output in bf16
    ref = ssd_scan_varlen_ref(*args, theirs, cu, out=torch.empty(out.shape, dtype=torch.float32, device=device), **kw)
    _error_baseline_check(out, ref, ref.to(torch.bfloat16))
    rel = (mine.float() - theirs.float()).norm() / theirs.float().norm()
    assert rel < 5e-3, f"final states: relative error {rel:.2e}"


def test_consistency_split_scan_and_token_steps(device):
    """Scanning L tokens == scanning k, then L-k from the returned state == L single-token steps."""
    L, k, H, P, G, N, Q = 29, 11, 4, 8, 2, 8, 16
    inp, _, _ = _varlen_case(device, [L], H=H, P=P, G=G, N=N, seed=31)
    init = torch.randn(1, H, P, N, generator=seeded(32)).to(device)
    x, dt, A, B, C, D, z, dt_bias = (inp[n] for n in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias"))
    kw = dict(D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
    full = init.clone()
    ssd_scan_varlen(x, dt, A, B, C, full, torch.tensor([0, L], device=device), chunk_size=Q,
                    has_initial_state=torch.ones(1, dtype=torch.bool, device=device), **kw)
    out_full = ssd_scan_varlen(x, dt, A, B, C, init.clone(), torch.tensor([0, L], device=device), chunk_size=Q,
                               has_initial_state=torch.ones(1, dtype=torch.bool, device=device), **kw)
    # two calls: first k tokens, then the rest from the stored state
    split = init.clone()
    one = torch.ones(1, dtype=torch.bool, device=device)
    kw1 = dict(D=D, dt_bias=dt_bias, dt_softplus=True)
    out1 = ssd_scan_varlen(x[:k], dt[:k], A, B[:k], C[:k], split, torch.tensor([0, k], device=device), chunk_size=Q,
                           has_initial_state=one, z=z[:k], **kw1)
    out2 = ssd_scan_varlen(x[k:], dt[k:], A, B[k:], C[k:], split, torch.tensor([0, L - k], device=device),
                           chunk_size=Q, has_initial_state=one, z=z[k:], **kw1)
    _close(torch.cat([out1, out2]), out_full, torch.float32)
    _close(split, full, torch.float32)
    # L single-token decode steps
    state = init.clone()
    steps = []
    A_exp = A[:, None, None].expand(H, P, N)
    for t in range(L):
        steps.append(selective_state_update(
            state, x[t:t + 1], dt[t:t + 1, :, None].expand(1, H, P), A_exp, B[t:t + 1], C[t:t + 1],
            D=D[:, None].expand(H, P), z=z[t:t + 1], dt_bias=dt_bias[:, None].expand(H, P), dt_softplus=True,
        ))
    _close(torch.cat(steps), out_full, torch.float32)
    _close(state, full, torch.float32)


def test_bad_inputs_raise_before_writing(device):
    lens = [5, 7]
    inp, cu, states = _varlen_case(device, lens, seed=41)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    before = states.clone()
    T = sum(lens)
    values = [  # index values: on a GPU checked on the device and raised at the next call
        (dict(cu_seqlens=torch.tensor([0, 7, 5], device=device)), "never decrease"),
        (dict(cu_seqlens=torch.tensor([0, 5, 11], device=device)), f"token count {T}"),
        (dict(cu_seqlens=torch.tensor([1, 5, 12], device=device)), "start at 0"),
        (dict(cache_indices=torch.tensor([0, 99], dtype=torch.int32, device=device)), "values must lie in"),
    ]
    shapes = [
        (dict(has_initial_state=torch.ones(3, dtype=torch.bool, device=device)), "has_initial_state"),
        (dict(out=torch.empty(T, 4, 9, device=device)), "`out` expected shape"),
    ]
    for k, (extra, message) in enumerate(values + shapes):
        kw = dict(cu_seqlens=cu)
        kw.update(extra)
        cu_arg = kw.pop("cu_seqlens")

        def call():
            ssd_scan_varlen(*args, states, cu_arg, chunk_size=16, **kw)

        if k < len(values):
            raises_now_or_at_next_call(device, call, message)
        else:
            with pytest.raises(ValueError, match=message):
                call()
        assert torch.equal(states, before)
    with pytest.raises(ValueError, match="multiple of the groups"):
        ssd_scan_varlen(inp["x"], inp["dt"], inp["A"], inp["B"][:, :1].expand(T, 3, 8), inp["C"][:, :1].expand(T, 3, 8),
                        states, cu)
    with pytest.raises(ValueError, match="`dt` expected shape"):
        ssd_scan_varlen(inp["x"], inp["dt"][:, :2], inp["A"], inp["B"], inp["C"], states, cu)
    with pytest.raises(ValueError, match="`ssm_states` expected shape"):
        ssd_scan_varlen(*args, states[:, :, :4], cu)
    with pytest.raises(ValueError, match="must not alias"):
        ssd_scan_varlen(*args, states, cu, out=inp["x"])
    with pytest.raises(ValueError, match="needs batch 1"):
        x2 = inp["x"].view(2, 6, 4, 8)
        mamba_chunk_scan_combined(x2, inp["dt"].view(2, 6, 4), inp["A"], inp["B"].view(2, 6, 2, 8),
                                  inp["C"].view(2, 6, 2, 8), 16, cu_seqlens=cu)
    assert torch.equal(states, before)


def _error_baseline_check(out, ref_fp32, ref_lowp):
    """Kernel error vs the fp32 reference <= 2x the error of the reference run in the input dtype."""
    err = (out.float() - ref_fp32).norm() / ref_fp32.norm()
    base = (ref_lowp.float() - ref_fp32).norm() / ref_fp32.norm()
    assert err <= 2 * base + 1e-6, f"relative error {err:.3e} vs baseline {base:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(80, 64, 1, 128), (128, 64, 8, 128)], ids=["mamba2-2.7b", "nemotron-h"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_gpu_varlen_full_shape_error_baseline(device, shape, state_dtype):
    H, P, G, N = shape
    lens = [700, 1, 256, 1091]
    T = sum(lens)
    inp = _inputs((T,), H, P, G, N, torch.bfloat16, device, seed=51, dt_scale=0.5)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    states = torch.randn(6, H, P, N, generator=seeded(52)).to(device=device, dtype=state_dtype)
    flags = torch.tensor([1, 0, 1, 0], dtype=torch.bool, device=device)
    slots = torch.tensor([5, 0, 3, 1], dtype=torch.int32, device=device)
    kw = dict(chunk_size=256, D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], cache_indices=slots, has_initial_state=flags)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    mine = states.clone()
    out = ssd_scan_varlen(*args, mine, cu, **kw)
    ref_states = states.float()
    ref = ssd_scan_varlen_ref(*(t.float() if t.is_floating_point() else t for t in args), ref_states, cu, **{
        k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()})
    # the error baseline: the same recurrence with bf16 inputs rounded back after every token's output
    low = ssd_scan_varlen_ref(*args, states.clone(), cu, **kw)
    _error_baseline_check(out, ref, low)
    assert torch.isfinite(mine).all()
    err_state = (mine.float()[slots.long()] - ref_states[slots.long()]).norm() / ref_states[slots.long()].norm()
    assert err_state < (2e-2 if state_dtype == torch.bfloat16 else 5e-3)


@pytest.mark.gpu
def test_gpu_dense_2p7b_matches_reference(device):
    H, P, G, N, L = 80, 64, 1, 128, 2048
    inp = _inputs((1, L), H, P, G, N, torch.bfloat16, device, seed=61, dt_scale=0.5)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 256)
    kw = dict(D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], dt_softplus=True, return_final_states=True)
    out, final = mamba_chunk_scan_combined(*args, **kw)
    ref_args = tuple(t.float() if isinstance(t, torch.Tensor) else t for t in args)
    ref_kw = {k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    ref, ref_final = mamba_chunk_scan_combined_ref(*ref_args, **ref_kw)
    low, _ = mamba_chunk_scan_combined_ref(*args, **kw)
    _error_baseline_check(out, ref, low)
    assert (final - ref_final).norm() / ref_final.norm() < 5e-3


def test_chunk_count_bound_covers_every_length_mix_and_is_exact_for_one_sequence():
    """plan.chunk_count_bound (the grids' size where cu_seqlens may not be read, e.g. under graph
    capture) is never below the exact count, and equals it for one sequence (a bound one chunk too
    high cost the graphed 2.7b scan ~6 us at 2048 tokens: a second wave of chunk-state programs)."""
    from fastmamba.ops.ssd_scan.plan import _count_chunks, chunk_count_bound

    g = torch.Generator().manual_seed(5)
    for Q in (16, 64, 256):
        for T in (1, 15, 16, 17, 2048, 2049):
            assert chunk_count_bound(T, 1, Q) == _count_chunks([0, T], Q)
        for _ in range(200):
            n = int(torch.randint(1, 12, (1,), generator=g))
            lens = torch.randint(0, 3 * Q, (n,), generator=g).tolist()
            cu = [0]
            for length in lens:
                cu.append(cu[-1] + length)
            assert _count_chunks(cu, Q) <= chunk_count_bound(cu[-1], n, Q) < _count_chunks(cu, Q) + n


@pytest.mark.parametrize("sms", [8, 132])
def test_chunk_state_register_cap_only_where_a_fifth_program_saves_a_wave(sms):
    """launch.state_regs_cap: the chunk-state launch is capped for grids of more than 4 and at most 5
    programs per SM (mamba2-2.7b at L=2048: 640 programs on 132 SMs), where a fifth program per SM
    turns 1.2 waves into one; nowhere else (one wave already, or several waves either way)."""
    from fastmamba.ops.ssd_scan.chunked.launch import STATE_REGS_CAP, state_regs_cap

    for programs in (4 * sms + 1, 5 * sms):
        assert state_regs_cap(programs, sms) == STATE_REGS_CAP
    for programs in (1, 4 * sms, 5 * sms + 1, 20 * sms):
        assert state_regs_cap(programs, sms) == 0
    assert state_regs_cap(8 * 80, 132) == STATE_REGS_CAP


def test_config_token_step_must_divide_row_block(device, monkeypatch):
    """A forced chunk-scan config whose token step does not divide its row block (the off-diagonal
    loop would run into the diagonal block and double-count it) is refused before any launch."""
    from fastmamba.ops._common.dispatch import interpreter_enabled
    from fastmamba.ops.ssd_scan.chunked import configs

    base = configs.pick_config(4, 8, 8, 4, interpreter=interpreter_enabled())
    monkeypatch.setattr(configs._forced, "value", base._replace(block_k=2 * base.block_m))
    inp = _inputs((1, 20), 2, 8, 1, 8, torch.float32, device, seed=76)
    with pytest.raises(ValueError, match="must divide block_m"):
        mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 16)


def test_chunk_scan_token_step_smaller_than_row_block(device, monkeypatch):
    """A token step (block_k) below the row block (block_m), as the sweep may pick: the block's
    own rows take several diagonal steps (the default config takes one). Chunks of 64 with 32-row
    blocks in 16-token steps, a length that ends inside a block, D per (head, p), z."""
    from fastmamba.ops._common.dispatch import interpreter_enabled
    from fastmamba.ops.ssd_scan.chunked import configs

    base = configs.pick_config(4, 8, 8, 4, interpreter=interpreter_enabled())
    monkeypatch.setattr(configs._forced, "value", base._replace(block_m=32, block_k=16))
    nb, L, H, P, G, N = 2, 83, 4, 8, 2, 8
    inp = _inputs((nb, L), H, P, G, N, torch.float32, device, seed=77)
    D = torch.randn(H, P, generator=seeded(78)).to(device)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 64)
    kw = dict(D=D, z=inp["z"], dt_bias=inp["dt_bias"], dt_softplus=True, return_final_states=True)
    out, final = mamba_chunk_scan_combined(*args, **kw)
    ref_out, ref_final = mamba_chunk_scan_combined_ref(*args, **kw)
    _close(out, ref_out, torch.float32)
    _close(final, ref_final, torch.float32)


# ---- A_is_log: A holds A_log, the kernel takes -exp(A) in fp32 where it loads it ----------------

def test_dense_A_is_log_matches_reference_and_explicit_A(device):
    nb, L, H, P, G, N = 2, 37, 2, 16, 1, 16
    inp = _inputs((nb, L), H, P, G, N, torch.float32, device, seed=81)
    A_log = torch.randn(H, generator=seeded(82)).to(device)
    init = torch.randn(nb, H, P, N, generator=seeded(83)).to(device)
    kw = dict(D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], dt_softplus=True, initial_states=init,
              return_final_states=True)
    args = (inp["x"], inp["dt"], A_log, inp["B"], inp["C"], 16)
    out, final = mamba_chunk_scan_combined(*args, A_is_log=True, **kw)
    ref_out, ref_final = mamba_chunk_scan_combined_ref(*args, A_is_log=True, **kw)
    _close(out, ref_out, torch.float32)
    _close(final, ref_final, torch.float32)
    # the same as passing A = -exp(A_log) explicitly (and different from treating A_log as A)
    exp_args = (inp["x"], inp["dt"], -torch.exp(A_log), inp["B"], inp["C"], 16)
    want, want_final = mamba_chunk_scan_combined_ref(*exp_args, **kw)
    _close(out, want, torch.float32)
    _close(final, want_final, torch.float32)
    wrong, _ = mamba_chunk_scan_combined_ref(*args, **kw)
    assert not torch.allclose(wrong, want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
def test_varlen_A_is_log_matches_reference(device, state_dtype):
    lens = [21, 0, 9]
    inp, cu, states = _varlen_case(device, lens, H=2, P=16, G=1, N=16, state_dtype=state_dtype, seed=84)
    A_log = torch.randn(2, generator=seeded(85)).to(device)
    slots = torch.tensor([4, 1, 0], dtype=torch.int32, device=device)
    flags = torch.tensor([1, 0, 0], dtype=torch.bool, device=device)
    kw = dict(chunk_size=16, D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], cache_indices=slots,
              has_initial_state=flags)
    mine, theirs, explicit = states.clone(), states.clone(), states.clone()
    out = ssd_scan_varlen(inp["x"], inp["dt"], A_log, inp["B"], inp["C"], mine, cu, A_is_log=True, **kw)
    ref = ssd_scan_varlen_ref(inp["x"], inp["dt"], A_log, inp["B"], inp["C"], theirs, cu, A_is_log=True, **kw)
    want = ssd_scan_varlen_ref(inp["x"], inp["dt"], -torch.exp(A_log), inp["B"], inp["C"], explicit, cu, **kw)
    _close(out, ref, state_dtype)
    _close(mine, theirs, state_dtype)
    torch.testing.assert_close(ref, want, atol=0, rtol=0)
    assert torch.equal(theirs, explicit)


# ---- rand_seed: stochastic rounding of the 16-bit final states stored into the cache slots ------

def _seed(v, device):
    return torch.tensor([v], dtype=torch.int64, device=device)


def _neighbour(rn: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The representable value next to ``rn`` (a 16-bit tensor) on the side of ``v`` (fp32); rn
    itself where rn == v. Stepping the integer bits moves one unit in the last place."""
    bits = rn.view(torch.int16)
    step = torch.where(rn.float().abs() < v.abs(), 1, -1).to(torch.int16)
    other = (bits + step).view(rn.dtype)
    return torch.where(rn.float() == v, rn, other)


@pytest.mark.parametrize("state_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_varlen_rand_seed_changes_and_reproduces_the_stored_state(device, state_dtype):
    lens = [21, 9]
    inp, cu, states = _varlen_case(device, lens, H=2, P=16, G=1, N=16, state_dtype=state_dtype, seed=91)
    slots = torch.tensor([3, 0], dtype=torch.int32, device=device)
    flags = torch.tensor([1, 1], dtype=torch.bool, device=device)
    kw = dict(chunk_size=16, D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], cache_indices=slots,
              has_initial_state=flags)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    runs = {}
    for name, seed in (("rn", None), ("s1", 1), ("s1again", 1), ("s2", 2)):
        st = states.clone()
        out = ssd_scan_varlen(*args, st, cu, rand_seed=None if seed is None else _seed(seed, device), **kw)
        runs[name] = (out, st)
    # with a seed the chunk states between the kernels stay fp32 (the one rounding is the final,
    # stochastic one), as with an fp32 cache: its final states are the values being rounded
    exact_st = states.float()
    exact_out = ssd_scan_varlen(*args, exact_st, cu, **kw)
    rn_out, rn = runs["rn"]
    others = [s for s in range(states.shape[0]) if s not in (3, 0)]
    for name, (out, st) in runs.items():
        assert torch.equal(st[others], states[others]), name
        if name == "rn":
            continue
        assert torch.equal(out, exact_out), name  # outputs never depend on the seed
        # each stored value is one of the two representable neighbours of the fp32 value
        down = exact_st.to(state_dtype)
        up = torch.nextafter(down, torch.where(exact_st > down.float(), torch.inf, -torch.inf).to(state_dtype))
        assert bool(((st.float() == down.float()) | (st.float() == up.float()))[[3, 0]].all()), name
    _close(rn_out, exact_out, state_dtype)
    assert torch.equal(runs["s1"][1], runs["s1again"][1])  # the same seed reproduces bit for bit
    assert not torch.equal(runs["s1"][1], runs["s2"][1])  # another seed rounds differently
    assert not torch.equal(runs["s1"][1][[3, 0]], exact_st[[3, 0]].to(state_dtype))  # not round to nearest
    ref = ssd_scan_varlen_ref(*args, states.clone(), cu, **kw)
    _close(rn_out, ref, state_dtype)


@pytest.mark.parametrize("state_dtype", [torch.float16, torch.bfloat16])
def test_varlen_rand_seed_rounds_to_a_neighbour_without_bias(device, state_dtype):
    """x = 0, so each stored state is init * exp(sum of a) computed in fp32, which an fp32 cache
    stores exactly: eight sequences with the same inputs and initial state in eight slots give
    eight independent roundings of the same fp32 values per call, 32 over four seeds."""
    nseq, H, P, N, L = 8, 1, 16, 16, 12
    lens = [L] * nseq
    inp, cu, _ = _varlen_case(device, lens, H=H, P=P, G=1, N=N, seed=93)
    x = torch.zeros_like(inp["x"])
    dt = (torch.randn(L, H, generator=seeded(94)) * 0.3 - 4.0).repeat(nseq, 1).to(device)
    init = torch.randn(H, P, N, generator=seeded(95)).to(device)
    slots = torch.arange(nseq, dtype=torch.int32, device=device).flip(0)
    flags = torch.ones(nseq, dtype=torch.bool, device=device)
    kw = dict(chunk_size=16, cache_indices=slots, has_initial_state=flags, dt_softplus=True)
    args = (x, dt, inp["A"], inp["B"], inp["C"])
    init16 = init.to(state_dtype)
    exact = init16.float().expand(nseq, H, P, N).clone()
    ssd_scan_varlen(*args, exact, cu, **kw)
    v = exact[0]
    assert torch.equal(exact, v.expand_as(exact))  # the same fp32 value in every slot
    seeded_fp32 = init16.float().expand(nseq, H, P, N).clone()
    ssd_scan_varlen(*args, seeded_fp32, cu, rand_seed=_seed(5, device), **kw)
    assert torch.equal(seeded_fp32, exact)  # an fp32 cache ignores the seed
    rn = v.to(state_dtype)
    other = _neighbour(rn, v)
    samples = []
    for seed in range(4):
        st = init16.expand(nseq, H, P, N).clone()
        ssd_scan_varlen(*args, st, cu, rand_seed=_seed(1000 + seed, device), **kw)
        assert ((st == rn) | (st == other)).all(), f"seed {seed}: a value that is neither neighbour"
        samples.append(st)
    samples = torch.cat(samples).float()  # [32, H, P, N]
    gap = (other.float() - rn.float()).abs()
    live = gap > 0
    err = (samples.mean(0) - v)[live] / gap[live]  # per element, in units of the gap
    rn_err = (rn.float() - v)[live] / gap[live]
    # 32 Bernoulli draws: |mean error| <= 0.07 of a unit; rounding to nearest gives ~0.25
    assert err.abs().mean() < 0.12, f"mean |bias| {err.abs().mean():.3f} units (nearest: {rn_err.abs().mean():.3f})"
    assert abs(float(err.mean())) < 0.03
    assert rn_err.abs().mean() > 0.15


def test_varlen_rand_seed_bad_input(device):
    inp, cu, states = _varlen_case(device, [5, 7], H=2, P=16, G=1, N=16, state_dtype=torch.float16, seed=96)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], states, cu)
    before = states.clone()
    with pytest.raises(TypeError, match="ssd_scan_varlen: `rand_seed` expected dtype in \\(int64\\), got int32"):
        ssd_scan_varlen(*args, rand_seed=torch.tensor([1], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="ssd_scan_varlen: `rand_seed` must hold one element"):
        ssd_scan_varlen(*args, rand_seed=torch.tensor([1, 2], device=device))
    assert torch.equal(states, before)


# ---- no write outside the state pool ------------------------------------------------------------

@pytest.fixture(params=["kernel", "reference"])
def scan_path(request, monkeypatch):
    """'kernel': the Triton kernels (interpreter on CPU); 'reference': the public op falling back to
    ssd_scan_varlen_ref, as on a CPU without the interpreter."""
    if request.param == "reference":
        from fastmamba.ops.ssd_scan import api

        monkeypatch.setattr(api, "use_triton", lambda t: False)
    return request.param


def test_varlen_index_changed_behind_version_counter_raises(device, scan_path):
    lens = [9, 14]
    inp, cu, states = _varlen_case(device, lens, H=2, P=16, G=1, N=16, seed=101)
    S = states.shape[0]
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], states, cu)
    idx = torch.tensor([2, 0], dtype=torch.int32, device=device)
    kw = dict(chunk_size=16, cache_indices=idx, has_initial_state=torch.ones(2, dtype=torch.bool, device=device))
    ssd_scan_varlen(*args, **kw)  # checked and run once
    after_first = states.clone()
    idx.data[0] = S + 3  # behind the version counter: a cached check would miss it
    raises_now_or_at_next_call(device, lambda: ssd_scan_varlen(*args, **kw),
                               rf"ssd_scan_varlen: `cache_indices` values must lie in \[0, {S}\).*{S + 3}")
    assert torch.equal(states, after_first)


def test_varlen_out_of_range_index_in_trusted_inputs_stays_in_the_pool(device, scan_path):
    """Inside trusted_inputs() the op does not read the indices on the host: the kernels treat
    an index outside [0, S) as the pad slot (no read, no write, zero output); the reference
    validates before writing and raises. Either way the rows around the pool stay bit-identical."""
    from fastmamba.ops._common.host_values import trusted_inputs

    lens = [9, 14, 5, 7]
    H, P, N = 2, 16, 16
    inp, cu, _ = _varlen_case(device, lens, H=H, P=P, G=1, N=N, seed=102)
    S = 5
    big = torch.randn(S + 4, H, P, N, generator=seeded(103)).to(device)
    before = big.clone()
    pool = big[2:2 + S]  # guard rows 0, 1 and S + 2, S + 3
    slots = torch.tensor([S + 1, 1, -3, S], dtype=torch.int32, device=device)
    flags = torch.ones(4, dtype=torch.bool, device=device)
    kw = dict(chunk_size=16, D=inp["D"], dt_bias=inp["dt_bias"], has_initial_state=flags)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    out = nan_like(inp["x"])
    if scan_path == "reference":
        with trusted_inputs(), pytest.raises(ValueError, match=r"values must lie in \[0, 5\)"):
            ssd_scan_varlen(*args, pool, cu, cache_indices=slots, out=out, **kw)
        assert torch.equal(big, before)
        return
    with trusted_inputs():
        ssd_scan_varlen(*args, pool, cu, cache_indices=slots, out=out, **kw)
    guard = [0, 1, S + 2, S + 3]
    assert torch.equal(big[guard], before[guard])
    # what the same call does with the out-of-range sequences marked as padding
    want_pool = before[2:2 + S].clone()
    padded = torch.tensor([PAD, 1, PAD, PAD], dtype=torch.int32, device=device)
    want = ssd_scan_varlen_ref(*args, want_pool, cu, cache_indices=padded, **kw)
    _close(out, want, torch.float32)
    assert torch.equal(out[:9], torch.zeros_like(out[:9]))
    _close(pool, want_pool, torch.float32)
    untouched = [0, 2, 3, 4]
    assert torch.equal(pool[untouched], before[2:2 + S][untouched])


def test_varlen_reference_validates_indices_before_writing(device):
    inp, cu, states = _varlen_case(device, [6, 4], H=2, P=16, G=1, N=16, seed=104)
    before = states.clone()
    for bad in (states.shape[0], -2):
        slots = torch.tensor([0, bad], dtype=torch.int32, device=device)  # the valid one comes first
        with pytest.raises(ValueError, match="ssd_scan_varlen_ref: `cache_indices`"):
            ssd_scan_varlen_ref(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], states, cu, chunk_size=16,
                                cache_indices=slots)
        assert torch.equal(states, before)


# ---- bf16 under the interpreter (issue 20 item 6) and non-finite inputs -------------------------

def test_dense_bf16_at_the_issue_shape(device):
    """The shape where the interpreter's bf16 scan was off by 1e10 (its tl.dot multiplied bf16 bit
    patterns; docs/interpreter_bf16.md). On a GPU: the error baseline. Under the interpreter, whose
    fp32 -> bf16 casts truncate, within four bf16 units in the last place (relative norm)."""
    nb, L, H, P, G, N, Q = 1, 130, 4, 64, 1, 64, 64
    inp = _inputs((nb, L), H, P, G, N, torch.bfloat16, device, seed=7)
    init = torch.randn(nb, H, P, N, generator=seeded(8)).to(device)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], Q)
    kw = dict(D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], dt_softplus=True, initial_states=init,
              return_final_states=True)
    out, final = mamba_chunk_scan_combined(*args, **kw)
    ref, ref_final = mamba_chunk_scan_combined_ref(*args, **kw)  # fp32 inside, from the bf16 inputs
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    rel_final = ((final - ref_final).norm() / ref_final.norm()).item()
    if device.type == "cuda":
        # the output is bf16 either way (its reference rounded to bf16 is the reference): a bf16 tolerance
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 1e-2, f"relative error {err:.3e}"
        assert rel_final < 5e-3
    else:
        rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel < 4 * 2**-8, f"relative error {rel:.2e}"  # was ~1e10; measured 8e-3
        assert rel_final < 1e-2, f"final state: relative error {rel_final:.2e}"  # measured 3.4e-3


@pytest.mark.parametrize("name", ["x", "dt", "B", "C"])
def test_dense_nan_input_does_not_reach_earlier_positions(device, name):
    """A NaN at position t of a chunk (here t = 3 and t = 21 of a 32-token chunk) leaves every
    output before t bit-identical; the reference's outputs from t on are NaN and so are ours."""
    nb, L, H, P, G, N, Q = 1, 40, 2, 16, 1, 16, 32
    inp = _inputs((nb, L), H, P, G, N, torch.float32, device, seed=111)
    args = dict(x=inp["x"], dt=inp["dt"], A=inp["A"], B=inp["B"], C=inp["C"])
    kw = dict(dt_bias=inp["dt_bias"], dt_softplus=True)  # no D, z: the NaN travels through the scan only
    clean = mamba_chunk_scan_combined(*args.values(), Q, **kw)
    for t in (3, 21):
        bad = dict(args)
        bad[name] = args[name].clone()
        if name == "dt":
            bad[name][0, t, 0] = float("nan")
        else:
            bad[name][0, t, 0, 0] = float("nan")
        out = mamba_chunk_scan_combined(*bad.values(), Q, **kw)
        ref = mamba_chunk_scan_combined_ref(*bad.values(), Q, **kw)
        assert torch.equal(out[:, :t], clean[:, :t]), f"NaN in {name} at {t} reached earlier positions"
        assert torch.equal(torch.isnan(out), torch.isnan(ref)), f"NaN pattern differs from the reference ({name}, {t})"


# ---- bad input (issue 20 item 9) --------------------------------------------------------------

def test_varlen_bad_dtypes_raise_before_writing(device):
    inp, cu, states = _varlen_case(device, [5, 7], H=2, P=16, G=1, N=16, seed=121)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], states, cu)
    before = states.clone()
    chunks = torch.zeros(2, 2, 16, 16, dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match=r"ssd_scan_varlen: `chunk_states_out` expected dtype in .*got int32"):
        ssd_scan_varlen(*args, chunk_size=16, chunk_states_out=chunks)
    assert torch.equal(chunks, torch.zeros_like(chunks))
    with pytest.raises(TypeError, match=r"ssd_scan_varlen: `has_initial_state` expected dtype in .*got float32"):
        ssd_scan_varlen(*args, has_initial_state=torch.ones(2, device=device))
    with pytest.raises(TypeError, match=r"ssd_scan_varlen: `D` expected dtype in .*got int64"):
        ssd_scan_varlen(*args, D=torch.ones(2, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match=r"ssd_scan_varlen: `dt_bias` expected dtype in .*got int32"):
        ssd_scan_varlen(*args, dt_bias=torch.ones(2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="ssd_scan_varlen: `chunk_size` expected a positive int, got True"):
        ssd_scan_varlen(*args, chunk_size=True)
    assert torch.equal(states, before)


def test_dense_bad_initial_states_dtype(device):
    inp = _inputs((1, 9), 2, 16, 1, 16, torch.float32, device, seed=122)
    init = torch.zeros(1, 2, 16, 16, dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match=r"mamba_chunk_scan_combined: `initial_states` expected dtype in .*got int32"):
        mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 16, initial_states=init)


def test_dense_zero_length_matches_reference(device):
    """L = 0 on the kernel path: an empty output, and the final (and per-sequence) states are the
    initial states, as the reference says."""
    nb, H, P, G, N = 2, 2, 16, 1, 16
    inp = _inputs((nb, 0), H, P, G, N, torch.float32, device, seed=123)
    init = torch.randn(nb, H, P, N, generator=seeded(124)).to(device)
    seq_idx = torch.zeros(nb, 0, dtype=torch.int32, device=device)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 16)
    kw = dict(D=inp["D"], initial_states=init, seq_idx=seq_idx, return_final_states=True, return_varlen_states=True)
    out, final, varlen = mamba_chunk_scan_combined(*args, **kw)
    r_out, r_final, r_varlen = mamba_chunk_scan_combined_ref(*args, **kw)
    assert out.shape == (nb, 0, H, P) and out.dtype == inp["x"].dtype
    assert torch.equal(final, r_final) and torch.equal(final, init)
    assert torch.equal(varlen, r_varlen)
    plain = mamba_chunk_scan_combined(*args)
    assert plain.shape == (nb, 0, H, P)


def test_fp32_B_C_next_to_16bit_x_are_accepted(device):
    """As mamba_ssm's callers pass them: fp32 B and C with bf16 x give exactly the call with B and C
    converted to bf16 first (the scan's dots take x's dtype); dense and varlen."""
    import torch.nn.functional as F

    g = seeded(21)
    L, H, P, G, N = 20, 2, 16, 1, 16
    x = torch.randn(1, L, H, P, generator=g).to(device, torch.bfloat16)
    dt = F.softplus(torch.randn(1, L, H, generator=g) - 3).to(device)
    A = (-torch.rand(H, generator=g) - 0.5).to(device)
    B, C = ((torch.randn(1, L, G, N, generator=g) * 0.3).to(device) for _ in range(2))
    got = mamba_chunk_scan_combined(x, dt, A, B, C, 16)
    want = mamba_chunk_scan_combined(x, dt, A, B.bfloat16(), C.bfloat16(), 16)
    assert torch.equal(got, want)
    cu = torch.tensor([0, 7, L], dtype=torch.int32, device=device)
    states = torch.zeros(3, H, P, N, device=device)
    s1, s2 = states.clone(), states.clone()
    got = ssd_scan_varlen(x[0], dt[0], A, B[0], C[0], s1, cu, chunk_size=16)
    want = ssd_scan_varlen(x[0], dt[0], A, B[0].bfloat16(), C[0].bfloat16(), s2, cu, chunk_size=16)
    assert torch.equal(got, want) and torch.equal(s1, s2)
