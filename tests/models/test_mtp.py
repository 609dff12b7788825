"""The MTP layer (fastmamba.models.mtp): config.json fields read and checked, a tiny Nemotron-3
checkpoint with mtp.* tensors (NVIDIA's per-expert names, transformers' fused form, a
``language_model.`` prefix) loads every tensor, a missing or misshaped one is named, a checkpoint
without MTP loads without the module and says so when drafter="mtp" is asked for; the presets."""
from __future__ import annotations

import json

import pytest
import torch

from fastmamba.generation.mtp_drafter import MTPDrafter
from fastmamba.models.mtp import mtp_pattern_of
from fastmamba.models.nemotron_h import PRESETS, NemotronHConfig, NemotronHLM, load_nemotron_h, random_init

safetensors = pytest.importorskip("safetensors.torch")

BASE = dict(model_type="nemotron_h", hidden_size=64, vocab_size=256, hybrid_override_pattern="M*EM-E",
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8,
            mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16, n_routed_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=64,
            routed_scaling_factor=2.5)
MTP = dict(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E")


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.mark.parametrize("fields, want", [
    ({}, ""),
    ({"num_nextn_predict_layers": 0}, ""),
    (MTP, "*E"),
    ({"num_nextn_predict_layers": 1, "mtp_layers_block_type": ["attention", "moe"]}, "*E"),
    ({**MTP, "mtp_layers_block_type": ["attention", "moe"]}, "*E"),
], ids=["absent", "zero", "pattern", "block-types", "both-agree"])
def test_config_fields(fields, want):
    assert mtp_pattern_of(fields) == want
    assert NemotronHConfig.from_dict({**BASE, **fields}).mtp_pattern == want


@pytest.mark.parametrize("fields, match", [
    ({"num_nextn_predict_layers": 2, "mtp_hybrid_override_pattern": "*E"}, "only one MTP layer"),
    ({"num_nextn_predict_layers": 1}, "names no MTP layer kinds"),
    ({**MTP, "mtp_layers_block_type": ["moe", "attention"]}, "disagrees"),
    ({"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "M*E"}, r"got \['M'\]"),
    ({"num_nextn_predict_layers": "1", "mtp_hybrid_override_pattern": "*E"}, "integer >= 0"),
    ({"num_nextn_predict_layers": 1, "mtp_layers_block_type": ["attention", "mamba"]}, "layer types"),
], ids=["two-layers", "no-kinds", "disagree", "mamba-kind", "string-count", "unknown-type"])
def test_config_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        NemotronHConfig.from_dict({**BASE, **fields})


def tiny_model(mtp: bool = True) -> NemotronHLM:
    cfg = PRESETS["nemotron-3-tiny-mtp"]
    if not mtp:
        cfg = PRESETS["nemotron-3-tiny"]
    m = random_init(NemotronHLM(cfg, device="cpu", dtype=torch.float32), seed=5).eval()
    with torch.no_grad():  # norms that are not all ones: a swapped norm shows
        for name, p in m.named_parameters():
            if name.endswith("norm.weight") or name.endswith("enorm.weight") or name.endswith("hnorm.weight"):
                p.uniform_(0.5, 1.5)
    return m


def write(tmp_path, model, fields, *, per_expert=True, prefix="", drop=(), reshape=(), no_mtp=False):
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if per_expert:  # NVIDIA's released layout for every MoE layer, the MTP's included
        for name in [n for n in sd if n.endswith("experts.up_proj") or n.endswith("experts.down_proj")]:
            t = sd.pop(name)
            base, proj = name.rsplit(".", 1)
            for e in range(t.shape[0]):
                sd[f"{base}.{e}.{proj}.weight"] = t[e].clone()
    sd = {(prefix + k if k.startswith("mtp.") else k): v for k, v in sd.items()}
    for n in drop:
        del sd[n]
    if no_mtp:
        sd = {k: v for k, v in sd.items() if not k.startswith("mtp.")}
    for n in reshape:
        sd[n] = sd[n][:-1].clone()
    safetensors.save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **fields}))
    return tmp_path


@pytest.mark.parametrize("per_expert, prefix", [(True, ""), (False, ""), (True, "language_model.")],
                         ids=["per-expert", "fused", "language_model-prefix"])
def test_checkpoint_round_trip(tmp_path, per_expert, prefix):
    model = tiny_model()
    names = [n for n in model.state_dict() if n.startswith("mtp.")]
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
            "mtp.layers.0.mixer.q_proj.weight", "mtp.layers.1.mixer.gate.weight",
            "mtp.layers.1.mixer.gate.e_score_correction_bias", "mtp.layers.1.mixer.experts.up_proj",
            "mtp.layers.1.final_layernorm.weight"} <= set(names)
    loaded = load_nemotron_h(write(tmp_path, model, MTP, per_expert=per_expert, prefix=prefix), device="cpu")
    assert loaded.cfg.mtp_pattern == "*E"
    want = model.state_dict()
    for n, t in loaded.state_dict().items():
        assert torch.equal(t, want[n]), n


@pytest.mark.parametrize("drop, reshape, match", [
    (("mtp.layers.0.eh_proj.weight",), (), r"missing from the checkpoint[\s\S]*mtp.layers.0.eh_proj.weight"),
    (("mtp.layers.1.mixer.experts.3.up_proj.weight",), (), r"mtp.layers.1.mixer.experts.3.up_proj.weight: missing"),
    ((), ("mtp.layers.0.hnorm.weight",), r"mtp.layers.0.hnorm.weight: expected \(64,\), got \(63,\)"),
], ids=["eh_proj-missing", "expert-missing", "hnorm-shape"])
def test_checkpoint_problems_named(tmp_path, drop, reshape, match):
    with pytest.raises(ValueError, match=match):
        load_nemotron_h(write(tmp_path, tiny_model(), MTP, drop=drop, reshape=reshape), device="cpu")


def test_config_with_mtp_checkpoint_without(tmp_path):
    """config.json names an MTP layer, the checkpoint has no mtp.* tensor (as transformers' save_pretrained
    writes it): the model loads without the layer, and drafter="mtp" says why."""
    from fastmamba.generation.engine import Engine

    base = tiny_model()
    model = load_nemotron_h(write(tmp_path, base, MTP, no_mtp=True), device="cpu")
    assert model.mtp is None and model.cfg.mtp_absent and model.cfg.mtp_pattern == ""
    with pytest.raises(ValueError, match="holds no mtp.* tensors"):
        Engine(model, max_batch=2, speculate=2, drafter="mtp", cuda_graphs=False)


def test_mtp_tensors_without_config_fields_are_unexpected(tmp_path):
    with pytest.raises(ValueError, match=r"unexpected in the checkpoint[\s\S]*mtp.layers"):
        load_nemotron_h(write(tmp_path, tiny_model(), {}), device="cpu")


def test_checkpoint_without_mtp_says_so(tmp_path):
    from fastmamba.generation.engine import Engine

    plain = load_nemotron_h(write(tmp_path, tiny_model(mtp=False), {}), device="cpu")
    assert plain.mtp is None and plain.cfg.mtp_pattern == ""
    with pytest.raises(ValueError, match="has no multi-token-prediction layer"):
        MTPDrafter(plain, 2)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        Engine(plain, max_batch=2, speculate=2, drafter="mtp", cuda_graphs=False)


def test_presets():
    nano, lightning = PRESETS["nemotron-3-nano"], PRESETS["nemotron-3-nano-mtp"]
    assert lightning.mtp_pattern == "*E" and nano.mtp_pattern == ""
    assert {k: v for k, v in vars(lightning).items() if k != "mtp_pattern"} == \
        {k: v for k, v in vars(nano).items() if k != "mtp_pattern"}
    with torch.device("meta"):
        m = NemotronHLM(lightning, device="meta", dtype=torch.bfloat16)
    mtp_params = sum(p.numel() for n, p in m.named_parameters() if n.startswith("mtp."))
    # eh_proj 2M x M, attention (Hq + 2 Hkv + Hq) Dh M, router E M, 128 experts 2 F M, shared 2 Fs M, 5 norms
    M, Dh, E, F, Fs = 2688, 128, 128, 1856, 3712
    want = 2 * M * M + (32 + 2 * 2 + 32) * Dh * M + E * M + E * 2 * F * M + 2 * Fs * M + 5 * M
    assert mtp_params == want
