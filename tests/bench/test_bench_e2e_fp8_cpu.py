"""``bench e2e --quantization fp8`` (issue 52): the model is loaded with ``quantization="fp8"``, the
rows say so, and a step's bytes count the 1-byte weights. Timings here mean nothing."""
from __future__ import annotations

import json

import pytest

import fastmamba
from fastmamba.bench import targets


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the bench's bookkeeping, not kernels: the PyTorch references


def _rows(tmp_path, name, extra):
    path = tmp_path / f"{name}.jsonl"
    argv = ["e2e", "--model", "nemotron-3-tiny", "--batch", "1", "--gen-len", "2", "--prompt-len", "4",
            "--json", str(path), *extra]
    assert targets.main(argv) == 0
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_e2e_quantization_fp8_loads_fp8_and_counts_its_bytes(tmp_path, monkeypatch, capsys):
    seen = []
    load = fastmamba.load_model

    def spy(*args, **kwargs):
        seen.append(kwargs.get("quantization"))
        return load(*args, **kwargs)

    monkeypatch.setattr(fastmamba, "load_model", spy)
    (plain,) = _rows(tmp_path, "plain", [])
    (fp8,) = _rows(tmp_path, "fp8", ["--quantization", "fp8"])
    assert seen == [None, "fp8"]
    assert "FP8 weights" in capsys.readouterr().out
    assert plain["quantization"] is None and fp8["quantization"] == "fp8"
    # the experts' and projections' weights are read as 1-byte floats (attention and lm_head stay 16/32-bit)
    assert 0 < fp8["step_bytes"] < plain["step_bytes"]
    assert fp8["decode_tok_s"] > 0


def test_e2e_quantization_rejects_unknown_scheme(capsys):
    with pytest.raises(SystemExit) as exc:
        targets.main(["e2e", "--model", "nemotron-3-tiny", "--quantization", "int4"])
    assert exc.value.code == 2
    assert "--quantization" in capsys.readouterr().err
