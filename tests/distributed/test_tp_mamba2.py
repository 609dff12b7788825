"""Tensor parallelism of Mamba2LM on CPUs (gloo): TP=2 and TP=3 equal TP=1.

Each spawning test starts its ranks once and checks everything on them: prefill, decode and packed
prefill logits (fp32, relative error <= 1e-5), the ranks' logits identical, the engine's greedy
outputs, and the safetensors loader reading only the rank's slices (bytes counted independently
here from the sizes). Shapes:
  TP=2  mamba2-tiny (H=8 heads, G=1 group: B/C replicated, the gated norm all-reduces), tied
        embeddings, a sharded checkpoint (index + 2 files, Hugging Face names)
  TP=3  H=6, G=3 (groups split, norm local), V=256 (86/85/85 rows: uneven), untied lm_head,
        in_proj/out_proj biases (out_proj's added once), state-spaces names
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import fastmamba
from fastmamba.distributed import TPGroup, check_tp, load_tp_model, spawn_tp
from fastmamba.models.config import Mamba2Config
from fastmamba.models.loader import random_init
from fastmamba.models.mamba2_lm import Mamba2LM
from tests.distributed._cases import inputs as _inputs, reference as _reference, save as _save, \
    state_spaces_config as _state_spaces_config
from tests.distributed._workers import run_model, tp_check
from tests.helpers import scaled_tiny_model

RTOL = 1e-5
UNEVEN = Mamba2Config(d_model=48, n_layer=2, vocab_size=256, d_state=8, headdim=16, ngroups=3, chunk_size=16,
                      proj_bias=True, tie_embeddings=False)


def _expected_bytes(cfg: Mamba2Config, world: int, rank: int) -> int:
    """fp32 bytes rank ``rank`` must read, from the sizes alone: per layer its heads' share of z, x,
    dt, conv x channels, A_log/dt_bias/D, norm and out_proj, its groups' B/C (all of them when
    G == 1), the replicated norms; its vocab rows of the embeddings (and of an untied lm_head)."""
    M, H, P, N, G, W, V = cfg.d_model, cfg.nheads, cfg.headdim, cfg.d_state, cfg.ngroups, cfg.d_conv, cfg.vocab_size
    Hl = H // world
    Gl = G // world if G % world == 0 else G
    Dl, E = Hl * P, Hl * P + 2 * Gl * N
    per_layer = M  # block norm
    per_layer += (2 * Dl + 2 * Gl * N + Hl) * M  # in_proj rows
    per_layer += E * W + (E if cfg.conv_bias else 0)  # conv
    per_layer += 3 * Hl + Dl  # dt_bias, A_log, D, gated-norm weight
    per_layer += M * Dl  # out_proj columns
    if cfg.proj_bias:
        per_layer += 2 * Dl + 2 * Gl * N + Hl  # in_proj bias
        per_layer += M if rank == 0 else 0  # out_proj bias: rank 0 reads it, the others hold zeros
    rows = V // world + (rank < V % world)
    total = cfg.n_layer * per_layer + M + rows * M * (1 if cfg.tie_embeddings else 2)
    return 4 * total


def _check_ranks(results, ref_logits, ref_greedy, cfg, world):
    for res in results:
        for j, (want, got) in enumerate(zip(ref_logits, res["logits"])):
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err <= RTOL, f"rank {res['rank']}, call {j}: relative error {err:.2e}"
            torch.testing.assert_close(got, results[0]["logits"][j], rtol=0, atol=0)  # every rank samples the same
        for j, (want, got) in enumerate(zip(ref_logits, res.get("unfused_logits", []))):
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err <= RTOL, f"rank {res['rank']} (norm's own all-reduce), call {j}: relative error {err:.2e}"
        for j, (want, got) in enumerate(zip(ref_logits, res["file_logits"])):
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err <= RTOL, f"rank {res['rank']} (loaded from files), call {j}: relative error {err:.2e}"
        assert res["greedy"] == ref_greedy
        assert f"ranks [{world - 1}] generated other tokens than rank 0" in res["divergence_caught"]
        assert res["greedy_spec"] == ref_greedy  # speculative decoding (verify + replay per rank)
        expected = _expected_bytes(cfg, world, res["rank"])
        assert res["file_bytes_read"] == expected
        # what it holds is exactly what it read (plus, off rank 0, the zeros of out_proj's bias)
        zero_bias = 4 * cfg.n_layer * cfg.d_model if cfg.proj_bias and res["rank"] else 0
        assert res["local_bytes"] == expected + zero_bias
    full = results[0]["file_checkpoint_bytes"]
    assert full == 4 * sum(p.numel() for p in Mamba2LM(cfg, device="meta").parameters())
    for res in results:  # about 1/world of the checkpoint: less than half of it at TP=2 ...
        assert res["file_bytes_read"] < full / world * 1.15
    # ... and the ranks together read the whole checkpoint once plus the replicated tensors only
    replicated = cfg.n_layer * cfg.d_model + cfg.d_model
    if cfg.ngroups % world:
        G, N, M, W = cfg.ngroups, cfg.d_state, cfg.d_model, cfg.d_conv
        replicated += cfg.n_layer * (2 * G * N * (M + W + (1 if cfg.conv_bias else 0)))
    assert sum(r["file_bytes_read"] for r in results) == full + 4 * (world - 1) * replicated


def test_tp2_replicated_groups_equal_tp1(tp2_run):
    """The shared TP=2 run (conftest.py ``tp2_run``): Mamba2LM checks."""
    run = tp2_run
    results = run["results"]
    assert all(len(r["unfused_logits"]) == len(run["ref_logits"]) for r in results)
    assert all(r["coll_ms"] > 0 for r in results)
    _check_ranks(results, run["ref_logits"], run["ref_greedy"], run["cfg"], 2)


def _uneven_model() -> Mamba2LM:
    model = random_init(Mamba2LM(UNEVEN, device="cpu", dtype=torch.float32), seed=3).eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in model.backbone.layers:
            m = layer.mixer
            m.in_proj.weight.mul_(10)
            m.conv1d.weight.mul_(10)
            m.out_proj.weight.mul_(300)
            m.in_proj.bias.copy_(torch.randn(m.in_proj.bias.shape, generator=g))
            m.out_proj.bias.copy_(torch.randn(m.out_proj.bias.shape, generator=g))
            m.norm.weight.copy_(1 + 0.5 * torch.randn(m.norm.weight.shape, generator=g))
    return model


def test_tp3_split_groups_uneven_vocab_equal_tp1(tmp_path):
    model = _uneven_model()
    prompts, steps, prompt_lists = _inputs(UNEVEN.vocab_size, 2)
    ref_logits, ref_greedy = _reference(model, prompts, steps, prompt_lists, 5)
    _save(tmp_path / "ckpt", model, shards=1, state_spaces=True)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    results = spawn_tp(tp_check, 3, UNEVEN, sd, str(tmp_path / "ckpt"), prompts, steps, prompt_lists, 5,
                       device="cpu", timeout_s=240)
    _check_ranks(results, ref_logits, ref_greedy, UNEVEN, 3)


def test_tp1_group_is_the_whole_model(tmp_path):
    """world size 1 (no process group): the sharded modules are the identity and every byte is read."""
    model = _uneven_model()
    _save(tmp_path / "ckpt", model, shards=1, state_spaces=False)
    loaded = load_tp_model(tmp_path / "ckpt", TPGroup.single("cpu"))
    assert loaded.load_stats.bytes_read == loaded.load_stats.checkpoint_bytes
    prompts, steps, _ = _inputs(UNEVEN.vocab_size, 5)
    for want, got in zip(run_model(model, prompts, steps)["logits"], run_model(loaded, prompts, steps)["logits"]):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=0)


@pytest.mark.parametrize("cfg, world, match", [
    (fastmamba.models.config.PRESETS["mamba2-tiny"], 3, r"nheads=8.*world size 3"),
    (UNEVEN, 2, r"ngroups=3.*world size 2.*nheads=6"),
    (Mamba2Config(d_model=64, n_layer=1, vocab_size=64, d_state=8, headdim=16, ngroups=2), 4,
     r"ngroups=2.*world size 4"),
])
def test_bad_combinations_fail_before_loading(tmp_path, cfg, world, match):
    """Refused before a weight is read: the weight file here is garbage, so reading it would fail
    with another message."""
    with pytest.raises(ValueError, match=match):
        check_tp(cfg, world)
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(_state_spaces_config(cfg)))
    (root / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"load_tp_model: .*" + match):
        load_tp_model(root, TPGroup(rank=world - 1, world_size=world, device=torch.device("cpu")))


def test_supported_combinations_pass_check():
    check_tp(UNEVEN, 3)  # groups split
    check_tp(fastmamba.models.config.PRESETS["mamba2-tiny"], 2)  # ngroups=1 replicated
    check_tp(fastmamba.models.config.PRESETS["mamba2-tiny"], 8)  # one head per rank
    check_tp(Mamba2Config(d_model=64, n_layer=1, vocab_size=64, d_state=8, headdim=16, ngroups=4), 2)


def test_checkpoint_problems_fail_before_reading(tmp_path):
    """A missing tensor and a misshaped one are both named, and nothing is copied (rank 1 of 2: the
    loader needs no process group until the model runs)."""
    model = scaled_tiny_model("cpu")
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    del sd["backbone.layers.1.mixer.A_log"]
    sd["backbone.layers.0.mixer.conv1d.weight"] = sd["backbone.layers.0.mixer.conv1d.weight"][:-1].contiguous()
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(_state_spaces_config(model.cfg)))
    save_file(sd, str(root / "model.safetensors"))
    with pytest.raises(ValueError, match=r"nothing was read") as info:
        load_tp_model(root, TPGroup(rank=1, world_size=2, device=torch.device("cpu")))
    msg = str(info.value)
    assert "missing from the checkpoint: backbone.layers.1.mixer.A_log" in msg
    assert "backbone.layers.0.mixer.conv1d.weight: expected (160, 1, 4), got (159, 1, 4)" in msg


def test_rank_reads_only_its_bytes_in_process(tmp_path):
    """Each rank's byte count from the files, without a process group: rank r of 2 and of 4 (one
    group replicated, 8 heads), tied embeddings."""
    model = scaled_tiny_model("cpu")
    _save(tmp_path / "ckpt", model, shards=2, state_spaces=False)
    for world in (2, 4):
        for rank in range(world):
            tp = TPGroup(rank=rank, world_size=world, device=torch.device("cpu"))
            loaded = load_tp_model(tmp_path / "ckpt", tp)
            assert loaded.load_stats.bytes_read == _expected_bytes(model.cfg, world, rank)
            assert sum(p.nbytes for p in loaded.parameters()) == loaded.load_stats.bytes_read
            mixer = loaded.backbone.layers[0].mixer
            P = model.cfg.headdim
            h0 = rank * (8 // world)
            torch.testing.assert_close(mixer.A_log, model.backbone.layers[0].mixer.A_log[h0:h0 + 8 // world])
            # the x rows of in_proj: rows d_inner + h0*P ... of the full matrix
            D = model.cfg.d_inner
            full = model.backbone.layers[0].mixer.in_proj.weight
            Dl = D // world
            torch.testing.assert_close(mixer.in_proj.weight[Dl:2 * Dl], full[D + h0 * P:D + h0 * P + Dl])
