"""The Hopper chunk-output kernel (ops/ssd_scan/hopper/chunk_output_kernel.py) against the reference and the portable
Triton kernel, through the public scans. GPU-only: it needs sm_90 (TMA, wgmma, warp specialization);
its sm_90 compile is tested on the CPU in test_hopper_kernel_compile.py.

Each case runs the scan twice, the Hopper kernel on and off (``FASTMAMBA_HOPPER_SCAN``), and checks
that the Hopper kernel ran (a spy on its launcher) or did not, where the shape is not one it covers."""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops.ssd_scan import mamba_chunk_scan_combined, ssd_scan_varlen
from fastmamba.ops.ssd_scan.hopper.chunk_output import EAGER_MIN_TOKENS, MIN_TOKENS, hopper_kernels, long_prefill_kernels
from fastmamba.ops.ssd_scan.ref import mamba_chunk_scan_combined_ref, ssd_scan_varlen_ref
from tests.helpers import nan_like, seeded
from tests.ops.ssd_scan.hopper_cases import (
    LENS, NEEDS_SM90, PAD, SLOTS, floats, run_both, spy_launches, varlen_case,
)
from tests.ops.ssd_scan.test_ssd_scan import _error_baseline_check, _inputs

pytestmark = NEEDS_SM90


@pytest.fixture
def hopper_calls(monkeypatch):
    """Counts launches of the Hopper kernel; ``use(flag)`` turns it on or off. The Hopper states kernel
    stays off, so that both runs take their states from the same (Triton) kernels: test_hopper_states.py
    tests that one."""
    monkeypatch.setenv("FASTMAMBA_HOPPER_STATES", "0")
    return spy_launches(monkeypatch, "chunk_output_sm90", "FASTMAMBA_HOPPER_SCAN")


def _both(hopper_calls, fn):
    """fn() with the Hopper kernel, then with the Triton kernel."""
    return run_both(hopper_calls, fn, "Hopper kernel")


# dense batches: a partial last chunk, two rows, G > 1, N = 64 / 128, chunks of 64 / 128 / 256,
# fp16 and bf16, D per head or per channel, with and without z
@pytest.mark.parametrize("nb,L,H,G,N,Q,dtype,d_per_p,with_z", [
    (1, 2048, 4, 1, 128, 256, torch.bfloat16, False, True),
    (2, 1037, 4, 2, 64, 128, torch.float16, True, False),
    (1, 1100, 2, 1, 128, 64, torch.bfloat16, True, True),
], ids=["2048-bf16", "2x1037-fp16-noz", "1100-Q64"])
def test_dense_matches_reference_and_triton_path(hopper_calls, nb, L, H, G, N, Q, dtype, d_per_p, with_z):
    device = torch.device("cuda")
    inp = _inputs((nb, L), H, 64, G, N, dtype, device, seed=L + Q, dt_scale=0.5)
    D = torch.randn(H, 64, generator=seeded(3)).to(device) if d_per_p else inp["D"]
    init = torch.randn(nb, H, 64, N, generator=seeded(4)).to(device)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], Q)
    kw = dict(D=D, z=inp["z"] if with_z else None, dt_bias=inp["dt_bias"], dt_softplus=True, initial_states=init,
              return_final_states=True)
    (out, final), (out_t, final_t) = _both(hopper_calls, lambda: mamba_chunk_scan_combined(*args, **kw))
    ref, _ = mamba_chunk_scan_combined_ref(*(floats(a) for a in args), **{k: floats(v) for k, v in kw.items()})
    low, _ = mamba_chunk_scan_combined_ref(*args, **kw)
    _error_baseline_check(out, ref, low)
    _error_baseline_check(out_t, ref, low)
    assert torch.equal(final, final_t)  # the states come from the same kernels either way
    assert ((out.float() - out_t.float()).norm() / out_t.float().norm()).item() < 1e-2
    assert not torch.equal(out, out_t)  # the Hopper kernel's output stands (no spurious fallback)


def test_varlen_pads_slots_and_deferred_norm(hopper_calls):
    device = torch.device("cuda")
    args, states, cu, kw = varlen_case(device, LENS, SLOTS, seed=21)
    T, H, P = args[0].shape
    nw = (1 + 0.5 * torch.randn(H * P, generator=seeded(22))).to(device, torch.bfloat16)

    def run(norm: bool):
        st = states.clone()
        sumsq = nan_like(torch.empty(T, H * P // 16, device=device)) if norm else None
        out = ssd_scan_varlen(*args, st, cu, **kw, out=nan_like(torch.empty_like(args[0])),
                              **(dict(norm_weight=nw, norm_sumsq=sumsq) if norm else {}))
        return out, st, sumsq

    (out, st, _), (out_t, st_t, _) = _both(hopper_calls, lambda: run(False))
    ref_states = states.clone()
    ref = ssd_scan_varlen_ref(*(floats(a) for a in args), ref_states, cu, **{k: floats(v) for k, v in kw.items()})
    low = ssd_scan_varlen_ref(*args, states.clone(), cu, **kw)
    _error_baseline_check(out, ref, low)
    assert torch.equal(st, st_t)
    bounds = cu.tolist()
    for b, slot in enumerate(SLOTS):  # a pad sequence's tokens: zeros, as the Triton kernel writes
        if slot == PAD:
            assert torch.all(out[bounds[b]:bounds[b + 1]] == 0)
    (got, _, sumsq), (got_t, _, sumsq_t) = _both(hopper_calls, lambda: run(True))
    y = out.float().reshape(T, H * P)
    torch.testing.assert_close(got.float().reshape(T, H * P), y * nw.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(sumsq, y.square().reshape(T, -1, 16).sum(-1), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(sumsq, sumsq_t, atol=5e-2, rtol=2e-2)


def test_repeated_runs_are_bit_identical(hopper_calls):
    """The partial row blocks leave through masked register stores next to the TMA stores of full
    blocks: five runs, same bits (a race between the partitions would show here)."""
    device = torch.device("cuda")
    args, states, cu, kw = varlen_case(device, LENS, SLOTS, H=8, G=1, seed=31)
    hopper_calls.use(True)
    outs = [ssd_scan_varlen(*args, states.clone(), cu, **kw) for _ in range(5)]
    assert len(hopper_calls) == 5
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def test_nan_in_x_falls_back_to_the_triton_kernel(hopper_calls):
    """A NaN x at token t (first rows of a block, mid block, last row of a chunk) in a diagonal tile
    sets the chunk-state kernel's flag and the Triton kernel redoes the stage: the output is the Triton
    path's bit for bit (NaN from t on in that column, nothing before t)."""
    device = torch.device("cuda")
    nb, L, H, G, N, Q = 1, 1100, 2, 1, 128, 256
    inp = _inputs((nb, L), H, 64, G, N, torch.bfloat16, device, seed=41, dt_scale=0.5)
    args = dict(x=inp["x"], dt=inp["dt"], A=inp["A"], B=inp["B"], C=inp["C"])
    kw = dict(D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], dt_softplus=True)
    clean, clean_t = _both(hopper_calls, lambda: mamba_chunk_scan_combined(*args.values(), Q, **kw))
    assert not torch.equal(clean, clean_t)  # finite input: the Hopper kernel's output stands
    for t in (3, 321, 511, 1090):
        bad = dict(args, x=args["x"].clone())
        bad["x"][0, t, 1, 5] = float("nan")
        out, out_t = _both(hopper_calls, lambda: mamba_chunk_scan_combined(*bad.values(), Q, **kw))
        torch.testing.assert_close(out, out_t, atol=0, rtol=0, equal_nan=True)
        assert torch.equal(out[:, :t], clean_t[:, :t]), f"NaN at {t} reached earlier positions"
        assert torch.isnan(out[0, t, 1, 5]) and torch.isfinite(out[0, :, 0]).all()


@pytest.mark.parametrize("case", ["P32", "fp32", "short", "N256", "Q32"])
def test_shapes_it_does_not_cover_take_the_triton_kernel(hopper_calls, case):
    device = torch.device("cuda")
    P, N, L, Q, dtype = 64, 128, MIN_TOKENS, 256, torch.bfloat16
    if case == "P32":
        P = 32
    elif case == "fp32":
        dtype = torch.float32
    elif case == "short":
        L = MIN_TOKENS - 1
    elif case == "N256":
        N = 256
    else:
        Q = 32
    inp = _inputs((1, L), 2, P, 1, N, dtype, device, seed=51)
    hopper_calls.use(True)
    out = mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], Q, D=inp["D"], z=inp["z"],
                                    dt_bias=inp["dt_bias"], dt_softplus=True)
    assert torch.isfinite(out).all()
    assert len(hopper_calls) == 0


def test_auto_mode_takes_it_inside_hopper_kernels_only(hopper_calls, monkeypatch):
    """FASTMAMBA_HOPPER_SCAN=auto (the default): direct eager calls, however long, and captures outside
    ``hopper_kernels()`` run the Triton kernel (the Hopper kernel's descriptors cost more host time than
    one call saves; an unwarmed first launch would load a module inside the capture); inside the block
    (``long_prefill_kernels`` from EAGER_MIN_TOKENS on), eager calls, a warm-up and then a capture take it."""
    device = torch.device("cuda")
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()

    def call(L, seed):
        inp = _inputs((1, L), 4, 64, 1, 128, torch.bfloat16, device, seed=seed, dt_scale=0.5)
        args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 256)
        return lambda: mamba_chunk_scan_combined(*args, D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"],
                                                 dt_softplus=True)

    short, long = call(2048, 61), call(EAGER_MIN_TOKENS, 62)
    monkeypatch.setenv("FASTMAMBA_HOPPER_SCAN", "0")
    want_short, want_long = short(), long()  # the Triton path, warm at both shapes
    monkeypatch.setenv("FASTMAMBA_HOPPER_SCAN", "auto")
    assert rel(short(), want_short) == 0 and rel(long(), want_long) == 0 and len(hopper_calls) == 0
    with long_prefill_kernels(EAGER_MIN_TOKENS - 1):
        assert rel(long(), want_long) == 0 and len(hopper_calls) == 0
    with long_prefill_kernels(EAGER_MIN_TOKENS):
        assert rel(long(), want_long) < 1e-2 and len(hopper_calls) == 1
    # a capture outside the block: the Triton kernel
    out = torch.empty_like(want_long)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(long())
    assert len(hopper_calls) == 1
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert rel(out, want_long) == 0
    # inside the block: warm-up and capture take it at 2048 tokens
    out = torch.empty_like(want_short)
    graph = torch.cuda.CUDAGraph()
    with hopper_kernels():
        out.copy_(short())  # the warm-up
        torch.cuda.synchronize()
        assert len(hopper_calls) == 2
        with torch.cuda.graph(graph):
            out.copy_(short())
    assert len(hopper_calls) == 3
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert rel(out, want_short) < 1e-2


def test_long_model_prefill_takes_it(hopper_calls, monkeypatch):
    """A model's eager prefill of EAGER_MIN_TOKENS tokens takes the Hopper kernel in every layer (its
    logits match the Triton path's); a shorter one does not."""
    from fastmamba.models import Mamba2LM, random_init
    from fastmamba.models.config import Mamba2Config

    # 8 heads of 64: in_proj's rows (2 * 512 + 2 * 128 + 8 values) stay 16-byte aligned, as TMA needs
    cfg = Mamba2Config(d_model=256, n_layer=2, vocab_size=256, d_state=128, headdim=64, ngroups=1, chunk_size=256)
    model = random_init(Mamba2LM(cfg, device="cuda", dtype=torch.bfloat16), seed=3).eval()
    ids = torch.randint(0, 256, (1, EAGER_MIN_TOKENS), generator=torch.Generator().manual_seed(4)).cuda()

    def prefill(n):
        cache = model.new_cache(1)
        return model.prefill(ids[:, :n], cache, torch.zeros(1, dtype=torch.int32, device="cuda"))

    monkeypatch.setenv("FASTMAMBA_HOPPER_SCAN", "0")
    want = prefill(EAGER_MIN_TOKENS)
    monkeypatch.setenv("FASTMAMBA_HOPPER_SCAN", "auto")
    prefill(EAGER_MIN_TOKENS // 2)
    assert len(hopper_calls) == 0
    got = prefill(EAGER_MIN_TOKENS)
    assert len(hopper_calls) == cfg.n_layer
    assert ((got - want).norm() / want.norm()).item() < 2e-2
