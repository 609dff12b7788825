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


def test_mamba_ssm_model_config_mirrors_ours():
    """The peer model is built to our config's shape: every Mamba-2 field carried over, the fused
    path (causal-conv1d's CUDA extension) off, the vocabulary not padded again."""
    from fastmamba.bench.peers import mamba_ssm_model_kwargs
    from fastmamba.models.config import PRESETS

    cfg = PRESETS["mamba2-2.7b"]
    kw = mamba_ssm_model_kwargs(cfg)
    assert (kw["d_model"], kw["n_layer"], kw["vocab_size"], kw["d_intermediate"]) == (2560, 64, cfg.vocab_size, 0)
    ssm = kw["ssm_cfg"]
    assert ssm["layer"] == "Mamba2" and not ssm["use_mem_eff_path"]
    assert (ssm["d_state"], ssm["headdim"], ssm["ngroups"], ssm["chunk_size"], ssm["expand"], ssm["d_conv"]) == \
        (cfg.d_state, cfg.headdim, cfg.ngroups, cfg.chunk_size, cfg.expand, cfg.d_conv)
    assert kw["pad_vocab_size_multiple"] == 1 and kw["tie_embeddings"] == cfg.tie_embeddings


def test_peer_is_reported_where_it_cannot_run(capsys):
    """On a CPU (mamba_ssm's launchers need CUDA) and for a hybrid (mamba_ssm has none), --peer
    says why in the header and the run goes on without the columns."""
    import torch

    import fastmamba
    from fastmamba.bench.targets import main

    if torch.cuda.is_available():
        pytest.skip("the CPU run's report (on a GPU the peer runs: python -m fastmamba.bench ttft --peer)")
    assert main(["ttft", "--model", "mamba2-tiny", "--shapes", "1x3", "--peer"]) == 0
    text = capsys.readouterr().out
    assert "# peer: mamba_ssm unavailable: GPU only" in text and "mamba_ssm ms" not in text
    hybrid = fastmamba.load_model("nemotron-h-tiny", dtype=torch.float32, device="cpu")
    assert ttft.load_peer(hybrid, torch.device("cpu")) == (None, "mamba_ssm has no NemotronHLM")


def test_peer_model_takes_our_weights():
    """Where mamba_ssm imports (its pure-Python wheel, einops, transformers): its model of our tiny
    config has exactly our parameters under its names (the embedding renamed), so both run the
    same weights."""
    import torch

    import fastmamba
    from fastmamba.bench import peers

    peer = peers.mamba_ssm_lm_head_model()
    if not peer.available:
        pytest.skip(f"mamba_ssm does not import here ({peer.reason})")
    ours = fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cpu")
    lm = peer.fn(ours.cfg, "cpu", torch.float32)
    state = {k.replace("backbone.embeddings.", "backbone.embedding."): v for k, v in ours.state_dict().items()}
    missing, unexpected = lm.load_state_dict(state, strict=False)
    assert missing == [] and unexpected == []
    assert torch.equal(lm.lm_head.weight, ours.lm_head.weight)


def test_cpu_run_of_a_hybrid(tmp_path, capsys):
    """A hybrid runs through bench ttft (each prefill on fresh slots, given back and taken again
    outside the timing: its K/V pages would otherwise grow with every prefill)."""
    from fastmamba.bench.targets import main

    out = tmp_path / "ttft.jsonl"
    assert main(["ttft", "--model", "nemotron-h-tiny", "--shapes", "2x5", "--reps", "3", "--json", str(out)]) == 0
    assert "# ttft: nemotron-h-tiny" in capsys.readouterr().out
    row = json.loads(out.read_text().splitlines()[0])
    assert row["batch"] == 2 and row["length"] == 5 and row["eager_ms"] > 0


def test_median_runs_setup_before_every_call_untimed():
    calls = []
    ms = ttft._median_ms(lambda: calls.append("fn"), 3, False, warmup=2, setup=lambda: calls.append("setup"))
    assert calls == ["setup", "fn"] * 5 and ms >= 0
