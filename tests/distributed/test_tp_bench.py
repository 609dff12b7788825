"""``fastmamba bench tp`` on a CPU without spawning (each TP size's group replaced by an in-process
TP=1 rank): the table, the JSON rows and --require-equal. The spawned path and the collectives-only
timing run in the shared TP=2 group (``_workers.tp_check``) and on 2 GPUs (test_tp_gpu.py)."""
from __future__ import annotations

import json

import pytest

import fastmamba.bench.tp as tp_bench
from fastmamba.bench import targets
from fastmamba.distributed import TPGroup


def test_bench_tp_table_and_json(tmp_path, monkeypatch, capsys):
    calls = []

    def in_process(fn, world_size, *args, **kwargs):
        calls.append(world_size)
        return [fn(TPGroup.single("cpu"), *args)]

    monkeypatch.setattr(tp_bench, "spawn_tp", in_process)
    out = tmp_path / "rows.jsonl"
    assert targets.main(["tp", "--model", "mamba2-tiny", "--tp", "1,1", "--batch", "1,3", "--prompt-len", "5",
                         "--gen-len", "3", "--device", "cpu", "--json", str(out), "--require-equal"]) == 0
    assert calls == [1, 1]
    text = capsys.readouterr().out
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert lines[0].split()[:4] == ["tp", "batch", "tok/s", "ms/step"]
    assert len(lines) == 1 + 4  # two TP sizes x two batches
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["batch"] for r in rows] == [1, 3, 1, 3]
    assert all(r["same_tokens"] and r["logit_rel_err"] == 0.0 and r["ms_per_step"] > 0 for r in rows)


def test_bench_tp_refuses_before_spawning(monkeypatch, capsys):
    monkeypatch.setattr(tp_bench, "spawn_tp", lambda *a, **k: (_ for _ in ()).throw(AssertionError("spawned")))
    with pytest.raises(ValueError, match=r"fastmamba.bench.tp: cannot shard 8 heads \(nheads=8\) over world size 3"):
        targets.main(["tp", "--model", "mamba2-tiny", "--tp", "1,3", "--device", "cpu"])
