"""Tensor parallelism from checkpoint directories written by transformers' ``save_pretrained``, for
every model family (Mamba-2, Nemotron-H): 2 gloo ranks, each reading only its slices of the
safetensors file, give TP=1's greedy tokens; ``fastmamba generate --model NEMOTRON_DIR --tp 2``
prints TP=1's ids; the process group is freed on exit (no gloo thread left behind)."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

PROMPTS = [[5, 17, 60, 3, 44], [9, 2], [70, 71, 72, 10, 11, 12, 1]]
MAX_NEW = 5


@pytest.fixture(scope="module")
def checkpoint_dirs(tmp_path_factory):
    from tests.distributed._checkpoints import save_mamba2, save_nemotron_h

    root = tmp_path_factory.mktemp("tp_dirs")
    return {"mamba2": save_mamba2(root / "mamba2"), "nemotron_h": save_nemotron_h(root / "nemotron_h")}


def _tp1_greedy(path: str) -> list[list[int]]:
    import fastmamba
    from tests.distributed._workers import greedy

    return greedy(fastmamba.load_model(path, device="cpu"), PROMPTS, MAX_NEW)


def test_tp2_from_checkpoint_dirs_equals_tp1(checkpoint_dirs):
    from fastmamba.distributed import spawn_tp
    from tests.distributed._workers import tp_dirs_greedy

    families = list(checkpoint_dirs)
    want = [_tp1_greedy(checkpoint_dirs[f]) for f in families]
    results = spawn_tp(tp_dirs_greedy, 2, [checkpoint_dirs[f] for f in families], PROMPTS, MAX_NEW, device="cpu",
                       timeout_s=300)
    for res in results:
        for i, family in enumerate(families):
            assert res["greedy"][i] == want[i], f"{family}, rank {res['rank']}"
            # each rank reads its slices: well under the whole file (norms and biases are replicated)
            assert res["bytes_read"][i] < 0.7 * res["checkpoint_bytes"][i], (family, res["rank"])
        assert res["gloo_threads_after_destroy"] == [], f"rank {res['rank']}: the destroyed group left threads"


def test_generate_cli_nemotron_h_dir_tp2(checkpoint_dirs, capfd):
    from fastmamba.cli import main

    argv = ["generate", "--model", checkpoint_dirs["nemotron_h"], "--prompt-ids", "5,17,60,3",
            "--max-new-tokens", "5", "--device", "cpu", "--ignore-eos"]
    assert main(argv) == 0
    single = capfd.readouterr().out.split()
    assert main(argv + ["--tp", "2"]) == 0
    tp2 = capfd.readouterr()
    assert len(single) == 5 and tp2.out.split() == single
    assert "tp 2]" in tp2.err
