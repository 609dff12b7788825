"""``fastmamba generate --tp 2`` on CPUs: spawns two gloo ranks, rank 0 alone prints, same ids as --tp 1."""
from __future__ import annotations

from fastmamba.cli import main


def _ids(out: str) -> list[int]:
    return [int(t) for t in out.split()]


def test_generate_tp2_prints_once_and_equals_tp1(capfd):
    argv = ["generate", "--model", "mamba2-tiny", "--prompt-ids", "5,17,200,3,99", "--max-new-tokens", "6",
            "--device", "cpu", "--dtype", "fp32", "--ignore-eos"]
    assert main(argv) == 0
    single = capfd.readouterr()
    assert main(argv + ["--tp", "2"]) == 0
    tp2 = capfd.readouterr()
    assert len(_ids(single.out)) == 6
    assert _ids(tp2.out) == _ids(single.out)  # printed by rank 0 only: not twice
    assert "tp 2]" in tp2.err and tp2.err.count("tok/s") == 1


def test_generate_tp_refuses_bad_world_size_before_loading(capfd):
    # mamba2-tiny has 8 heads: 3 ranks cannot split them; refused before any process starts
    assert main(["generate", "--model", "mamba2-tiny", "--prompt-ids", "1,2", "--max-new-tokens", "2",
                 "--device", "cpu", "--tp", "3"]) == 2
    err = capfd.readouterr().err
    assert "fastmamba generate --tp: cannot shard 8 heads (nheads=8) over world size 3" in err
