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


def test_bench_tp_runs_a_moe_hybrid(monkeypatch, capsys):
    """A hybrid preset takes the hybrid runner (paged K/V; it was the Mamba-2 one: an AttributeError)."""
    monkeypatch.setattr(tp_bench, "spawn_tp", lambda fn, world_size, *args, **kwargs: [fn(TPGroup.single("cpu"), *args)])
    assert targets.main(["tp", "--model", "nemotron-3-tiny", "--tp", "1", "--batch", "2", "--prompt-len", "5",
                         "--gen-len", "2", "--device", "cpu", "--require-equal"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln and not ln.startswith("#")]
    assert rows[1][:2] == ["1", "2"] and rows[1][-2] == "yes"


def test_collectives_per_layer_kind():
    """One all-reduce per layer; a Mamba layer whose norm spans the ranks (one B/C group) rides
    its sum of squares in out_proj's ([B, M + 1]), or reduces it on its own when not fused."""
    import dataclasses

    import torch

    from fastmamba.distributed.nemotron_h import build_tp_nemotron_h
    from fastmamba.models.nemotron_h import PRESETS

    cfg = dataclasses.replace(PRESETS["nemotron-3-tiny"], n_groups=1)
    tp = TPGroup(rank=0, world_size=2, device=torch.device("cpu"))
    for fuse, mamba in ((True, "fused"), (False, "separate")):
        model = build_tp_nemotron_h(cfg, tp, dtype=torch.float32, fuse_norm_reduce=fuse)
        kinds = [tp_bench._layer_collective(b) for b in model.backbone.layers]
        assert kinds == [mamba if c == "M" else "plain" for c in cfg.pattern]
