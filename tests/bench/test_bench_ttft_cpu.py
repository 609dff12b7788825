"""bench ttft on the CPU: shape parsing, the floor, and one tiny run through the command line."""
from __future__ import annotations

import argparse
import json

import pytest

from fastmamba.bench import ttft


def test_shapes_parse_and_reject():
    assert ttft._shapes("1x16,8X2048") == [(1, 16), (8, 2048)]
    for bad in ("1x", "0x16", "a,b"):
        with pytest.raises(argparse.ArgumentTypeError):
            ttft._shapes(bad)


def test_floor_is_the_larger_of_bytes_and_flops():
    # 2 GB of weights at 2000 GB/s = 1 ms; 1e9 params x 1000 tokens x 2 / 1000 TFLOP/s = 2 ms
    assert ttft.floor_ms(2 * 10**9, 10**9, 1000, 2000.0, 1000.0) == pytest.approx(2.0)
    assert ttft.floor_ms(2 * 10**9, 10**9, 10, 2000.0, 1000.0) == pytest.approx(1.0)


def test_cpu_run_prints_a_row(tmp_path, capsys):
    from fastmamba.bench.targets import main

    out = tmp_path / "ttft.jsonl"
    import torch

    assert main(["ttft", "--model", "mamba2-tiny", "--shapes", "1x3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "# ttft: mamba2-tiny" in text and "1 x 3" in text
    row = json.loads(out.read_text().splitlines()[0])
    assert row["batch"] == 1 and row["length"] == 3 and row["eager_ms"] > 0 and row["floor_ms"] > 0
    if torch.cuda.is_available():
        assert row["graphed_ms"] > 0
    else:
        assert row["graphed_ms"] is None  # no GPU: eager only
