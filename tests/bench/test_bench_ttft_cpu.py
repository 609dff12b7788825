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
    from fastmamba.bench.prefill_floor import PrefillWork

    # 2 GB of weights at 2000 GB/s = 1 ms; 2e12 16-bit FLOPs at 1000 TFLOP/s = 2 ms, 2e12 FP8 FLOPs at
    # 2000 TFLOP/s = 1 ms more
    w = PrefillWork(weight_bytes=2 * 10**9, flops_16=2e12, flops_8=0.0, active_params=0)
    assert w.floor_ms(2000.0, 1000.0, None) == pytest.approx(2.0)
    assert PrefillWork(2 * 10**9, 2e10, 0.0, 0).floor_ms(2000.0, 1000.0, None) == pytest.approx(1.0)
    w8 = PrefillWork(2 * 10**9, 2e12, 2e12, 0)
    assert w8.floor_ms(2000.0, 1000.0, 2000.0) == pytest.approx(3.0)
    assert w8.floor_ms(2000.0, 1000.0, None) == pytest.approx(4.0)  # no FP8 rate: the 16-bit one


def _matrix_params(model, skip=("embeddings", "lm_head", "mtp.", "_scale")):
    """{name: numel} of the 2-D and 3-D (experts) weights, the conv's 3-D [C, 1, W] excluded."""
    return {n: p.numel() for n, p in model.named_parameters()
            if not any(k in n for k in skip) and (p.dim() == 2 or (p.dim() == 3 and ".experts." in n))}


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_prefill_work_counts_the_active_experts_and_the_last_positions_head(quantization):
    """Nemotron-3 tiny: the FLOPs count top_k of E routed experts per token, every other projection,
    the routers, and the LM head for the B last positions only; FP8 matrices in their own column;
    the bytes every expert top_k x T tokens can reach (all of them once T x top_k >= E)."""
    import torch

    import fastmamba
    from fastmamba.bench.e2e_bytes import moe_layers
    from fastmamba.bench.prefill_floor import prefill_work

    model = fastmamba.load_model("nemotron-3-tiny", dtype=torch.float32, device="cpu", quantization=quantization)
    moe = moe_layers(model)
    assert moe
    k, E = moe[0].cfg.top_k, moe[0].cfg.n_experts
    mats = _matrix_params(model)
    routed = sum(n for name, n in mats.items() if ".experts." in name and "shared" not in name)
    assert routed > 0
    active = sum(mats.values()) - routed + routed * k / E
    head = model.lm_head.weight.numel()
    B, L = 2, 5
    w = prefill_work(model, B, L)
    assert w.active_params == pytest.approx(active, abs=2)
    assert w.flops_16 + w.flops_8 == pytest.approx(2 * B * L * active + 2 * B * head)
    if quantization:  # the routed and shared experts and the Mamba / MLP projections: FP8
        fp8 = {n for n, p in model.named_parameters() if p.element_size() == 1}
        assert fp8 and w.flops_8 > 0
        fp8_active = sum(n * (k / E if ".experts." in name and "shared" not in name else 1)
                         for name, n in mats.items() if name in fp8)
        assert w.flops_8 == pytest.approx(2 * B * L * fp8_active)
    else:
        assert w.flops_8 == 0
    everything = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("mtp."))
    emb = model.backbone.embeddings.weight
    untied_rows = 0 if emb.data_ptr() == model.lm_head.weight.data_ptr() else (emb.shape[0] - B * L) * emb.shape[1]
    assert B * L * k >= E and w.weight_bytes == everything - untied_rows * emb.element_size()
    one = prefill_work(model, 1, 1)  # one token reaches top_k experts per layer only
    assert one.weight_bytes < w.weight_bytes


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


def test_cpu_run_of_an_fp8_moe_hybrid(tmp_path, capsys):
    """--quantization fp8 on the MoE hybrid: the row says so and carries its FP8 FLOPs and rates (on
    a GPU machine the bench runs on the GPU, where Hopper's FP8 GEMM rate is measured)."""
    import torch

    from fastmamba.bench.peak import measure_fp8_matmul_tflops
    from fastmamba.bench.targets import main

    out = tmp_path / "ttft.jsonl"
    assert main(["ttft", "--model", "nemotron-3-tiny", "--quantization", "fp8", "--shapes", "1x4", "--reps", "1",
                 "--json", str(out)]) == 0
    assert "FP8 weights" in capsys.readouterr().out
    row = json.loads(out.read_text().splitlines()[0])
    assert row["quantization"] == "fp8" and row["flops_8"] > 0 and row["flops_16"] > 0 and row["floor_ms"] > 0
    if not torch.cuda.is_available():
        assert row["fp8_matmul_tflops"] is None  # no FP8 GEMM on a CPU: the floor takes the 16-bit rate
    elif measure_fp8_matmul_tflops("cuda", n=256) is None:  # a GPU before compute capability 8.9
        assert row["fp8_matmul_tflops"] is None
    else:
        assert row["fp8_matmul_tflops"] > 0
