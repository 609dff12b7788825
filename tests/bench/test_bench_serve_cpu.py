"""bench serve on the CPU: a real server subprocess, a few streaming requests, the offline engine."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def test_percentile():
    from fastmamba.bench.serve import percentile

    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([1.0, 2.0], 0.99) == pytest.approx(1.99)


def test_cpu_load_test_runs(tmp_path, capsys):
    from fastmamba.bench.targets import main

    out = tmp_path / "serve.jsonl"
    assert main(["serve", "--requests", "3", "--concurrency", "2", "--prompt-len", "4", "--output-len", "3",
                 "--max-batch", "4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| server (HTTP, streaming) |" in text and "| offline Engine.generate |" in text
    row = json.loads(out.read_text())
    assert row["requests"] == 3 and row["server_tok_per_s"] > 0 and row["offline_tok_per_s"] > 0
    assert row["ttft_p50_ms"] > 0
