"""CPU smoke run of the small-L scan experiment (fastmamba/bench/ops/scan_small_l.py) at a tiny shape."""
from __future__ import annotations

import json

import torch

from fastmamba.bench.ops import scan_small_l


def test_scan_small_l_tiny_runs_both_paths_and_checks_them(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        import pytest

        pytest.skip("the GPU run is the experiment itself (python -m fastmamba.bench.ops.scan_small_l)")
    monkeypatch.setattr(scan_small_l, "sweep_configs", lambda L, P: [dict(block_t=16, block_p=16, num_warps=1)])
    path = tmp_path / "rows.jsonl"
    rows = scan_small_l.main(["--tiny", "--shapes", "2x5", "--quick", "--sweep", "--json", str(path)])
    (row,) = rows
    assert (row["B"], row["L"]) == (2, 5)
    # the fused path ran and agrees with the chunked path (fp32 on the interpreter)
    assert row["out_rel_err"] < 1e-5 and row["state_rel_err"] < 1e-5
    assert row["fused_us"] > 0 and row["chunked_us"] > 0 and row["fused_mode"] == "cpu"
    assert row["best"]["block_t"] == 16 and row["best"]["us"] > 0
    written = [json.loads(line) for line in path.read_text().splitlines()]
    assert written[0]["B"] == 2 and written[0]["state_dtype"] == "fp32"


def test_sweep_configs_fit_the_sequence():
    short = scan_small_l.sweep_configs(16, 64)
    assert {c["block_t"] for c in short} == {16}
    assert {c["block_p"] for c in short} == {16, 32, 64}
    # blocks of at most fused_configs.MAX_BLOCK_T (32) tokens: 64 faulted on an H200
    assert {c["block_t"] for c in scan_small_l.sweep_configs(512, 64)} == {16, 32}
