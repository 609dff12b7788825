"""The ``prefill`` target on the CPU: byte and FLOP models, the fp32 oracles against an independent
recurrence and the ops' references, the command line, the tune hooks, and end-to-end runs (stand-in
providers always; the real ops once ``fastmamba.ops`` exports them) that write JSON lines.

Run: ``TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/bench``. Timings here mean nothing;
what is checked is that every path runs, rows are complete, and a wrong kernel is caught.
"""
from __future__ import annotations

import importlib
import json

import pytest
import torch
import torch.nn.functional as F

from fastmamba import cli
from fastmamba.bench import bytes as byte_models
from fastmamba.bench import report, targets, tune
from fastmamba.bench.ops._base import Provider, relative_error
from fastmamba.bench.ops.conv1d_fn import BENCH as CONV_BENCH
from fastmamba.bench.ops.conv1d_fn import ConvFnBench, causal_conv1d_fp32
from fastmamba.bench.ops.ssd_scan import BENCH as SSD_BENCH
from fastmamba.bench.ops.ssd_scan import (
    ScanFns,
    SsdScanBench,
    ssd_chunked_fp32,
    ssd_varlen_chunked_fp32,
    varlen_lengths,
)

CPU = torch.device("cpu")


# --- byte and FLOP models against a hand count -------------------------------------------------------
def test_conv_fn_bytes_hand_count():
    # B=2 L=5 D=8 W=4, bf16: x and out 2*(2*8*5)*2, weight 8*4*2, bias 8*2
    assert byte_models.conv_fn_bytes(2, 5, 8, 4, act_dtype=torch.bfloat16) == 320 + 64 + 16 == 400
    assert byte_models.conv_fn_bytes(2, 5, 8, 4, act_dtype=torch.bfloat16, has_bias=False) == 384


def test_ssd_bytes_hand_count():
    # T=10 H=2 P=3 N=4 G=1, bf16 activations, fp32 dt, fp32 state
    x_out_z = 3 * (10 * 2 * 3) * 2  # 360
    b_c = 2 * (10 * 1 * 4) * 2  # 160
    dt = 10 * 2 * 4  # 80
    per_head = 3 * 2 * 4  # 24: A, D, dt_bias
    dense_states = (1 + 1) * (2 * 3 * 4) * 4  # 192: initial read, final written
    common = dict(act_dtype=torch.bfloat16, dt_dtype=torch.float32, state_dtype=torch.float32)
    dense = byte_models.ssd_bytes(10, 2, 3, 4, 1, states_read=1, states_written=1, **common)
    assert dense == x_out_z + b_c + dt + per_head + dense_states == 816
    # varlen: 3 sequences, 1 with an initial state; cu_seqlens 4*4, cache_indices 3*4, has_initial_state 3*1
    varlen = byte_models.ssd_bytes(10, 2, 3, 4, 1, states_read=1, states_written=3, n_seqs=3, has_indices=True, **common)
    assert varlen == x_out_z + b_c + dt + per_head + 4 * 24 * 4 + 16 + 12 + 3 == 1039
    # bf16 initial state, fp32 final state (the dense API's contract): the read half shrinks only
    mixed = dict(common, state_dtype=torch.bfloat16)
    assert byte_models.ssd_bytes(10, 2, 3, 4, 1, states_read=1, states_written=1, final_dtype=torch.float32,
                                 **mixed) == 816 - 24 * 2


def test_ssd_flops_model():
    # 2*T*(G*Q*N + H*Q*P + 2*H*P*N)
    assert byte_models.ssd_flops(10, 2, 3, 4, 1, 8) == 2 * 10 * (1 * 8 * 4 + 2 * 8 * 3 + 2 * 2 * 3 * 4) == 2560
    # PEERS.md: "about 40 GFLOP at L=8192" for mamba2-2.7b, chunk 256
    assert byte_models.ssd_flops(8192, 80, 64, 128, 1, 256) == pytest.approx(43.49e9, rel=1e-3)


def test_varlen_mix_is_fixed_and_ragged():
    for T in (2048, 8192):
        lengths = varlen_lengths(T, 8)
        assert lengths == varlen_lengths(T, 8)  # same in every run
        assert len(lengths) == 8 and sum(lengths) == T and min(lengths) >= 1
        assert any(n % 256 for n in lengths) and max(lengths) > 256  # ragged, and some span several chunks


# --- the fp32 oracles ----------------------------------------------------------------------------------
def _scan_token_loop(x, dt, A, B, C, D, z, dt_bias, h0):
    """Independent definition: one token at a time, fp32. x [L, H, P], B/C [L, G, N], h0 [H, P, N]."""
    L, H, P = x.shape
    rep = H // B.shape[1]
    dt = F.softplus(dt + dt_bias)
    h = h0.clone()
    ys = []
    for t in range(L):
        Bt = B[t].repeat_interleave(rep, dim=0)  # [H, N]
        Ct = C[t].repeat_interleave(rep, dim=0)
        h = h * torch.exp(dt[t] * A)[:, None, None] + dt[t][:, None, None] * x[t][:, :, None] * Bt[:, None, :]
        ys.append((h * Ct[:, None, :]).sum(-1) + D[:, None] * x[t])
    return torch.stack(ys) * F.silu(z), h


def _scan_inputs(L=37, H=4, P=6, N=5, G=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(L, H, P, generator=g),
        dt=torch.randn(L, H, generator=g) - 2,
        A=-torch.rand(H, generator=g) * 4 - 0.5,
        B=torch.randn(L, G, N, generator=g),
        C=torch.randn(L, G, N, generator=g),
        D=torch.randn(H, generator=g),
        z=torch.randn(L, H, P, generator=g),
        dt_bias=torch.randn(H, generator=g) * 0.1,
    )


def test_chunked_oracle_matches_token_loop():
    i = _scan_inputs()  # L=37 is not a multiple of the chunk; G=2 groups of 2 heads
    h0 = torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(1))
    want_y, want_h = _scan_token_loop(i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["z"], i["dt_bias"], h0)
    y, h = ssd_chunked_fp32(
        i["x"][None], i["dt"][None], i["A"], i["B"][None], i["C"][None], 8, D=i["D"], z=i["z"][None],
        dt_bias=i["dt_bias"], initial_states=h0[None], dt_softplus=True, return_final_states=True,
    )
    torch.testing.assert_close(y[0], want_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(h[0], want_h, atol=1e-4, rtol=1e-4)


def test_varlen_oracle_is_per_sequence_and_touches_only_its_slots():
    i = _scan_inputs(L=23)
    slots, flags = [3, 1, 0], [True, False, False]  # lengths 5, 0, 18
    cu = torch.tensor([0, 5, 5, 23], dtype=torch.int32)
    states = torch.randn(5, 4, 6, 5, generator=torch.Generator().manual_seed(2))
    before = states.clone()
    y = ssd_varlen_chunked_fp32(
        i["x"], i["dt"], i["A"], i["B"], i["C"], states, cu, chunk_size=8, D=i["D"], z=i["z"],
        dt_bias=i["dt_bias"], cache_indices=torch.tensor(slots, dtype=torch.int32),
        has_initial_state=torch.tensor(flags),
    )
    for s, e, slot, flag in ((0, 5, 3, True), (5, 23, 0, False)):
        h0 = before[slot] if flag else torch.zeros(4, 6, 5)
        want_y, want_h = _scan_token_loop(*(i[k][s:e] for k in ("x", "dt")), i["A"], i["B"][s:e], i["C"][s:e],
                                          i["D"], i["z"][s:e], i["dt_bias"], h0)
        torch.testing.assert_close(y[s:e], want_y, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(states[slot], want_h, atol=1e-4, rtol=1e-4)
    for untouched in (1, 2, 4):  # slot 1 belongs to the empty sequence
        assert torch.equal(states[untouched], before[untouched])


def test_conv_oracle_matches_naive_loop():
    g = torch.Generator().manual_seed(0)
    B, D, L, W = 2, 5, 9, 4
    x, w, b = torch.randn(B, D, L, generator=g), torch.randn(D, W, generator=g), torch.randn(D, generator=g)
    want = torch.empty(B, D, L)
    for t in range(L):
        acc = b.expand(B, D).clone()
        for k in range(W):
            src = t - (W - 1) + k
            if src >= 0:
                acc += w[:, k] * x[:, :, src]
        want[:, :, t] = F.silu(acc)
    torch.testing.assert_close(causal_conv1d_fp32(x, w, b, activation="silu"), want, atol=1e-5, rtol=1e-5)
    channel_last = x.transpose(1, 2).contiguous().transpose(1, 2)
    torch.testing.assert_close(causal_conv1d_fp32(channel_last, w, b, activation="silu"), want, atol=1e-5, rtol=1e-5)


def _ref(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"{module}.{name} is not importable yet ({type(exc).__name__}: {exc})")


def test_fp32_oracles_agree_with_the_op_references():
    """What the GPU rows are checked against equals the ops' executable definitions (fp32 inputs)."""
    dense_ref = _ref("fastmamba.ops.ssd_scan.ref", "mamba_chunk_scan_combined_ref")
    varlen_ref = _ref("fastmamba.ops.ssd_scan.ref", "ssd_scan_varlen_ref")
    conv_ref = _ref("fastmamba.ops.conv1d_fn.ref", "causal_conv1d_fn_ref")
    fp32 = ScanFns(ssd_chunked_fp32, ssd_varlen_chunked_fp32)
    refs = ScanFns(dense_ref, varlen_ref)
    for case in SSD_BENCH.cases(CPU):
        inp = SSD_BENCH.make_set(case, CPU, seed=0)
        floats = ("x", "B", "C", "z", "initial_states", "ssm_states")
        inp = {k: (v.float() if k in floats else v) for k, v in inp.items()}
        mine = SSD_BENCH.results(Provider("fp32", "ref", "", fp32), case, {k: v.clone() for k, v in inp.items()})
        theirs = SSD_BENCH.results(Provider("ref", "ref", "", refs), case, {k: v.clone() for k, v in inp.items()})
        for name in theirs:
            assert relative_error(mine[name], theirs[name]) < 1e-5, (case.label, name)
    for case in CONV_BENCH.cases(CPU):
        inp = CONV_BENCH.make_set(case, CPU, seed=0)
        args = CONV_BENCH.args(case, inp)
        torch.testing.assert_close(conv_ref(*args).float(), causal_conv1d_fp32(*args), atol=5e-2, rtol=1e-2)


# --- input sets ---------------------------------------------------------------------------------------
def test_input_sets_have_the_promised_layouts():
    cases = CONV_BENCH.cases(CPU)
    assert {c.params["layout"] for c in cases} == {"channel-first", "channel-last"}
    for case in cases:
        x = CONV_BENCH.make_set(case, CPU, seed=0)["x"]
        assert x.shape == (case.batch, case.params["D"], case.params["L"])
        assert (x.stride(2) == 1) == (case.params["layout"] == "channel-first")
        assert (x.stride(1) == 1) == (case.params["layout"] == "channel-last")
    varlen = next(c for c in SSD_BENCH.cases(CPU) if c.params["varlen"])
    inp = SSD_BENCH.make_set(varlen, CPU, seed=0)
    lengths = varlen.params["lengths"]
    assert inp["cu_seqlens"].tolist() == [sum(lengths[:k]) for k in range(len(lengths) + 1)]
    assert inp["seq_idx"][0].tolist() == [b for b, n in enumerate(lengths) for _ in range(n)]
    assert inp["has_initial_state"].tolist() == [b % 2 == 0 for b in range(len(lengths))]
    assert len(set(inp["cache_indices"].tolist())) == len(lengths) < inp["ssm_states"].shape[0]


# --- command line and tune hooks ----------------------------------------------------------------------
def test_prefill_is_a_target_not_planned():
    assert "prefill" in targets.TARGETS and "prefill" not in targets.PLANNED


def test_bad_prefill_ops_value(capsys):
    with pytest.raises(SystemExit):
        targets.main(["prefill", "--ops", "conv_fn,warp"])
    assert "choose from conv_fn,ssd" in capsys.readouterr().err


def test_tune_accepts_the_prefill_ops():
    parser = targets.configure(__import__("argparse").ArgumentParser())
    args = parser.parse_args(["tune", "--ops", "conv_fn,ssd"])
    assert args.ops == ["conv_fn", "ssd"]
    assert parser.parse_args(["tune"]).ops == ["ssu", "conv", "norm"]  # decode ops by default


@pytest.mark.parametrize("key", ["conv_fn", "ssd"])
def test_tune_hooks(key):
    """The sweep finds CANDIDATES and forced_config, or says cleanly why it cannot."""
    sweep = tune.plan_sweeps([key], CPU)[0]
    if sweep.reason:
        assert "configs" in sweep.reason or "unavailable" in sweep.reason
        pytest.skip(f"{key} cannot be swept yet: {sweep.reason}")
    cases = sweep.bench.tune_cases(CPU, [])
    assert cases
    for case in cases:
        candidates = sweep.bench.tune_candidates(sweep.configs, case)
        assert candidates
        with sweep.configs.forced_config(**candidates[0]):  # the launcher's hook takes every candidate's fields
            pass


def test_tune_sweep_loop_with_stubbed_gpu(monkeypatch, tmp_path, capsys):
    """tune's loop (GPU only) walked on the CPU: stand-in timings, tiny cases, the real ssd configs."""
    sweep = tune.plan_sweeps(["ssd"], CPU)[0]
    if sweep.configs is None:
        pytest.skip(f"ssd cannot be swept yet: {sweep.reason}")
    configs = sweep.configs
    make_set = SsdScanBench.make_set
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(tune, "measure_copy_bandwidth", lambda device: 1000.0)
    monkeypatch.setattr(tune, "l2_cache_bytes", lambda device: 0)
    monkeypatch.setattr(tune, "device_name", lambda device: "stub GPU")
    monkeypatch.setattr(SsdScanBench, "providers", _stand_in([
        Provider("fastmamba", "ours", "test", ScanFns(ssd_chunked_fp32, ssd_varlen_chunked_fp32)),
    ]))
    monkeypatch.setattr(SsdScanBench, "tune_cases", lambda self, device, batches: self.cases(CPU))
    monkeypatch.setattr(SsdScanBench, "make_set", lambda self, case, device, seed: make_set(self, case, CPU, seed))
    times = iter(range(10**6, 0, -1))  # every config faster than the one before: the last one wins
    monkeypatch.setattr(tune, "_time", lambda *args: float(next(times)))
    out = tmp_path / "tune.jsonl"
    rc = cli.main(["bench", "tune", "--ops", "ssd", "--cases", "varlen", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    varlen_cases = [c for c in SsdScanBench().cases(CPU) if c.params["varlen"]]
    lines = out.read_text().splitlines()
    assert len(lines) == len(varlen_cases) * len(configs.CANDIDATES)
    for case in varlen_cases:
        row = next(ln for ln in printed.splitlines() if ln.startswith(case.label))
        assert row.endswith(str(configs.CANDIDATES[-1]))


def test_tune_reports_a_missing_configs_module(monkeypatch):
    monkeypatch.setitem(tune.CONFIG_MODULES, "ssd", "fastmamba.ops.ssd_scan.no_such_configs")
    sweep = tune.plan_sweeps(["ssd"], CPU)[0]
    assert sweep.reason.startswith("no sweep hooks in fastmamba.ops.ssd_scan.no_such_configs yet")


def test_flop_columns_only_when_rows_count_flops():
    row = report.Row(op="conv", title="t", shape="s", dims="d", dtype="bf16", batch=1, provider="p", kind="ours",
                     version="v", bytes=10)
    assert "TFLOP/s" not in report.format_table([row])
    row.flops, row.tflops, row.pct_matmul = 100, 0.5, 3.0
    table = report.format_table([row])
    assert "TFLOP/s" in table and "% mm" in table and "0.500" in table and "3%" in table


# --- end to end on the CPU ---------------------------------------------------------------------------
def _run(argv, tmp_path):
    """Through the ``fastmamba`` command, pinned to the CPU (tiny shapes) even on a GPU host."""
    out = tmp_path / "rows.jsonl"
    md = tmp_path / "table.md"
    argv = [*argv, "--quick", "--device", "cpu", "--json", str(out), "--markdown", str(md)]
    rc = cli.main(["bench", "prefill", *argv])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return rc, rows, md.read_text()


def _conv_stand_in(*args):
    return causal_conv1d_fp32(*args).to(args[0].dtype)


def _stand_in(providers):
    def fake(self, device):
        return providers

    return fake


def test_end_to_end_with_stand_in_ops(monkeypatch, tmp_path, capsys):
    dense_ref = _ref("fastmamba.ops.ssd_scan.ref", "mamba_chunk_scan_combined_ref")  # takes cu_seqlens, like mamba_ssm
    monkeypatch.setattr(ConvFnBench, "providers", _stand_in([
        Provider("fastmamba", "ours", "test", _conv_stand_in),
        Provider("causal_conv1d", "peer", "?", None, reason="ModuleNotFoundError: No module named 'causal_conv1d'"),
        Provider("torch", "ref", "test", lambda *a: causal_conv1d_fp32(*a).to(a[0].dtype)),
    ]))
    monkeypatch.setattr(SsdScanBench, "providers", _stand_in([
        Provider("fastmamba", "ours", "test", ScanFns(ssd_chunked_fp32, ssd_varlen_chunked_fp32)),
        Provider("mamba_ssm", "peer", "test", ScanFns(dense_ref, dense_ref, style="mamba_ssm", state_dtype_arg=False)),
    ]))
    rc, rows, md = _run([], tmp_path)
    assert rc == 0
    conv = [r for r in rows if r["op"] == "conv_fn"]
    ssd = [r for r in rows if r["op"] == "ssd"]
    assert len(conv) == 4 * 3 and len(ssd) == 4 * 2  # (B 1, 2) x (2 layouts) x 3 providers; 4 scan cases x 2
    for r in rows:
        if r["provider"] in ("fastmamba", "mamba_ssm"):
            assert r["status"] == "ok" and r["check"] == "ok" and r["mode"] == "cpu", r
        for key in ("device", "torch", "triton", "date", "command", "copy_gbps", "matmul_tflops", "timing_method"):
            assert key in r
        assert "bench prefill" in r["command"]
    torch_rows = [r for r in conv if r["provider"] == "torch"]
    assert [r["status"] for r in torch_rows] == ["ok", "skipped"] * 2  # channel-first only
    assert "channel-first only" in torch_rows[1]["note"]
    for r in conv:
        p = r["params"]
        assert r["flops"] == 0 and r["tflops"] is None
        assert r["bytes"] == byte_models.conv_fn_bytes(r["batch"], p["L"], p["D"], 4, act_dtype=torch.bfloat16)
    for r in ssd:
        assert r["flops"] == byte_models.ssd_flops(40, 2, 8, 8, 1, 16)
        assert r["tflops"] > 0 and r["pct_matmul"] > 0 and r["gbps"] > 0
    varlen_peer = [r for r in ssd if r["provider"] == "mamba_ssm" and r["params"]["varlen"]]
    assert varlen_peer and all("no per-sequence initial states" in r["note"] for r in varlen_peer)
    printed = capsys.readouterr().out
    assert "no GPU" in printed and "matmul:" in printed and "TFLOP/s" in printed and "% mm" in printed
    assert "check [ssd]: against" in printed and "check [conv_fn]: against" in printed
    assert "cases [ssd]:" in printed and "fp32 x/B/C/z" in printed
    assert md.startswith("# fastmamba prefill benchmark") and "| ssd |" in md and "| conv_fn |" in md


def test_wrong_scan_is_reported_fail(monkeypatch, tmp_path):
    def wrong_varlen(*args, **kwargs):
        out = ssd_varlen_chunked_fp32(*args, **kwargs)
        args[5].mul_(1.05)  # every slot drifts, touched or not
        return out

    monkeypatch.setattr(SsdScanBench, "providers", _stand_in([
        Provider("fastmamba", "ours", "test", ScanFns(lambda *a, **k: (ssd_chunked_fp32(*a, **k)[0] * 1.05,
                                                                        ssd_chunked_fp32(*a, **k)[1]), wrong_varlen)),
    ]))
    rc, rows, _ = _run(["--ops", "ssd", "--oracle", "fp32"], tmp_path)
    assert rc == 1
    dense = [r for r in rows if not r["params"]["varlen"]]
    varlen = [r for r in rows if r["params"]["varlen"]]
    assert all(r["check"].startswith("FAIL out: relative error 5.0") for r in dense), [r["check"] for r in dense]
    assert all("a slot outside cache_indices changed" in r["check"] for r in varlen), [r["check"] for r in varlen]


def _public_op(name: str):
    try:
        return getattr(importlib.import_module("fastmamba.ops"), name)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"fastmamba.ops.{name} is not importable yet ({type(exc).__name__}: {exc})")


@pytest.mark.parametrize(
    "op, names",
    [("conv_fn", ("causal_conv1d_fn",)), ("ssd", ("mamba_chunk_scan_combined", "ssd_scan_varlen"))],
)
def test_real_op_end_to_end(op, names, tmp_path):
    for name in names:
        assert callable(_public_op(name))
    rc, rows, _ = _run(["--ops", op], tmp_path)
    ours = [r for r in rows if r["provider"] == "fastmamba"]
    assert ours and all(r["status"] == "ok" for r in ours), [r["note"] for r in ours]
    assert all(r["check"] == "ok" for r in ours), [r["check"] for r in ours]
    assert all(r["status"] in ("ok", "skipped") for r in rows)
    assert rc == 0
