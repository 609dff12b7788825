"""bench chunked on the CPU (reference ops): the table and one JSON row per budget."""
from __future__ import annotations

import json

import pytest


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # scheduling and timing plumbing, not kernels


def test_cpu_run(tmp_path, capsys):
    from fastmamba.bench.targets import main

    out = tmp_path / "chunked.jsonl"
    assert main(["chunked", "--model", "mamba2-tiny", "--running", "2", "--prompt-len", "12", "--budgets", "none,4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| none (whole prompt) |" in text and "| 4 |" in text
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["budget"] for r in rows] == [None, 4]
    assert all(r["long_ttft_ms"] > 0 and r["itl_p99_ms"] >= r["itl_p50_ms"] > 0 for r in rows)


def test_cpu_run_with_the_prefix_cache(tmp_path, capsys):
    from fastmamba.bench.targets import main

    out = tmp_path / "chunked.jsonl"
    assert main(["chunked", "--model", "mamba2-tiny", "--running", "2", "--prompt-len", "40", "--budgets", "16",
                 "--prefix-cache-gb", "0.01", "--json", str(out)]) == 0
    assert "prefix cache 0.01 GiB" in capsys.readouterr().out
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["prefix_cache_gb"] == 0.01 and row["long_ttft_ms"] > 0


@pytest.mark.parametrize("bad", ["-1", "lots", "nan"])
def test_bad_prefix_cache_size_is_refused(bad, capsys):
    from fastmamba.bench.targets import main

    with pytest.raises(SystemExit):
        main(["chunked", "--prefix-cache-gb", bad])
    assert "expected GiB >= 0" in capsys.readouterr().err
