"""The ``spec`` target on the CPU: byte models, the batch-adaptive choice (the summary and
``choose_verify_path``), a wrong replay caught by the check, and an end-to-end run of the real
ops on a tiny shape under the interpreter that writes JSON rows and the choice records.

Run: ``TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/bench``. Timings here mean nothing.
"""
from __future__ import annotations

import argparse
import doctest
import json

import pytest
import torch

from fastmamba import cli
from fastmamba.bench import bytes as byte_models
from fastmamba.bench import report, spec, targets
from fastmamba.bench.ops._base import Provider, load_fastmamba
from fastmamba.bench.ops.spec_verify import LEGACY, LEGACY_NO_COPY, PLAIN, PROVIDERS, REPLAY, SpecVerifyBench
from fastmamba.generation import spec_policy
from fastmamba.generation.spec_policy import choose_verify_path, expected_tokens_per_step


# --- byte models against a hand count -------------------------------------------------------------------
def test_spec_bytes_hand_count():
    # B=2 T=3 H=2 P=4 N=5 G=1, fp32 state, bf16 activations and dt, k=1 replayed token
    common = dict(state_dtype=torch.float32, act_dtype=torch.bfloat16, dt_dtype=torch.bfloat16)
    state = 2 * 4 * 5 * 4  # 160 bytes per request
    inputs = 3 * (2 * 8 * 2 + 2 * 5 * 2 + 2 * 2)  # x, z; B, C; dt: 3 * 56 = 168
    per_head = 3 * 2 * 4  # A, D, dt_bias: 24
    replayed = 1 * (8 * 2 + 5 * 2 + 2 * 2 * 4)  # old_x, old_B, old_dt, old_cumA: 42
    recorded = 3 * (2 * 8 * 2 + 5 * 2 + 2 * 2 * 4)  # y, old_x, old_B, old_dt, old_cumA: 3 * 58 = 174
    replay = 2 * (2 * state + replayed + inputs + recorded + 3 * 4) + per_head
    assert byte_models.spec_replay_bytes(2, 3, 2, 4, 5, 1, accepted=1, **common) == replay == 1456
    # nothing to replay: the state is read, not written
    assert byte_models.spec_replay_bytes(2, 3, 2, 4, 5, 1, accepted=0, **common) == replay - 2 * (state + replayed)
    y = 3 * 8 * 2  # 48
    no_copy = 2 * ((2 + 3) * state + inputs + y + 4) + per_head
    assert byte_models.spec_legacy_bytes(2, 3, 2, 4, 5, 1, copy=False, **common) == no_copy == 2064
    assert byte_models.spec_legacy_bytes(2, 3, 2, 4, 5, 1, copy=True, **common) == no_copy + 2 * (2 * state + 16)


def test_case_bytes_are_the_smallest_provider_model():
    bench = SpecVerifyBench(tokens=(2, 16))
    cases = bench.cases(torch.device("cuda"), [1, 256])  # the GPU shapes, without allocating anything
    assert {c.params["T"] for c in cases} == {2, 16} and len(cases) == 2 * 2 * 2 * 2
    for case in cases:
        per_provider = {p: bench.provider_bytes(Provider(p, "ours", "", None), case) for p in PROVIDERS}
        assert case.nbytes == min(per_provider.values()) == per_provider[PLAIN]
        assert per_provider[LEGACY] > per_provider[LEGACY_NO_COPY] > per_provider[REPLAY]


# --- the batch-adaptive choice -------------------------------------------------------------------------
def test_choose_verify_path():
    assert spec_policy.DEFAULT_TABLE == {}  # placeholder until measured
    assert [choose_verify_path(b, 6) for b in (1, 7, 8, 256)] == ["legacy", "legacy", "replay", "replay"]
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


def _row(provider: str, batch: int, us: float, T: int = 6, check: str = "ok") -> report.Row:
    return report.Row(op="spec", title="t", shape="s", dims="H2 P16 N16 G1 T6", dtype="fp32/bf16", batch=batch,
                      provider=provider, kind="ours", version="v", bytes=1, mode="graph", median_us=us, check=check,
                      params={"T": T})


def test_summary_crossover_and_plain_choice():
    rows = []
    # replay loses at 1, wins at 8, loses at 32 (noise), then wins from 128 up: the crossover is 128
    for b, (rep, leg) in {1: (12.0, 10.0), 8: (20.0, 30.0), 32: (70.0, 60.0), 128: (200.0, 800.0)}.items():
        rows += [_row(REPLAY, b, rep), _row(LEGACY, b, leg), _row(LEGACY_NO_COPY, b, leg - 1), _row(PLAIN, b, 5.0)]
    rows.append(_row(REPLAY, 256, 1.0, check="FAIL y: wrong"))  # a failed check is no measurement
    rows.append(_row(LEGACY, 256, 900.0))
    summary = spec.summarize(rows, argparse.Namespace(accept_rate=0.6))
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
    low = spec.summarize(rows, argparse.Namespace(accept_rate=0.1)).records[0]["batch1"]
    assert low["plain_cheaper"] is True
    text = "\n".join(summary.lines)
    assert "Batch-adaptive choice" in text and "B>=128" in text and "256:—" in text


# --- command line ---------------------------------------------------------------------------------------
def test_spec_is_a_target_not_planned():
    assert "spec" in targets.TARGETS and "spec" not in targets.PLANNED


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "1,6"], "must be >= 2"),
    (["--accept-rate", "1.5"], "expected a number in [0, 1]"),
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


def _stand_ins(replay):
    """The op references as providers (fast on the CPU); ``replay`` in place of the replay op."""
    ssu_ref = load_fastmamba("state_update", "selective_state_update_ref", module="ref")
    provs = [Provider(REPLAY, "ours", "test", replay)]
    provs += [Provider(name, "peer", "test", ssu_ref) for name in (LEGACY, LEGACY_NO_COPY)]
    provs.append(Provider(PLAIN, "baseline", "test", ssu_ref))
    return lambda self, device: provs


def test_wrong_replay_is_reported_fail(monkeypatch, tmp_path):
    replay_ref = load_fastmamba("replay", "replay_selective_state_update_ref", module="ref")

    def forgets_to_store(state, *args, **kwargs):  # outputs right, the replayed state never stored
        return replay_ref(state.clone(), *args, **kwargs)

    monkeypatch.setattr(SpecVerifyBench, "providers", _stand_ins(forgets_to_store))
    rc, rows, records, _ = _run(["--batch", "2", "--tokens", "4"], tmp_path)
    assert rc == 1
    replay = [r for r in rows if r["provider"] == REPLAY]
    assert replay and all(r["check"].startswith("FAIL state:") for r in replay), [r["check"] for r in replay]
    assert all(r["check"] == "ok" for r in rows if r["provider"] != REPLAY)
    assert all(r["crossover_batch"] is None for r in records if r["record"] == "spec_choice")


def test_real_ops_end_to_end(tmp_path, capsys):
    rc, rows, records, md = _run(["--tokens", "2", "--accept-rate", "0.5"], tmp_path)
    assert rc == 0
    cases = {(r["dtype"], r["batch"]) for r in rows}
    assert cases == {(d, b) for d in ("fp32/bf16", "fp16/bf16") for b in (1, 2)}
    for case in cases:
        got = [r["provider"] for r in rows if (r["dtype"], r["batch"]) == case]
        assert got == list(PROVIDERS)
    for r in rows:
        assert r["status"] == "ok" and r["check"] == "ok" and r["mode"] == "cpu", r
        assert r["params"]["T"] == 2 and r["params"]["accepted"] == 1 and "bench spec" in r["command"]
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
    assert md.startswith("# fastmamba speculative verification benchmark") and "Batch-adaptive choice" in md
