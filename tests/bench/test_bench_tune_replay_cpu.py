"""``tune --ops replay`` on the CPU: the replay configs' table and its lookup, the sweep's hooks and
cases, the paste-ready table, the sweep loop with stand-in timings, and the smoke run of the real
kernels under the interpreter.

Run: ``TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/bench``. Timings here mean nothing.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math

import pytest
import torch

from fastmamba import cli
from fastmamba.bench import targets, tune
from fastmamba.bench.ops.spec_verify import GPU_TOKENS, REPLAY, SpecVerifyBench
from fastmamba.ops.replay import configs
from fastmamba.ops.replay.configs import ReplayConfig, lookup, pick_config, table_key

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # cases only: nothing is allocated on it


def _pick(programs: int, t_pad: int, **kw) -> ReplayConfig:
    args = dict(programs_per_block=programs, headdim=64, dstate=128, t_pad=t_pad, interpreter=False)
    return pick_config(**{**args, **kw})


# --- the table and pick_config -------------------------------------------------------------------------
def test_table_entries_are_launchable_configs():
    assert configs.TABLE
    for (bucket, t_pad), cfg in configs.TABLE.items():
        assert bucket == triton_pow2(bucket) and t_pad in (16, 32, 64), (bucket, t_pad)
        assert isinstance(cfg, ReplayConfig)
        assert cfg.block_p in (16, 32, 64) and cfg.num_warps >= 1 and cfg.heads >= 1 and cfg.warps_pre >= 1


def triton_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def test_table_key_and_padded_tokens():
    assert [configs.padded_tokens(T) for T in (1, 2, 6, 16, 17, 33)] == [16, 16, 16, 16, 32, 64]
    assert table_key(programs_per_block=128 * 128, t_pad=16) == (16384, 16)
    assert table_key(programs_per_block=3 * 80, t_pad=32) == (256, 32)  # rounded up to a power of two


def _core(cfg: ReplayConfig) -> ReplayConfig:
    """The entry without the split path's output tile, which pick_config fills in from OUT_TILES."""
    return cfg._replace(out_block_p=None, out_warps=None)


def test_pick_config_reads_the_table(monkeypatch):
    table = {
        (16, 16): ReplayConfig(16, 1, 8, 4),
        (4096, 16): ReplayConfig(32, 4, 4, 2, split=True),
        (16, 32): ReplayConfig(64, 4, 2, 4),
    }
    monkeypatch.setattr(configs, "TABLE", table)
    assert _core(_pick(16, 16)) == table[(16, 16)]  # exact key
    assert _core(_pick(32 * 128, 16)) == table[(4096, 16)]
    assert _core(_pick(20000, 16)) == table[(4096, 16)]  # nearest bucket (log scale)
    assert _core(_pick(100, 16)) == table[(16, 16)]  # 128: 3 octaves from 16, 5 from 4096
    assert _core(_pick(8192, 32)) == table[(16, 32)]  # the only bucket at t_pad 32
    assert _core(_pick(8192, 64)) == configs._guess(64) == ReplayConfig(16, 1, 1, 4)  # beyond the table's t_pads
    # the split path's output tile follows the state dtype (OUT_TILES)
    assert _pick(4096, 16)[5:] == configs.OUT_TILES[4] == (64, 4)
    assert _pick(4096, 16, state_bytes=2)[5:] == configs.OUT_TILES[2]
    # the head dim clamps the P tiles; fp32 activations take the one-kernel path with block_p 64
    assert _core(_pick(16, 32, headdim=32)) == ReplayConfig(32, 4, 2, 4)
    assert _pick(4096, 16, headdim=16)[5] == 16
    assert _core(_pick(16, 16, act_bytes=4)) == ReplayConfig(64, 4, 8, 4)
    assert _core(_pick(4096, 16, act_bytes=4)) == ReplayConfig(64, 4, 4, 2)  # not split
    assert _core(_pick(16, 16, act_bytes=4, headdim=16)) == ReplayConfig(16, 4, 8, 4)
    # the interpreter's smallest tiles, and the sweep's forced config, come first
    assert _core(_pick(4096, 16, interpreter=True)) == ReplayConfig(16, 1, 4, 1)
    with configs.forced_config(block_p=64, num_warps=4, heads=16, warps_pre=2):
        assert _core(_pick(4096, 16)) == ReplayConfig(64, 4, 16, 2)
        assert _core(_pick(4096, 16, headdim=16, interpreter=True)) == ReplayConfig(16, 4, 16, 2)
    with configs.forced_config(block_p=16, num_warps=2, heads=8, split=True, out_block_p=32, out_warps=2):
        assert _pick(4096, 16) == ReplayConfig(16, 2, 8, 4, True, 32, 2)
    assert lookup(4096, 16, {}) == configs._guess(16)


def test_shipped_table_covers_every_sweep_case():
    """Every case of the GPU sweep looks up an entry of its own (the sweep's table replaces this one)."""
    bench = SpecVerifyBench()
    cases = bench.tune_cases(CUDA, [1, 8, 32, 128, 256])
    keys = {bench.tune_table_key(configs, c) for c in cases}
    assert keys <= set(configs.TABLE), sorted(keys - set(configs.TABLE))
    assert {t for _, t in keys} == {16}  # T <= 16 pads to 16 (the launcher's rule); t_pad 32 is T 17..32


# --- the sweep's hooks and cases -----------------------------------------------------------------------
def test_tune_accepts_replay():
    parser = targets.configure(argparse.ArgumentParser())
    args = parser.parse_args(["tune", "--ops", "replay"])
    assert args.ops == ["replay"] and args.batch is None and args.device == "auto"
    assert tune.DEFAULT_BATCHES["replay"] == (1, 8, 32, 128, 256)


def test_replay_sweep_hooks_and_cases():
    sweep = tune.plan_sweeps(["replay"], CPU)[0]
    assert not sweep.reason, sweep.reason
    assert sweep.configs is configs and sweep.provider.name == REPLAY
    gpu = sweep.bench.tune_cases(CUDA, [1, 8, 32, 128, 256])
    assert len(gpu) == 2 * 2 * len(GPU_TOKENS) * 5  # shapes x state dtypes x T x batch
    assert {c.shape for c in gpu} == {"nemotron-h", "nemotron-h-tp8"} and {c.params["T"] for c in gpu} == set(GPU_TOKENS)
    assert all(c.params["providers"] == (REPLAY,) for c in gpu)
    for case in gpu[:3]:
        assert sweep.bench.tune_candidates(configs, case) == configs.CANDIDATES
    cpu = sweep.bench.tune_cases(CPU, [1])
    assert [(c.shape, c.params["T"], c.batch) for c in cpu] == [("tiny", 2, 1)] * 2
    for case in cpu:
        candidates = sweep.bench.tune_candidates(configs, case)
        assert candidates == [configs.CANDIDATES[0], configs.CANDIDATES[-1]]
        for cand in candidates:
            with configs.forced_config(**cand):  # every field reaches the launcher's hook
                assert pick_config(programs_per_block=2, headdim=16, dstate=16, t_pad=16,
                                   interpreter=True).heads == cand["heads"]
    assert len({json.dumps(c, sort_keys=True) for c in configs.CANDIDATES}) == len(configs.CANDIDATES) == 10
    assert {c.get("split", False) for c in configs.CANDIDATES} == {False, True}


# --- the paste-ready table -----------------------------------------------------------------------------
def _result(bench, case, timings: dict[int, float], base: float) -> tune.CaseResult:
    return tune.CaseResult(case.label, base, [(us, configs.CANDIDATES[i]) for i, us in timings.items()],
                           key=bench.tune_table_key(configs, case))


def test_paste_ready_table_picks_the_best_geometric_mean():
    bench = SpecVerifyBench(tokens=[2, 6, 16])
    sweep = tune.Sweep("replay", bench, configs)
    cases = {(c.shape, c.params["T"], c.batch, c.dtype): c for c in bench.tune_cases(CUDA, [8, 128])}
    a, b = cases[("nemotron-h", 2, 128, "fp32/bf16")], cases[("nemotron-h", 6, 128, "fp32/bf16")]  # key (16384, 16)
    c = cases[("nemotron-h-tp8", 16, 8, "fp16/bf16")]  # key (128, 16)
    d = cases[("nemotron-h", 16, 8, "fp16/bf16")]  # key (1024, 16)
    results = [
        # config 0 is best on a, config 1 on b; config 1 is the better compromise (1.0 * 1.1 < 1.3 * 1.0)
        _result(bench, a, {0: 100.0, 1: 110.0, 2: 200.0}, base=120.0),
        _result(bench, b, {0: 130.0, 1: 100.0}, base=100.0),  # config 2 failed here: not eligible for the key
        _result(bench, c, {3: 50.0, 4: 40.0}, base=float("nan")),  # the default config failed
        _result(bench, d, {}, base=10.0),  # nothing ran: no entry
    ]
    lines = tune.paste_ready_table(sweep, results, "tune --ops replay")
    assert lines[0].startswith("# paste-ready TABLE for fastmamba.ops.replay.configs") and lines[-1] == "}"
    namespace = {"ReplayConfig": ReplayConfig}
    exec("\n".join(lines[1:]), namespace)  # valid Python, as it would be pasted
    table = namespace["TABLE"]
    assert set(table) == {(16384, 16), (128, 16)}
    assert table[(16384, 16)] == ReplayConfig(**configs.CANDIDATES[1])
    assert table[(128, 16)] == ReplayConfig(**configs.CANDIDATES[4])
    entry = next(ln for ln in lines if ln.lstrip().startswith("(16384, 16)"))
    assert f"2 cases: {math.sqrt(1.1):.3f}x of each case's best (worst 1.10x), default config" in entry
    assert "nemotron-h T2 fp32/bf16 b=128" in entry
    assert "default config failed" in next(ln for ln in lines if ln.lstrip().startswith("(128, 16)"))


# --- the sweep loop and the CPU smoke run ---------------------------------------------------------------
def test_tune_sweep_loop_with_stand_in_timings(monkeypatch, tmp_path, capsys):
    """The whole loop on the CPU with stand-in timings: every config is tried, the best is reported
    per case, and the table comes out paste-ready."""
    monkeypatch.setattr(tune, "interpreter_enabled", lambda: True)
    times = iter(range(10**6, 0, -1))  # every config faster than the one before: the last one wins
    monkeypatch.setattr(tune, "_time", lambda *args: float(next(times)))
    out = tmp_path / "tune.jsonl"
    rc = cli.main(["bench", "tune", "--ops", "replay", "--device", "cpu", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    cases = SpecVerifyBench().tune_cases(CPU, [1])
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert len(lines) == len(cases) * 2 and {ln["case"] for ln in lines} == {c.label for c in cases}
    for case in cases:
        row = next(ln for ln in printed.splitlines() if ln.startswith(case.label))
        assert row.endswith(str(configs.CANDIDATES[-1]))
    assert "smoke run under the Triton interpreter" in printed
    table = printed[printed.index("TABLE: dict"):]
    assert f"(2, 16): {ReplayConfig(**configs.CANDIDATES[-1])!r},  # 2 cases" in table
    assert all(ln["key"] == [2, 16] for ln in lines)
    # the same table from the JSON file, without timing anything (split sweeps are merged this way)
    assert cli.main(["bench", "tune", "--ops", "replay", "--table-from", str(out)]) == 0
    again = capsys.readouterr().out
    assert again[again.index("TABLE: dict"):] == table.rstrip("\n") + "\n"


def test_an_interrupted_tune_still_prints_the_cases_it_finished(monkeypatch, capsys):
    """gpu_session.sh cuts a sweep with `timeout -s INT`: the cases done before the interrupt still
    give their rows and a paste-ready table; the case cut short gives none."""
    monkeypatch.setattr(tune, "interpreter_enabled", lambda: True)
    cases = SpecVerifyBench().tune_cases(CPU, [1])
    assert len(cases) >= 2
    times = iter(range(10**6, 0, -1))
    monkeypatch.setattr(tune, "_time", lambda *args: float(next(times)))
    sweep_case, started = tune._sweep_case, []

    def cut_at_the_second_case(*args, **kwargs):
        started.append(args[1].label)
        if len(started) == 2:
            raise KeyboardInterrupt  # as SIGINT arrives in the middle of a case
        return sweep_case(*args, **kwargs)

    monkeypatch.setattr(tune, "_sweep_case", cut_at_the_second_case)
    assert cli.main(["bench", "tune", "--ops", "replay", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert "[tune] interrupted: the tables below hold the cases finished before it" in captured.err
    rows = [ln for ln in captured.out.splitlines() if ln.startswith("spec ")]
    assert [r.split("  ")[0] for r in rows] == [cases[0].label]
    assert "TABLE: dict" in captured.out and "# 1 case" in captured.out


def test_table_from_several_files(tmp_path, capsys):
    """Two parts of a split sweep share a key: the table weighs the cases of both."""
    def line(case, cfg, us, default):
        return json.dumps({"case": case, "config": configs.CANDIDATES[cfg], "us": us, "default_us": default,
                           "key": [128, 16]}) + "\n"

    tp8, full = "spec nemotron-h-tp8 T6 fp32/bf16 b=8", "spec nemotron-h T6 fp32/bf16 b=1"
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(line(tp8, 0, 10.0, 20.0) + line(tp8, 1, 12.0, 20.0))  # the default config: 2x the best on both
    b.write_text(line(full, 0, 30.0, 40.0) + line(full, 1, 20.0, 40.0)
                 + json.dumps({"case": "spec other", "config": {}, "us": 1.0}) + "\n")  # no key: ignored
    assert cli.main(["bench", "tune", "--ops", "replay", "--table-from", f"{a},{b}"]) == 0
    printed = capsys.readouterr().out
    entry = next(ln for ln in printed.splitlines() if ln.lstrip().startswith("(128, 16)"))
    # config 1: 1.2 and 1.0 of the best (geomean 1.095) beats config 0: 1.0 and 1.5 (1.225)
    assert entry.lstrip().startswith(f"(128, 16): {ReplayConfig(**configs.CANDIDATES[1])!r},  # 2 cases")
    assert "default config 2.00x" in entry
    assert cli.main(["bench", "tune", "--ops", "replay,ssu", "--table-from", str(a)]) == 2
    assert "needs exactly one op" in capsys.readouterr().err


@pytest.mark.parametrize("argv, interpreter, message", [
    (["--ops", "replay,ssu", "--device", "cpu"], True, "only a smoke run of --ops replay under TRITON_INTERPRET=1; not ssu"),
    (["--ops", "replay", "--device", "cpu"], False, "set TRITON_INTERPRET=1"),
    (["--ops", "replay", "--device", "cuda"], True, "--device cuda, but torch sees no CUDA device"),
])
def test_tune_refuses_what_the_cpu_cannot_do(argv, interpreter, message, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(tune, "interpreter_enabled", lambda: interpreter)
    assert cli.main(["bench", "tune", *argv]) == 2
    assert message in capsys.readouterr().err


def _new_replay_api() -> str:
    try:
        importlib.import_module("fastmamba.ops.replay").default_history  # noqa: B018
    except (ImportError, AttributeError) as exc:
        return f"the history-based replay API has not landed yet ({exc})"
    return ""


def test_tune_replay_smoke_run_with_the_real_kernels(tmp_path, capsys):
    """``tune --ops replay`` on the CPU: the real kernels under the interpreter, forced configs."""
    if _new_replay_api():
        pytest.skip(_new_replay_api())
    from fastmamba.ops._common.dispatch import interpreter_enabled

    if not interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (the smoke run times the interpreted kernels)")
    out = tmp_path / "tune.jsonl"
    rc = cli.main(["bench", "tune", "--ops", "replay", "--device", "cpu", "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert len(lines) == 2 * 2, captured.err  # 2 cases (fp32, fp16 state) x 2 configs, none failed
    assert all(ln["us"] > 0 and math.isfinite(ln["default_us"]) for ln in lines)
    assert "TABLE: dict[tuple[int, int], ReplayConfig] = {" in captured.out and "(2, 16): ReplayConfig(" in captured.out
