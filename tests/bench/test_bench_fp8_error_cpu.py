"""``bench fp8-error`` (issue 52): per block of a tiny Nemotron-3, the FP8 kernels (here the Triton
interpreter) against the PyTorch references on the same input, FP8 against 16 bits, and the drift
of a whole run. The kernels run in the interpreter, so this needs TRITON_INTERPRET=1 (as CI sets)."""
from __future__ import annotations

import json

import pytest

from fastmamba.bench import targets
from fastmamba.ops._common.dispatch import interpreter_enabled

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="the kernels side needs TRITON_INTERPRET=1")


def test_fp8_error_tells_kernels_quantisation_and_drift_apart(tmp_path, capsys):
    path = tmp_path / "err.jsonl"
    argv = ["fp8-error", "--model", "nemotron-3-tiny", "--prompt-len", "9", "--dtype", "fp32", "--device", "cpu",
            "--json", str(path)]
    assert targets.main(argv) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    out = capsys.readouterr().out
    assert "| block | kind | fp32 kernels vs ref | FP8 kernels vs ref, 9 rows | FP8 kernels vs ref, 8 rows" in out
    assert [r["kind"] for r in rows] == list("M*EM-E") and [r["block"] for r in rows] == list(range(6))
    for r in rows:
        # the interpreter runs the kernels' own math: equal to the references up to fp32 summation order
        assert r["kernels_vs_ref_16bit"] < 1e-5, r
        assert all(r[f"kernels_vs_ref_fp8_{n}"] < 1e-4 for n in (9, 8, 1)), r
        if r["kind"] == "*":  # attention's projections stay in 16 bits: the same block on the same input
            assert r["fp8_vs_16bit"] < 1e-6, r
        else:  # e4m3 weights and activations: ~2^-4 relative per value, a few % over a block's sums
            assert 0.005 < r["fp8_vs_16bit"] < 0.2, r
        assert r["drift"] >= 0.0
        # the routers' choices in the two whole runs: a share for the MoE blocks, nothing for the others
        assert (0.0 <= r["experts_changed"] <= 1.0) if r["kind"] == "E" else r["experts_changed"] is None, r
    assert rows[0]["drift"] == pytest.approx(rows[0]["fp8_vs_16bit"], rel=1e-4, abs=1e-6)  # block 0: same input
    assert 0 < rows[0]["logit_rel_err"] < 0.5


def test_experts_changed_compares_sets_per_token():
    import torch

    from fastmamba.bench.fp8_error import experts_changed

    a = torch.tensor([[1, 2], [3, 4]])
    assert experts_changed(a, torch.tensor([[2, 1], [3, 4]])) == 0.0  # order within a token does not count
    assert experts_changed(a, torch.tensor([[1, 5], [6, 7]])) == 0.75


def test_fp8_error_rejects_a_bad_prompt_length(capsys):
    assert targets.main(["fp8-error", "--model", "nemotron-3-tiny", "--prompt-len", "0", "--device", "cpu"]) == 2
    assert "--prompt-len must be >= 1, got 0" in capsys.readouterr().err
