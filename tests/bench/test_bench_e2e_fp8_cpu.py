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
    fp8, logits = _rows(tmp_path, "fp8", ["--quantization", "fp8"])
    assert seen == [None, "fp8", None]  # the 16-bit model for the logits, loaded once the FP8 one is done
    out = capsys.readouterr().out
    assert "FP8 weights" in out and "# FP8 vs 16-bit logits (same weights, the last 16 positions" in out
    # FP8 rounding of weights and activations moves the logits (e4m3: ~2^-4 relative per value), a little
    assert logits["provider"] == "FP8 vs 16-bit logits" and 2 ** -12 < logits["rel_err_norm"] < 0.5

    assert logits["rel_err_norm"] <= logits["rel_err_max"] * 4 and logits["quantization"] == "fp8"
    assert plain["quantization"] is None and fp8["quantization"] == "fp8"
    # the experts' and projections' weights are read as 1-byte floats (attention and lm_head stay 16/32-bit)
    assert 0 < fp8["step_bytes"] < plain["step_bytes"]
    assert fp8["decode_tok_s"] > 0


def test_fp8_logit_error_names_the_reference_models_dtype():
    import torch

    from fastmamba.bench.e2e_runs import fp8_logit_error, last_logits

    ids = torch.randint(0, 256, (1, 20))
    fp8 = fastmamba.load_model("nemotron-3-tiny", device="cpu", dtype=torch.bfloat16, quantization="fp8")
    row = fp8_logit_error(last_logits(fp8, ids), lambda: fastmamba.load_model("nemotron-3-tiny", device="cpu",
                                                                               dtype=torch.bfloat16), ids, torch.device("cpu"))
    assert row["dtype_16bit"] == "torch.bfloat16"  # the model's, not its logits' (fp32 either way)
    assert row["positions"] == 16 and 0 < row["rel_err_norm"] < 0.5


def test_e2e_quantization_rejects_unknown_scheme(capsys):
    with pytest.raises(SystemExit) as exc:
        targets.main(["e2e", "--model", "nemotron-3-tiny", "--quantization", "int4"])
    assert exc.value.code == 2
    assert "--quantization" in capsys.readouterr().err


def test_e2e_fp8_logits_say_why_when_the_16bit_model_does_not_load(tmp_path, monkeypatch, capsys):
    """A 16-bit model that does not fit (Super's 247 GB) gives a row that says so; the run succeeds."""
    load = fastmamba.load_model

    def only_fp8(*args, **kwargs):
        if not kwargs.get("quantization"):
            raise ValueError("preset 'x' takes 230.4 GiB of weights (bfloat16), more than the 139.0 GiB free")
        return load(*args, **kwargs)

    monkeypatch.setattr(fastmamba, "load_model", only_fp8)
    fp8, logits = _rows(tmp_path, "fp8", ["--quantization", "fp8"])
    assert fp8["decode_tok_s"] > 0 and logits["skipped"].startswith("the 16-bit model does not load here: preset")
    assert "# FP8 vs 16-bit logits: not measured: the 16-bit model does not load here" in capsys.readouterr().out
