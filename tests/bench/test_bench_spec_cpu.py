"""The ``spec`` target on the CPU: byte models and the replay cache's steady state, the
batch-adaptive choice and issue 5's acceptance lines (the summary and ``choose_verify_path``),
wrong replays caught by the check, and end-to-end runs that write JSON rows and the summary
records: with the op references standing in for the replay op, and with the real ops on a tiny
shape under the interpreter.

Run: ``TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/bench``. Timings here mean nothing.
"""
from __future__ import annotations

import argparse
import doctest
import importlib
import json
import random
from fractions import Fraction

import pytest
import torch

from fastmamba import cli
from fastmamba.bench import bytes as byte_models
from fastmamba.bench import report, spec, targets
from fastmamba.bench.ops._base import Provider, load_fastmamba
from fastmamba.bench.ops.spec_verify import (
    LEGACY,
    LEGACY_NO_COPY,
    PLAIN,
    PROVIDERS,
    REPLAY,
    SHAPES,
    ReplayFns,
    SpecVerifyBench,
    history_for,
)
from fastmamba.generation import spec_policy
from fastmamba.generation.spec_policy import choose_verify_path, expected_tokens_per_step

CPU = torch.device("cpu")


def _new_replay_api() -> str:
    """'' when the history-based replay op has landed (ops/replay exports default_history and the
    reference commit), else why not: the real replay provider cannot run before it has."""
    try:
        importlib.import_module("fastmamba.ops.replay").default_history  # noqa: B018
        importlib.import_module("fastmamba.ops.replay.ref").commit_accepted_ref  # noqa: B018
    except (ImportError, AttributeError) as exc:
        return f"the history-based replay API has not landed yet ({exc})"
    return ""


# --- the replay cache's steady state and the byte models -------------------------------------------------
def test_steady_state_hand_count():
    # T=3, C=16 (room 13), fixed per-request counts: a request with a stores every 13 // a + 1 calls
    # (14, 7, 5) and replays a, 2a, ..., L a tokens on the way (mean a (L + 1) / 2: 7.5, 8, 9)
    fixed = byte_models.spec_replay_steady_state(3, 16)
    assert fixed.checkpoint_rate == pytest.approx(float((Fraction(1, 14) + Fraction(1, 7) + Fraction(1, 5)) / 3))
    assert fixed.replayed == pytest.approx(24.5 / 3)
    # T = C: every call stores (nothing fits after the replayed tokens), whatever was accepted
    assert byte_models.spec_replay_steady_state(4, 4) == (1.0, 2.5)
    assert byte_models.spec_replay_steady_state(4, 4, redraw=True) == (1.0, 2.5)
    with pytest.raises(ValueError, match="1 <= tokens <= history"):
        byte_models.spec_replay_steady_state(8, 4)
    assert doctest.testmod(byte_models).failed == 0


def _simulate(T: int, C: int, redraw: bool, steps: int = 40000, seed: int = 0) -> tuple[float, float]:
    """The op's bookkeeping (fastmamba.ops.replay.ref) step by step: (stores per call, replayed per
    call). Fixed counts: one request per count 1..T (uniform over requests), each for ``steps`` calls."""
    rng = random.Random(seed)
    stores = replayed = calls = 0
    for fixed in range(1, T + 1) if not redraw else [None]:
        h, a = 0, fixed or rng.randint(1, T)
        for _ in range(steps // T if not redraw else steps):
            k = h + a
            replayed, calls = replayed + k, calls + 1
            if k + T > C:
                stores, h = stores + 1, 0
            else:
                h = k
            a = fixed or rng.randint(1, T)
    return stores / calls, replayed / calls


@pytest.mark.parametrize("T, C", [(2, 16), (3, 16), (6, 32), (16, 64), (5, 7)], ids=lambda v: str(v))
@pytest.mark.parametrize("redraw", [False, True], ids=["fixed", "redrawn"])
def test_steady_state_matches_a_simulation(T, C, redraw):
    rate, replayed = _simulate(T, C, redraw)
    exact = byte_models.spec_replay_steady_state(T, C, redraw=redraw)
    assert exact.checkpoint_rate == pytest.approx(rate, rel=0.05)
    assert exact.replayed == pytest.approx(replayed, rel=0.03)


def test_spec_bytes_hand_count():
    # B=2 T=3 H=2 P=4 N=5 G=1 C=16, fp32 state, bf16 activations and dt
    common = dict(state_dtype=torch.float32, act_dtype=torch.bfloat16, dt_dtype=torch.bfloat16)
    state = 2 * 4 * 5 * 4  # 160 bytes per request
    inputs = 3 * (2 * 8 * 2 + 2 * 5 * 2 + 2 * 2)  # x, z; B, C; dt: 3 * 56 = 168
    per_head = 3 * 2 * 4  # A, D, dt_bias: 24
    per_token = 8 * 2 + 5 * 2 + 2 * 2 * 4  # old_x, old_B, old_dt, old_cumA: 42
    recorded = 3 * (8 * 2 + per_token)  # y + the history record: 3 * 58 = 174
    rate, replayed = Fraction(29, 210), Fraction(49, 6)  # test_steady_state_hand_count's T=3, C=16
    per_req = state * (1 + rate) + replayed * per_token + inputs + recorded + 9 * 4
    expected = round(2 * per_req) + per_head
    assert byte_models.spec_replay_bytes(2, 3, 2, 4, 5, 1, history=16, **common) == expected == 1830
    # a longer history stores less often and replays more
    assert byte_models.spec_replay_bytes(2, 3, 2, 4, 5, 1, history=64, **common) > expected
    y = 3 * 8 * 2  # 48
    no_copy = 2 * ((2 + 3) * state + inputs + y + 4) + per_head
    assert byte_models.spec_legacy_bytes(2, 3, 2, 4, 5, 1, copy=False, **common) == no_copy == 2064
    assert byte_models.spec_legacy_bytes(2, 3, 2, 4, 5, 1, copy=True, **common) == no_copy + 2 * (2 * state + 16)


def test_history_is_a_16_multiple_of_at_least_4T():
    for T in (1, 2, 3, 4, 6, 8, 16, 17):
        C = history_for(T)
        assert C % 16 == 0 and C >= 4 * T and C - 16 < max(4 * T, 1), (T, C)


def test_gpu_cases_and_their_bytes():
    bench = SpecVerifyBench()
    cases = bench.cases(torch.device("cuda"), [1, 8, 32, 128, 256])  # the GPU defaults, nothing allocated
    assert {c.shape for c in cases} == {"nemotron-h", "nemotron-h-tp8"}
    assert {c.params["T"] for c in cases} == {2, 4, 6, 8, 16} and len(cases) == 2 * 2 * 5 * 5
    tp8 = next(c for c in cases if c.shape == "nemotron-h-tp8")
    assert (tp8.params["H"], tp8.params["P"], tp8.params["N"], tp8.params["G"]) == (16, 64, 128, 1)
    for case in cases:
        assert case.params["history"] == history_for(case.params["T"])
        per_provider = {p: bench.provider_bytes(Provider(p, "ours", "", None), case) for p in PROVIDERS}
        assert case.nbytes == min(per_provider.values())
        assert per_provider[LEGACY] > per_provider[LEGACY_NO_COPY] > per_provider[REPLAY]
    only = SpecVerifyBench(tokens=[6], shapes=["mamba2-2.7b"]).cases(torch.device("cuda"), [128])
    assert [(c.shape, c.params["T"], c.params["H"]) for c in only] == [("mamba2-2.7b", 6, 80)] * 2
    cpu = SpecVerifyBench().cases(CPU, [1])
    assert {c.shape for c in cpu} == {"tiny"} and {c.params["T"] for c in cpu} == {2, 3}


def test_input_set_is_a_cache_mid_flight():
    bench = SpecVerifyBench(tokens=[4])
    case = bench.cases(CPU, [3])[0]
    T, C, S = case.params["T"], case.params["history"], case.params["S"]
    inp = bench.make_set(case, CPU, seed=7)
    again = bench.make_set(case, CPU, seed=7)
    assert torch.equal(inp["accepted"], again["accepted"])  # fixed per set
    assert inp["accepted"].dtype == torch.int32 and 1 <= int(inp["accepted"].min()) <= int(inp["accepted"].max()) <= T
    assert torch.equal(inp["accepted_pos"], inp["accepted"].long() - 1)
    assert inp["old_x"].shape == (S, C, 2, 16) and inp["old_B"].shape == (2, S, C, 1, 16)
    assert inp["old_dt"].shape == inp["old_cumA"].shape == (2, S, C, 2)
    assert bool((inp["old_cumA"].diff(dim=2) <= 0).all())  # a cumulative sum of A dt' < 0
    assert int(inp["hist_len"].max()) <= C - T and int(inp["prev_accepted"].min()) >= 1
    assert len(set(inp["idx"].tolist())) == 3
    # the tune cases serve the replay provider only: no intermediate_states, no legacy gather
    tune_case = bench.tune_cases(CPU, [3])[0]
    assert tune_case.params["providers"] == (REPLAY,)
    assert "inter" not in bench.make_set(tune_case, CPU, seed=0)


# --- the batch-adaptive choice -------------------------------------------------------------------------
def test_choose_verify_path():
    # no table: the package file's entry for Nemotron-H with an fp32 state
    default = spec_policy.lookup_table(*spec_policy.DEFAULT_SHAPE).table
    assert default and [choose_verify_path(b, t) for b in (1, 256) for t in (2, 6, 16)] == [
        choose_verify_path(b, t, default) for b in (1, 256) for t in (2, 6, 16)]
    # an empty table: legacy below the placeholder crossover batch
    assert [choose_verify_path(b, 6, {}) for b in (1, 7, 8, 256)] == ["legacy", "legacy", "replay", "replay"]
    assert choose_verify_path(1, 1) == choose_verify_path(256, 1) == "plain"  # nothing drafted
    table = {2: 32, 6: 8, 16: None}
    assert choose_verify_path(8, 6, table) == "replay" and choose_verify_path(4, 6, table) == "legacy"
    assert choose_verify_path(16, 2, table) == "legacy" and choose_verify_path(32, 2, table) == "replay"
    assert choose_verify_path(256, 16, table) == "legacy"  # replay never won at T=16
    assert choose_verify_path(8, 4, table) == "replay"  # T=4 -> nearest measured T, 6 on the tie with 2
    assert choose_verify_path(8, 12, table) == "legacy"  # 16 is nearer than 6
    assert choose_verify_path(8, 6, json.loads(json.dumps(table))) == "replay"  # as read back from the JSON record
    with pytest.raises(ValueError, match="batch and tokens must be >= 1"):
        choose_verify_path(0, 6)
    assert expected_tokens_per_step(6, 0.6) == pytest.approx(1 + 0.6 + 0.36 + 0.216 + 0.1296 + 0.07776)
    assert expected_tokens_per_step(4, 1.0) == 4 and expected_tokens_per_step(4, 0.0) == 1
    assert doctest.testmod(spec_policy).failed == 0


def _row(provider: str, batch: int, us: float, T: int = 6, check: str = "ok", shape: str = "s",
         state: str = "fp32", mode: str = "graph") -> report.Row:
    H, P, N, G = SHAPES.get(shape, (2, 16, 16, 1))  # a named shape's dims: the policy table looked up for it
    return report.Row(op="spec", title="t", shape=shape, dims=f"H{H} P{P} N{N} G{G} T{T}", dtype=f"{state}/bf16",
                      batch=batch, provider=provider, kind="ours", version="v", bytes=1, mode=mode, median_us=us,
                      check=check, params={"T": T})


def test_summary_crossover_and_plain_choice():
    rows = []
    # replay loses at 1, wins at 8, loses at 32 (noise), then wins from 128 up: the crossover is 128
    for b, (rep, leg) in {1: (12.0, 10.0), 8: (20.0, 30.0), 32: (70.0, 60.0), 128: (200.0, 800.0)}.items():
        rows += [_row(REPLAY, b, rep), _row(LEGACY, b, leg), _row(LEGACY_NO_COPY, b, leg - 1), _row(PLAIN, b, 5.0)]
    rows.append(_row(REPLAY, 256, 1.0, check="FAIL y: wrong"))  # a failed check is no measurement
    rows.append(_row(LEGACY, 256, 900.0))
    summary = spec.summarize(rows, argparse.Namespace(accept_rate=0.6, device_name="stub GPU"))
    choice = next(r for r in summary.records if r["record"] == "spec_choice")
    assert choice["crossover_batch"] == 128 and choice["tokens"] == 6
    assert choice["legacy_over_replay"] == {1: 10.0 / 12.0, 8: 1.5, 32: 60.0 / 70.0, 128: 4.0}
    b1 = choice["batch1"]  # legacy at batch 1: 10 us / 2.38 tokens = 4.2 us per token < plain's 5 us
    assert b1["path"] == "legacy" and b1["plain_cheaper"] is False
    assert b1["spec_us_per_token"] == pytest.approx(10.0 / expected_tokens_per_step(6, 0.6))
    table = next(r for r in summary.records if r["record"] == "spec_crossover")
    assert table["table"] == {6: 128} and table["state_dtype"] == "fp32"
    assert choose_verify_path(128, 6, table["table"]) == "replay"
    # a low acceptance rate makes plain decode the cheaper one per token
    low = next(r for r in spec.summarize(rows, argparse.Namespace(accept_rate=0.1, device_name="stub GPU")).records
               if r["record"] == "spec_choice")
    assert low["batch1"]["plain_cheaper"] is True
    text = "\n".join(summary.lines)
    assert "Batch-adaptive choice" in text and "B>=128" in text and "256:—" in text


def _acceptance_rows(shape: str, state: str, legacy128: float, replay: dict[int, float], replay1: float) -> list:
    rows = []
    for T, us in replay.items():
        rows += [_row(REPLAY, 128, us, T=T, shape=shape, state=state), _row(LEGACY, 128, legacy128, T=T, shape=shape,
                                                                              state=state)]
        rows += [_row(REPLAY, 1, replay1, T=T, shape=shape, state=state), _row(LEGACY, 1, 10.0, T=T, shape=shape,
                                                                                state=state)]
    return rows


def _h100_file(tmp_path):
    """A table file holding the H100 rows the package started with (Nemotron-H: replay at every batch)."""
    rows = [dict(heads=128, head_dim=64, state_size=128, state_dtype=state, tokens=T, crossover_batch=1)
            for state in ("fp32", "fp16") for T in (2, 4, 6, 8, 16)]
    path = tmp_path / "h100.json"
    spec_policy.write_table(spec_policy.new_set(rows, gpu="NVIDIA H100 80GB HBM3", commit="49359f8", command="c",
                                                date="2026-11-22"), path)
    return path


def test_acceptance_lines_on_an_h200(monkeypatch, tmp_path):
    rows = _acceptance_rows("nemotron-h", "fp32", 1000.0, {2: 150.0, 6: 200.0, 16: 300.0}, replay1=8.0)
    rows += _acceptance_rows("nemotron-h", "fp16", 400.0, {2: 100.0, 6: 200.0, 16: 120.0}, replay1=12.0)
    summary = spec.summarize(rows, argparse.Namespace(accept_rate=0.6, device_name="NVIDIA H200"))
    acc = {r["state_dtype"]: r for r in summary.records if r["record"] == "spec_acceptance"}
    fp32, fp16 = acc["fp32"], acc["fp16"]
    assert fp32["legacy_over_replay"] == 5.0 and fp32["legacy_over_replay_ok"] is True
    assert fp16["legacy_over_replay"] == 2.0 and fp16["legacy_over_replay_ok"] is False
    assert fp32["t16_over_t2"] == 2.0 and fp32["t16_over_t2_ok"] is False
    assert fp16["t16_over_t2"] == 1.2 and fp16["t16_over_t2_ok"] is True
    # the policy as shipped for the shape (the engine's lookup): the check catches a GPU where it is slower
    for rec, state in ((fp32, "fp32"), (fp16, "fp16")):
        table = spec_policy.lookup_table(128, 64, 128, state, device_name="NVIDIA H200").table
        assert {T: v["path"] for T, v in rec["batch1"].items()} == {T: choose_verify_path(1, T, table) for T in (2, 6, 16)}
        assert "H128 P64 N128" in rec["batch1_table"]
    # with the H100 rows of the initial file: replay at batch 1, slower than legacy in the fp16 rows
    h100 = _h100_file(tmp_path)
    monkeypatch.setattr(spec, "lookup_table", lambda *a, **k: spec_policy.lookup_table(*a, **k, path=h100))
    summary = spec.summarize(rows, argparse.Namespace(accept_rate=0.6, device_name="NVIDIA H200"))
    acc = {r["state_dtype"]: r for r in summary.records if r["record"] == "spec_acceptance"}
    fp32, fp16 = acc["fp32"], acc["fp16"]
    assert fp32["batch1_ok"] is True and all(v["path"] == REPLAY for v in fp32["batch1"].values())
    assert fp16["batch1_ok"] is False and all(v["path"] == REPLAY for v in fp16["batch1"].values())
    assert fp32["flashinfer_us"] == 246.0 and fp32["flashinfer_comparable"] is True
    assert fp32["flashinfer_over_replay"] == pytest.approx(246.0 / 200.0)
    assert fp16["flashinfer_us"] == 165.0 and fp16["flashinfer_over_replay"] == pytest.approx(165.0 / 200.0)
    text = "\n".join(summary.lines)
    assert "Issue 5 acceptance on NVIDIA H200" in text
    assert "legacy/replay at B=128 T=6: 1000 / 200.0 µs = 5.00x (target >= 3x): PASS" in text
    assert "replay T=16 / T=2 at B=128: 300.0 / 150.0 µs = 2.00x (target <= 1.5x; flashinfer 2.0x on an H200): FAIL" in text
    assert "246 µs (PEERS.md, measured on an NVIDIA H200); ours 200.0 µs on NVIDIA H200 -> 1.23x flashinfer" in text
    assert "165 µs" in text and "0.82x flashinfer (same GPU): FAIL" in text
    assert ("nemotron-h fp32: B=1, adaptive choice (spec_policy.lookup_table) never slower than legacy: "
            "T=2 replay 8.00 (vs legacy 10.0); T=6 replay 8.00 (vs legacy 10.0); T=16 replay 8.00 (vs legacy 10.0): "
            "PASS") in text
    assert "T=2 replay 12.0 (vs legacy 10.0) SLOWER" in text


def test_acceptance_lines_elsewhere(monkeypatch):
    # another GPU: flashinfer's H200 figure is printed, not compared
    rows = _acceptance_rows("nemotron-h", "fp32", 1000.0, {6: 200.0}, replay1=8.0)
    rows += _acceptance_rows("nemotron-h-tp8", "fp32", 100.0, {2: 20.0, 16: 25.0}, replay1=8.0)
    summary = spec.summarize(rows, argparse.Namespace(accept_rate=0.6, device_name="NVIDIA H100 80GB HBM3"))
    acc = {r["shape"]: r for r in summary.records if r["record"] == "spec_acceptance"}
    assert acc["nemotron-h"]["flashinfer_comparable"] is False and acc["nemotron-h"]["flashinfer_over_replay"] is None
    assert acc["nemotron-h"]["t16_over_t2"] is None and acc["nemotron-h"]["t16_over_t2_ok"] is None
    assert "flashinfer_us" not in acc["nemotron-h-tp8"]  # PEERS.md has no figure for the TP=8 slice
    assert acc["nemotron-h-tp8"]["legacy_over_replay"] is None  # no T=6 rows
    text = "\n".join(summary.lines)
    assert "not comparable (different GPU; compare only on an H200)" in text
    assert "nemotron-h-tp8 fp32: legacy/replay at B=128 T=6: — (target >= 3x): not measured" in text
    # a policy that picked replay at batch 1 where it is slower is flagged
    monkeypatch.setattr(spec, "choose_verify_path", lambda batch, tokens, table=None: REPLAY)
    summary = spec.summarize(_acceptance_rows("s", "fp16", 100.0, {6: 50.0}, replay1=12.0),
                             argparse.Namespace(accept_rate=0.6, device_name="stub GPU"))
    rec = next(r for r in summary.records if r["record"] == "spec_acceptance")
    assert rec["batch1_ok"] is False and rec["batch1"][6] == dict(path=REPLAY, path_us=12.0, legacy_us=10.0, ok=False)
    assert "T=6 replay 12.0 (vs legacy 10.0) SLOWER: FAIL" in "\n".join(summary.lines)


# --- command line ---------------------------------------------------------------------------------------
def test_spec_is_a_target_not_planned():
    assert "spec" in targets.TARGETS and "spec" not in targets.PLANNED


def test_spec_defaults():
    parser = targets.configure(argparse.ArgumentParser())
    args = parser.parse_args(["spec"])
    assert args.shapes is None and args.tokens is None  # by device: see test_gpu_cases_and_their_bytes
    args = parser.parse_args(["spec", "--shapes", "mamba2-2.7b,nemotron-h", "--tokens", "6,2,6"])
    assert args.shapes == ["mamba2-2.7b", "nemotron-h"] and args.tokens == [6, 2]


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "1,6"], "must be >= 2"),
    (["--accept-rate", "1.5"], "expected a number in [0, 1]"),
    (["--shapes", "nemotron-h,jamba"], "unknown shape(s) jamba; choose from nemotron-h,nemotron-h-tp8,mamba2-2.7b,tiny"),
    (["--state", "fp32,fp8"], "unknown state dtype(s) fp8; choose from fp32,fp16,bf16"),
    (["--providers", "replay,fast"], "unknown provider(s) fast; choose from replay,legacy,legacy-no-copy,plain"),
])
def test_bad_spec_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        targets.main(["spec", *argv])
    assert message in capsys.readouterr().err


# --- end to end on the CPU ------------------------------------------------------------------------------
def _run(argv, tmp_path):
    out, md = tmp_path / "rows.jsonl", tmp_path / "table.md"
    rc = cli.main(["bench", "spec", *argv, "--quick", "--device", "cpu", "--json", str(out), "--markdown", str(md)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    rows = [r for r in lines if "record" not in r]
    records = [r for r in lines if "record" in r]
    return rc, rows, records, md.read_text()


REPLAY_REF = load_fastmamba("replay", "replay_selective_state_update_ref", module="ref")


def _commit_ref():
    return load_fastmamba("replay", "commit_accepted_ref", module="ref")


def _needs_the_reference_commit() -> None:
    if not hasattr(importlib.import_module("fastmamba.ops.replay.ref"), "commit_accepted_ref"):
        pytest.skip("fastmamba.ops.replay.ref has no commit_accepted_ref yet (the history-based replay API)")


def _stand_ins(replay: ReplayFns):
    """The op references as providers (fast on the CPU); ``replay`` in place of the replay op + commit."""
    ssu_ref = load_fastmamba("state_update", "selective_state_update_ref", module="ref")
    provs = [Provider(REPLAY, "ours", "test", replay)]
    provs += [Provider(name, "peer", "test", ssu_ref) for name in (LEGACY, LEGACY_NO_COPY)]
    provs.append(Provider(PLAIN, "baseline", "test", ssu_ref))
    return lambda self, device: provs


def _forgets_to_record(state, old_x, *args, **kwargs):  # outputs right, this step never appended to old_x
    return REPLAY_REF(state, old_x.clone(), *args, **kwargs)


def _keeps_hist_len(buf_idx, prev_accepted, hist_len, *args, **kwargs):  # commit that never moves hist_len
    return _commit_ref()(buf_idx, prev_accepted, hist_len.clone(), *args, **kwargs)


@pytest.mark.parametrize("wrong, field", [("op", "old_x"), ("commit", "hist_len")])
def test_wrong_replay_is_reported_fail(wrong, field, monkeypatch, tmp_path):
    _needs_the_reference_commit()
    fns = ReplayFns(_forgets_to_record, _commit_ref()) if wrong == "op" else ReplayFns(REPLAY_REF, _keeps_hist_len)
    monkeypatch.setattr(SpecVerifyBench, "providers", _stand_ins(fns))
    rc, rows, records, _ = _run(["--batch", "2", "--tokens", "4"], tmp_path)
    assert rc == 1
    replay = [r for r in rows if r["provider"] == REPLAY]
    assert replay and all(r["check"].startswith(f"FAIL {field}:") for r in replay), [r["check"] for r in replay]
    assert all(r["check"] == "ok" for r in rows if r["provider"] != REPLAY)
    assert all(r["crossover_batch"] is None for r in records if r["record"] == "spec_choice")


def test_stand_in_replay_end_to_end(monkeypatch, tmp_path, capsys):
    """The whole target with the replay reference (op + commit) as the replay provider: every check
    passes, the cache's bookkeeping evolves across the timed calls, and the summary is written."""
    _needs_the_reference_commit()
    monkeypatch.setattr(SpecVerifyBench, "providers", _stand_ins(ReplayFns(REPLAY_REF, _commit_ref())))
    rc, rows, records, md = _run(["--batch", "1,3", "--tokens", "2,5"], tmp_path)
    assert rc == 0, [(r["provider"], r["check"], r["note"]) for r in rows if r["check"] != "ok"]
    assert {(r["dtype"], r["batch"], r["params"]["T"]) for r in rows} == {
        (d, b, T) for d in ("fp32/bf16", "fp16/bf16") for b in (1, 3) for T in (2, 5)}
    for r in rows:
        assert r["status"] == "ok" and r["check"] == "ok" and r["mode"] == "cpu", r
        assert r["params"]["history"] == history_for(r["params"]["T"]) == {2: 16, 5: 32}[r["params"]["T"]]
    replay = next(r for r in rows if r["provider"] == REPLAY and r["batch"] == 3 and r["params"]["T"] == 5)
    assert replay["bytes"] == byte_models.spec_replay_bytes(
        3, 5, 2, 16, 16, 1, history=32, state_dtype=torch.float32 if replay["dtype"].startswith("fp32")
        else torch.float16, act_dtype=torch.bfloat16, dt_dtype=torch.bfloat16)
    assert "+ commit; C=32: stores the state in" in replay["note"]
    kinds = {r["record"] for r in records}
    assert kinds == {"spec_choice", "spec_crossover", "spec_acceptance"}
    acc = [r for r in records if r["record"] == "spec_acceptance"]
    assert {(r["shape"], r["state_dtype"]) for r in acc} == {("tiny", "fp32"), ("tiny", "fp16")}
    assert all(r["device_name"] == "CPU (no CUDA device)" and "flashinfer_us" not in r for r in acc)
    printed = capsys.readouterr().out
    assert "Issue 5 acceptance on CPU (no CUDA device)" in printed and "show the plumbing" in printed
    assert "Issue 5 acceptance" in md


def test_real_ops_end_to_end(tmp_path, capsys):
    if _new_replay_api():
        pytest.skip(_new_replay_api())
    rc, rows, records, md = _run(["--tokens", "2", "--accept-rate", "0.5"], tmp_path)
    assert rc == 0, [(r["provider"], r["check"], r["note"]) for r in rows if r["check"] != "ok"]
    cases = {(r["dtype"], r["batch"]) for r in rows}
    assert cases == {(d, b) for d in ("fp32/bf16", "fp16/bf16") for b in (1, 2)}
    for case in cases:
        got = [r["provider"] for r in rows if (r["dtype"], r["batch"]) == case]
        assert got == list(PROVIDERS)
    for r in rows:
        assert r["status"] == "ok" and r["check"] == "ok" and r["mode"] == "cpu", r
        assert r["params"]["T"] == 2 and r["params"]["history"] == history_for(2) and "bench spec" in r["command"]
    legacy = next(r for r in rows if r["provider"] == LEGACY and r["batch"] == 2 and r["dtype"] == "fp32/bf16")
    assert legacy["bytes"] == byte_models.spec_legacy_bytes(
        2, 2, 2, 16, 16, 1, state_dtype=torch.float32, act_dtype=torch.bfloat16, dt_dtype=torch.bfloat16, copy=True)
    choices = [r for r in records if r["record"] == "spec_choice"]
    assert len(choices) == 2 and all(r["accept_rate"] == 0.5 and r["expected_tokens_per_step"] == 1.5 for r in choices)
    assert all("device" in r and "command" in r for r in records)  # the header travels with them
    assert {r["state_dtype"] for r in records if r["record"] == "spec_crossover"} == {"fp32", "fp16"}
    printed = capsys.readouterr().out
    assert "Batch-adaptive choice" in printed and "crossover tables for choose_verify_path" in printed
    assert printed.index("Batch-adaptive choice") > printed.index("median µs")  # after the table
    assert printed.index("Issue 5 acceptance") > printed.index("Batch-adaptive choice")
    assert md.startswith("# fastmamba speculative verification benchmark") and "Batch-adaptive choice" in md


# --- --write-table: the crossover table file ------------------------------------------------------------
def test_table_rows_and_the_writer(tmp_path):
    """summarize -> table_rows -> write_crossover_table: one row per (shape, state dtype, T) with
    the batches compared, the run's provenance, and what the engine's lookup then finds."""
    rows = []
    for b, (rep, leg) in {1: (12.0, 10.0), 2: (13.0, 12.0), 4: (14.0, 15.0), 8: (20.0, 30.0)}.items():
        rows += [_row(REPLAY, b, rep, T=2, shape="mamba2-2.7b"), _row(LEGACY, b, leg, T=2, shape="mamba2-2.7b")]
        rows += [_row(REPLAY, b, rep, T=6, shape="mamba2-2.7b", state="fp16"),
                 _row(LEGACY, b, rep + 1, T=6, shape="mamba2-2.7b", state="fp16")]
    rows.append(_row(REPLAY, 1, 5.0, T=16, shape="mamba2-2.7b"))  # T=16: legacy never timed, no row written
    summary = spec.summarize(rows, argparse.Namespace(accept_rate=0.6, device_name="stub GPU"))
    table = spec.table_rows(summary.records)
    assert table == [
        dict(heads=80, head_dim=64, state_size=128, state_dtype="fp32", tokens=2, crossover_batch=4,
             batches=[1, 2, 4, 8], shape="mamba2-2.7b", groups=1),
        dict(heads=80, head_dim=64, state_size=128, state_dtype="fp16", tokens=6, crossover_batch=1,
             batches=[1, 2, 4, 8], shape="mamba2-2.7b", groups=1),
    ]
    header = dict(device="NVIDIA H100 80GB HBM3", date="2026-11-25T01:00:00+00:00", git_commit="abcdef123456",
                  command="python -m fastmamba.bench spec --write-table t.json", torch="2.11", triton="3.6.0")
    path = tmp_path / "t.json"
    assert spec.write_crossover_table(summary.records, header, {"graph"}, path) == path
    (written,) = spec_policy.read_table(path)
    assert (written["gpu"], written["date"], written["commit"], written["command"]) == (
        header["device"], header["date"], "abcdef123456", header["command"])
    assert written["timing_mode"] == "graph" and written["rows"] == table
    e = spec_policy.lookup_table(80, 64, 128, "fp32", device_name="NVIDIA H100 80GB HBM3", path=path)
    assert e.exact and e.table == {2: 4}
    assert [choose_verify_path(b, 2, e.table) for b in (2, 4)] == ["legacy", "replay"]
    # interpreter times never go into the package's file; nothing to write is an error too
    with pytest.raises(ValueError, match="CPU \\(interpreter\\) times are no measurement"):
        spec.write_crossover_table(summary.records, header, {"cpu"}, None)
    with pytest.raises(ValueError, match="no \\(shape, state dtype, T\\) has both replay and legacy timed"):
        spec.write_crossover_table([r for r in summary.records if r["record"] != "spec_choice"], header, {"graph"})


# replay's and legacy's fake per-call µs by (T, batch): replay a flat 10 + B, legacy 4 B (T=2) or 6 B (T=3)
def _fake_us(provider: str, T: int, batch: int) -> float:
    return 10.0 + batch if provider == REPLAY else (4.0 if T == 2 else 6.0) * batch


def _fake_gpu_timing(monkeypatch):
    """The runner's timing of one provider on one case, with the real check, its time replaced
    by ``_fake_us`` and its mode by "graph" (as a GPU run would have it)."""
    from fastmamba.bench import kernels

    real = kernels._run_one

    def run_one(bench, case, prov, *args, **kwargs):
        fatal = real(bench, case, prov, *args, **kwargs)
        row = args[-1]
        if row.status == "ok":
            row.median_us = row.p20_us = row.p80_us = _fake_us(prov.name, case.params["T"], case.batch)
            row.mode = "graph"
        return fatal

    monkeypatch.setattr(kernels, "_run_one", run_one)


def _filtered_stand_ins(replay: ReplayFns):
    provs = _stand_ins(replay)
    return lambda self, device: [p for p in provs(self, device) if p.name in self.provider_names]


def test_write_table_end_to_end(monkeypatch, tmp_path, capsys):
    """``bench spec --write-table PATH`` with the references standing in for the ops and fake GPU
    times: replay and legacy only, the crossover per (state dtype, T) merged into PATH."""
    _needs_the_reference_commit()
    monkeypatch.setattr(SpecVerifyBench, "providers", _filtered_stand_ins(ReplayFns(REPLAY_REF, _commit_ref())))
    _fake_gpu_timing(monkeypatch)
    path = tmp_path / "table.json"
    spec_policy.write_table(spec_policy.new_set(  # an earlier run of this shape on another GPU stays
        [dict(heads=2, head_dim=16, state_size=16, state_dtype="fp32", tokens=2, crossover_batch=1)],
        gpu="other GPU", commit="0", command="c", date="2026-01-01"), path)
    rc, rows, records, _ = _run(["--tokens", "2,3", "--batch", "1,2,3,4", "--write-table", str(path)], tmp_path)
    assert rc == 0, [(r["provider"], r["check"], r["note"]) for r in rows if r["check"] != "ok"]
    assert {r["provider"] for r in rows} == {REPLAY, LEGACY} and all(r["check"] == "ok" for r in rows)
    assert {(r["dtype"], r["batch"], r["params"]["T"]) for r in rows} == {
        (d, b, T) for d in ("fp32/bf16", "fp16/bf16") for b in (1, 2, 3, 4) for T in (2, 3)}
    # replay wins from 10 + B < 4 B (B >= 4) at T=2 and 10 + B < 6 B (B >= 3) at T=3
    old, new = spec_policy.read_table(path)
    assert old["gpu"] == "other GPU"
    assert "bench spec --tokens 2,3" in new["command"] and f"--write-table {path}" in new["command"]
    assert new["gpu"] == rows[0]["device"] and new["commit"] == (rows[0]["git_commit"] or "unknown")
    assert {(r["state_dtype"], r["tokens"]): r["crossover_batch"] for r in new["rows"]} == {
        ("fp32", 2): 4, ("fp32", 3): 3, ("fp16", 2): 4, ("fp16", 3): 3}
    assert all(r["batches"] == [1, 2, 3, 4] and (r["heads"], r["head_dim"], r["state_size"]) == (2, 16, 16)
               for r in new["rows"])
    assert spec_policy.lookup_table(2, 16, 16, "bf16", device_name=new["gpu"], path=path).table == {2: 4, 3: 3}
    assert "crossover table: merged 4 row(s)" in capsys.readouterr().out


def test_write_table_refuses(monkeypatch, tmp_path, capsys):
    """No GPU and no PATH: the package's file is not touched; a failed check writes nothing."""
    package = spec_policy.default_table_path()
    before = package.read_bytes()
    assert cli.main(["bench", "spec", "--device", "cpu", "--write-table"]) == 2
    assert "CPU (interpreter) times are no measurement" in capsys.readouterr().err
    assert package.read_bytes() == before
    _needs_the_reference_commit()
    monkeypatch.setattr(SpecVerifyBench, "providers", _filtered_stand_ins(ReplayFns(_forgets_to_record, _commit_ref())))
    _fake_gpu_timing(monkeypatch)
    path = tmp_path / "table.json"
    rc, rows, _, _ = _run(["--tokens", "2", "--batch", "1", "--write-table", str(path)], tmp_path)
    assert rc == 1 and any(r["check"].startswith("FAIL") for r in rows)
    assert not path.exists() and "crossover table NOT written" in capsys.readouterr().out


@pytest.mark.gpu
def test_gpu_write_table(tmp_path):
    """On a GPU: the real ops, timed in CUDA graphs, one small case set written into a temporary
    table that the engine's lookup then reads (the TP=8 slice, T=2, fp32 state, batch 1 and 8)."""
    path = tmp_path / "table.json"
    out = tmp_path / "rows.jsonl"
    rc = cli.main(["bench", "spec", "--shapes", "nemotron-h-tp8", "--tokens", "2", "--state", "fp32", "--batch", "1,8",
                   "--quick", "--device", "cuda", "--json", str(out), "--write-table", str(path)])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines() if "record" not in json.loads(line)]
    assert {r["provider"] for r in rows} == {REPLAY, LEGACY} and all(r["mode"] == "graph" for r in rows)
    (written,) = spec_policy.read_table(path)
    assert written["gpu"] == torch.cuda.get_device_name() and written["timing_mode"] == "graph"
    (row,) = written["rows"]
    us = {(r["provider"], r["batch"]): r["median_us"] for r in rows}
    expected = next((b for b in (1, 8) if all(us[(REPLAY, c)] < us[(LEGACY, c)] for c in (1, 8) if c >= b)), None)
    assert (row["heads"], row["head_dim"], row["state_size"], row["tokens"]) == (16, 64, 128, 2)
    assert row["crossover_batch"] == expected and row["batches"] == [1, 8]
    entry = spec_policy.lookup_table(16, 64, 128, "fp32", device_name=torch.cuda.get_device_name(), path=path)
    assert entry.exact and entry.table == {2: expected}
