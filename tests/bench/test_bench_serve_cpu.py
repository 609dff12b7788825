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


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_cpu_load_test_runs(tmp_path, capsys, monkeypatch, client):
    """A CPU smoke run with each client. The CPU run switches to the reference ops for itself only:
    the interpreter setting of the calling process is restored (later tests in the same process
    run the kernels)."""
    import os

    import torch

    from fastmamba.bench.targets import main

    if torch.cuda.is_available():
        pytest.skip("a CPU smoke run (on a GPU the bench runs the 2.7b preset: python -m fastmamba.bench serve)")
    pytest.importorskip(client)

    out = tmp_path / "serve.jsonl"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main(["serve", "--requests", "3", "--concurrency", "2", "--prompt-len", "4", "--output-len", "3",
                 "--max-batch", "4", "--client", client, "--json", str(out)]) == 0
    assert os.environ.get("TRITON_INTERPRET") == "1"
    text = capsys.readouterr().out
    assert "| server (HTTP, streaming) |" in text and "| offline Engine.generate |" in text
    assert f"client {client};" in text
    row = json.loads(out.read_text())
    assert row["requests"] == 3 and row["server_tok_per_s"] > 0 and row["offline_tok_per_s"] > 0
    assert row["ttft_p50_ms"] > 0 and row["client"] == client
    assert "mean output tokens per request: server 3.0, offline 3.0" in text  # every token came through


def test_cpu_shared_prefix_run(tmp_path, capsys):
    """``--shared-prefix``: two servers (prefix cache on, off), prompts sharing a system prompt."""
    import torch

    from fastmamba.bench.targets import main

    if torch.cuda.is_available():
        pytest.skip("a CPU smoke run (on a GPU: python -m fastmamba.bench serve --shared-prefix 2048)")
    out = tmp_path / "prefix.jsonl"
    assert main(["serve", "--shared-prefix", "32", "--requests", "3", "--prompt-len", "4", "--output-len", "2",
                 "--max-batch", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| prefix cache on |" in text and "| prefix cache off |" in text
    row = json.loads(out.read_text())
    assert row["shared_prefix"] == 32 and row["off_over_on"] > 0


def test_cpu_shared_prefix_run_over_a_hybrid(tmp_path, capsys):
    """The same with the hybrid preset (paged K/V; its prefix cache keeps the K/V too): the prompts'
    ids lie within its vocabulary (ids past it would be refused with 400 and the run would fail)."""
    import torch

    from fastmamba.bench.serve import vocab_size
    from fastmamba.bench.targets import main

    if torch.cuda.is_available():
        pytest.skip("a CPU smoke run (on a GPU: python -m fastmamba.bench serve --shared-prefix 2048)")
    assert vocab_size("nemotron-h-tiny") == 256 and vocab_size("mamba2-2.7b") == 50288
    with pytest.raises(FileNotFoundError, match="neither a preset"):
        vocab_size(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text('{"vocab_size": "many"}')
    with pytest.raises(ValueError, match="`vocab_size` expected a positive int, got 'many'"):
        vocab_size(str(tmp_path))
    out = tmp_path / "prefix.jsonl"
    assert main(["serve", "--model", "nemotron-h-tiny", "--shared-prefix", "32", "--requests", "3",
                 "--prompt-len", "4", "--output-len", "2", "--max-batch", "2", "--json", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["model"] == "nemotron-h-tiny" and row["off_over_on"] > 0
