"""``bench e2e --drift``: the logits' drift of 16-bit states from an fp32-state run (CPU smoke test on
the tiny preset with a few tokens), and the state-dtype options of ``bench e2e``."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from fastmamba.bench import e2e
from tests.helpers import scaled_tiny_model


def test_drift_rows():
    model = scaled_tiny_model("cpu")
    prompts = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    variants = [(torch.float32, False), (torch.float16, False), (torch.bfloat16, True)]
    rows = e2e.run_drift(model, prompts, 2, variants, device=torch.device("cpu"))
    assert [(r["ssm_dtype"], r["stochastic_rounding"]) for r in rows] == [("fp32", False), ("fp16", False),
                                                                            ("bf16", True)]
    fp32, fp16, bf16_sr = rows
    # the same state dtype as the reference: no drift at all
    assert fp32["max_rel_err"] == 0.0 and fp32["first_argmax_diff"] is None and fp32["argmax_diffs"] == 0
    for r in (fp16, bf16_sr):
        assert r["batch"] == 2 and r["tokens"] == 2
        assert 0.0 < r["mean_rel_err"] <= r["max_rel_err"] < 0.5  # a rounding of the state, not garbage
        assert r["first_argmax_diff"] is None or 0 <= r["first_argmax_diff"] < 2
    assert bf16_sr["max_rel_err"] > fp16["max_rel_err"]  # 8 mantissa bits against 11


def _parse(argv):
    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    return parser.parse_args(argv)


def test_state_variants_and_flags():
    a = _parse(["--drift", "1024", "--ssm-dtype", "fp16,bf16"])
    assert e2e.state_variants(a.ssm_dtype, a.stochastic_rounding, a.drift) == [
        (torch.float32, False), (torch.float16, False), (torch.float16, True), (torch.bfloat16, False),
        (torch.bfloat16, True)]
    a = _parse(["--ssm-dtype", "fp32,bf16", "--stochastic-rounding"])
    assert e2e.state_variants(a.ssm_dtype, a.stochastic_rounding, a.drift) == [(torch.float32, False),
                                                                               (torch.bfloat16, True)]
    assert e2e.state_variants(["fp32"], False, 0) == [(torch.float32, False)]
    with pytest.raises(ValueError, match="--stochastic-rounding rounds 16-bit states"):
        e2e.state_variants(["fp32"], True, 0)
    with pytest.raises(ValueError, match="--drift compares 16-bit states with fp32"):
        e2e.state_variants(["fp32"], False, 8)
    with pytest.raises(SystemExit):
        _parse(["--ssm-dtype", "fp8"])
    assert e2e.step_bytes(scaled_tiny_model("cpu"), 2, torch.float16) < e2e.step_bytes(scaled_tiny_model("cpu"), 2)


def test_bench_e2e_drift_command(tmp_path, capsys, monkeypatch):
    """The command's wiring: which runs it makes, the tables and the JSON rows (the runs themselves
    are stubbed: a real one costs minutes under the CPU interpreter; ``test_drift_rows`` runs one)."""
    from fastmamba.cli import main

    timed, drifted = [], []

    def fake_batch(model, batch, prompt_len, gen_len, *, ssm_dtype, stochastic_rounding, record, **kw):
        timed.append((batch, ssm_dtype, stochastic_rounding))
        return {"batch": batch, "prefill_s": 1.0, "prefill_tok_s": 1.0, "ms_per_step": 2.0, "decode_tok_s": 5.0,
                "step_bytes": e2e.step_bytes(model, batch, ssm_dtype),
                "ssm_dtype": e2e.state_label(ssm_dtype, False), "stochastic_rounding": stochastic_rounding}

    def fake_drift(model, prompts, n_tokens, variants, *, device, pdl=None):
        drifted.append((prompts.shape[0], n_tokens, list(variants)))
        return [{"ssm_dtype": e2e.state_label(d, False), "stochastic_rounding": sr, "batch": prompts.shape[0],
                 "tokens": n_tokens, "max_rel_err": 0.0 if d == torch.float32 else 0.01, "mean_rel_err": 0.0,
                 "first_argmax_diff": None, "argmax_diffs": 0} for d, sr in variants]

    monkeypatch.setattr(e2e, "run_batch", fake_batch)
    monkeypatch.setattr(e2e, "run_drift", fake_drift)
    out = tmp_path / "rows.jsonl"
    assert main(["bench", "e2e", "--drift", "5", "--ssm-dtype", "fp16,bf16", "--batch", "2", "--json", str(out)]) == 0
    variants = [(torch.float32, False), (torch.float16, False), (torch.float16, True), (torch.bfloat16, False),
                (torch.bfloat16, True)]
    assert timed == [(2, d, sr) for d, sr in variants]
    assert drifted == [(e2e.DRIFT_BATCH, 5, variants)]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["provider"] for r in rows] == ["fastmamba", "fastmamba [fp16 state]", "fastmamba [fp16 SR state]",
                                             "fastmamba [bf16 state]", "fastmamba [bf16 SR state]"] + \
        ["fastmamba drift"] * 5
    printed = capsys.readouterr().out
    assert "logits drift from an fp32-state run" in printed and "bf16 SR" in printed
    assert main(["bench", "e2e", "--stochastic-rounding"]) == 2  # fp32 only: nothing to round
