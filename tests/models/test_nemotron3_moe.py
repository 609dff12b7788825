"""Nemotron-3 MoE hybrids (pattern letter ``E``): logits equal transformers' NemotronHForCausalLM
(fp32, relative error <= 1e-4) on tiny random checkpoints written by save_pretrained with all four
layer kinds, several experts, top-k > 1, a shared expert, grouped selection and a latent projection;
a checkpoint with NVIDIA's per-expert tensor names loads to the same logits; decode equals the full
forward; bad configs and tensors get errors naming the field or tensor; the presets have the
published shapes."""
from __future__ import annotations

import json

import pytest
import torch

from fastmamba.models.nemotron_h import PRESETS, NemotronHConfig, NemotronHLM, load_nemotron_h
from fastmamba.ops._common.dispatch import interpreter_enabled
from tests.helpers import seeded, tol
from tests.models.test_nemotron_h import hf_norm_is_grouped
# autouse fixtures shared with the dense model's tests: the ops run their PyTorch references (the
# kernels have their own tests) and transformers runs its plain PyTorch path
from tests.models.test_nemotron_h import hf_plain_torch_path, reference_ops  # noqa: F401

transformers = pytest.importorskip("transformers")
FP32 = tol(torch.float32)
INTERPRETER_AT_START = interpreter_enabled()  # Triton reads TRITON_INTERPRET once, at import
VOCAB = 96
PATTERN = "M*E-ME"  # every kind; two MoE layers

# one base case, then rows that each change one thing
CASES = {
    "E8-top2": dict(),
    "E8-top3-groups2": dict(num_experts_per_tok=3, n_group=2, topk_group=1),
    "E8-top2-latent24": dict(moe_latent_size=24),
    "E6-top3-latent24-groups3of2-bias": dict(n_routed_experts=6, num_experts_per_tok=3, n_group=3, topk_group=2,
                                             moe_latent_size=24, mlp_bias=True, norm_topk_prob=False),
}


def hf_config(**change):
    kw = dict(vocab_size=VOCAB, hidden_size=48, hybrid_override_pattern=PATTERN, num_attention_heads=4,
              num_key_value_heads=2, head_dim=12, intermediate_size=40, mamba_num_heads=4, mamba_head_dim=16,
              n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=8, layer_norm_epsilon=1e-5,
              n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=20,
              moe_shared_expert_intermediate_size=28, n_group=1, topk_group=1, norm_topk_prob=True,
              routed_scaling_factor=2.5, eos_token_id=3)
    kw.update(change)
    return transformers.NemotronHConfig(**kw)


def tiny_hf(path, seed: int = 0, **change):
    """A random tiny NemotronHForCausalLM with MoE layers, saved with save_pretrained. Larger weights
    than the default init so every layer moves the logits; the router weight and selection bias
    (zero in transformers' init) get random values so the top-k is decided, not a tie."""
    torch.manual_seed(seed)
    model = transformers.NemotronHForCausalLM(hf_config(**change)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight") or name.endswith(".D"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("gate.weight"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif p.dim() >= 2:
                p.copy_(torch.randn_like(p) * 0.1)
            elif name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def grouped_norm():
    if not hf_norm_is_grouped():
        pytest.skip(f"transformers {transformers.__version__} normalises the gated norm over all groups; "
                    "grouped parity needs a newer one")


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def hf_pair(request, grouped_norm, tmp_path_factory):
    hf, path = tiny_hf(tmp_path_factory.mktemp("moe") / "hf", **CASES[request.param])
    return hf, load_nemotron_h(path, device="cpu"), path


def prompts_of(lengths, seed):
    g = seeded(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def cu_of(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def assert_rel_close(got, want, rel=1e-4):
    """max |got - want| <= rel * max |want| (the issue's relative error), and the elementwise fp32 check."""
    err = (got - want).abs().max() / want.abs().max()
    assert err <= rel, f"relative error {err:.2e} > {rel:g}"
    torch.testing.assert_close(got, want, **FP32)


def test_config_reads_the_moe_fields(hf_pair):
    hf, ours, _ = hf_pair
    c, h = ours.cfg, hf.config
    assert c.pattern == PATTERN and c.layers_of("E") == [2, 5]
    assert (c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.moe_shared_expert_intermediate_size,
            c.moe_latent_size, c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor) == (
        h.n_routed_experts, h.num_experts_per_tok, h.moe_intermediate_size, h.moe_shared_expert_intermediate_size,
        h.moe_latent_size, h.n_group, h.topk_group, h.norm_topk_prob, h.routed_scaling_factor)
    moe = ours.backbone.layers[2].mixer
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(moe.gate.e_score_correction_bias, hf.model.layers[2].mixer.gate.e_score_correction_bias)
    assert c.eos_token_ids == (3,)


def test_logits_match_transformers(hf_pair):
    hf, ours, _ = hf_pair
    lengths = (1, 6, 13)
    prompts = prompts_of(lengths, 0)
    cache = ours.new_cache(3, max_seq_len=32, page_size=4)
    last = ours.prefill_varlen(torch.cat(prompts), cu_of(lengths), cache, cache.alloc(3))
    for b, p in enumerate(prompts):
        want = hf_logits(hf, p[None])
        assert_rel_close(ours(p[None]), want)
        assert_rel_close(last[b], want[0, -1])


def test_routing_is_not_degenerate(hf_pair):
    """The random router spreads tokens: across a prompt every MoE layer uses most of its experts,
    so the parity above covers experts with tokens and (per step) experts without."""
    hf, ours, _ = hf_pair
    ids = prompts_of([40], 1)[0]
    seen = {}
    for i in ours.cfg.layers_of("E"):
        hf_moe = hf.model.layers[i].mixer
        hooks = hf_moe.gate.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[2].unique()))
        hf_logits(hf, ids[None])
        hooks.remove()
        assert seen[i].numel() >= ours.cfg.n_routed_experts // 2


def test_decode_equals_full_forward(hf_pair):
    _, ours, _ = hf_pair
    ids = prompts_of([11], 2)[0]
    full = ours(ids[None])[0]
    cache = ours.new_cache(2, max_seq_len=16, page_size=4)
    cache.alloc(1)
    slots = cache.alloc(1)  # slot 1: not the first slot
    got = [ours.prefill(ids[None, :5], cache, slots)[0]]
    for t in range(5, 11):
        got.append(ours.decode(ids[t:t + 1], cache, slots)[0])
    torch.testing.assert_close(torch.stack(got), full[4:], **FP32)


def per_expert(sd):
    """The state dict with NVIDIA's per-expert names (``mixer.experts.{e}.up_proj.weight`` [F, M'],
    ``down_proj.weight`` [M', F]); fused 3-D tensors are split."""
    out = {}
    for name, t in sd.items():
        if name.endswith(("mixer.experts.up_proj", "mixer.experts.down_proj")):
            base, proj = name.rsplit(".", 1)
            for e in range(t.shape[0]):
                out[f"{base}.{e}.{proj}.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def fused(sd):
    """The state dict with transformers' fused 3-D ``mixer.experts.up_proj`` [E, F, M'] / ``down_proj``."""
    import re

    out, groups = {}, {}
    for name, t in sd.items():
        m = re.fullmatch(r"(.*mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight", name)
        if m:
            groups.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = t
        else:
            out[name] = t
    for name, by_id in groups.items():
        out[name] = torch.stack([by_id[e] for e in range(len(by_id))])
    return out


def rewrite(src_dir, dst_dir, form, edit=None):
    """A copy of the checkpoint in ``src_dir`` with its experts in ``form`` (per_expert or fused),
    ``edit(state_dict)`` applied; returns the state dict written."""
    from safetensors.torch import load_file, save_file

    dst_dir.mkdir()
    sd = form(load_file(str(src_dir / "model.safetensors")))
    if edit is not None:
        edit(sd)
    save_file(sd, str(dst_dir / "model.safetensors"))
    for f in ("config.json", "generation_config.json"):
        if (src_dir / f).is_file():
            (dst_dir / f).write_text((src_dir / f).read_text())
    return sd


@pytest.mark.parametrize("form", [per_expert, fused], ids=["per-expert", "fused-3d"])
def test_both_expert_forms_load_the_same(hf_pair, tmp_path, form):
    """NVIDIA's per-expert names (what transformers 5.25's save_pretrained writes too) and
    transformers' fused in-memory form load to the same weights and logits."""
    _, ours, path = hf_pair
    sd = rewrite(path, tmp_path / "ckpt", form)
    E = ours.cfg.n_routed_experts
    if form is per_expert:
        assert f"backbone.layers.2.mixer.experts.{E - 1}.down_proj.weight" in sd
    else:
        assert tuple(sd["backbone.layers.2.mixer.experts.down_proj"].shape)[0] == E
    again = load_nemotron_h(tmp_path / "ckpt", device="cpu")
    for (name, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    ids = prompts_of([7], 3)[0][None]
    assert torch.equal(again(ids), ours(ids))


@pytest.fixture(scope="module")
def base_dir(grouped_norm, tmp_path_factory):
    _, path = tiny_hf(tmp_path_factory.mktemp("moe_base") / "hf")
    return path


@pytest.mark.parametrize("edit,message", [
    (lambda sd: sd.pop("backbone.layers.2.mixer.experts.5.up_proj.weight"),
     "backbone.layers.2.mixer.experts.5.up_proj.weight: missing (n_routed_experts=8)"),
    (lambda sd: sd.__setitem__("backbone.layers.5.mixer.experts.8.down_proj.weight",
                               sd["backbone.layers.5.mixer.experts.0.down_proj.weight"].clone()),
     "backbone.layers.5.mixer.experts.8.down_proj.weight: unexpected, expert id >= n_routed_experts=8"),
    (lambda sd: sd.__setitem__("backbone.layers.2.mixer.experts.3.down_proj.weight", torch.zeros(48, 19)),
     "backbone.layers.2.mixer.experts.3.down_proj.weight: expected (48, 20) (as expert 0), got (48, 19)"),
    (lambda sd: sd.__setitem__("backbone.layers.2.mixer.experts.up_proj", torch.zeros(8, 20, 48)),
     "backbone.layers.2.mixer.experts.up_proj: the checkpoint holds it both fused and per expert"),
], ids=["expert-missing", "expert-id-too-large", "expert-misshaped", "both-forms"])
def test_bad_expert_tensors_name_the_tensor(base_dir, tmp_path, edit, message):
    rewrite(base_dir, tmp_path / "bad", per_expert, edit)
    with pytest.raises(ValueError, match="per-expert MoE tensors do not fit") as e:
        load_nemotron_h(tmp_path / "bad", device="cpu")
    assert message in str(e.value)


def test_bad_fused_tensors_name_the_tensor(base_dir, tmp_path):
    def edit(sd):
        sd["backbone.layers.2.mixer.experts.up_proj"] = sd["backbone.layers.2.mixer.experts.up_proj"][:7].clone()
        sd.pop("backbone.layers.5.mixer.gate.e_score_correction_bias")
        sd["backbone.layers.5.mixer.gate.weight"] = sd["backbone.layers.5.mixer.gate.weight"][:, :40].clone()

    d = tmp_path / "bad"
    rewrite(base_dir, d, fused, edit)
    with pytest.raises(ValueError) as e:
        load_nemotron_h(d, device="cpu")
    msg = str(e.value)
    assert "backbone.layers.2.mixer.experts.up_proj: expected (8, 20, 48), got (7, 20, 48)" in msg
    assert "backbone.layers.5.mixer.gate.weight: expected (8, 48), got (8, 40)" in msg
    assert "backbone.layers.5.mixer.gate.e_score_correction_bias" in msg and "missing" in msg


BASE = dict(model_type="nemotron_h", hidden_size=48, vocab_size=96, hybrid_override_pattern="M*E",
            num_attention_heads=4, num_key_value_heads=2, head_dim=12, mamba_num_heads=4, mamba_head_dim=16,
            n_groups=2, ssm_state_size=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=20,
            moe_shared_expert_intermediate_size=28)


@pytest.mark.parametrize("change,field", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok"),
    (dict(n_routed_experts=0), "n_routed_experts"),
    (dict(n_group=3), "n_group"),
    (dict(n_group=2, topk_group=3), "topk_group"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok"),
    (dict(moe_intermediate_size=20.5), "moe_intermediate_size"),
    (dict(moe_shared_expert_intermediate_size=0), "moe_shared_expert_intermediate_size"),
    (dict(moe_latent_size=0), "moe_latent_size"),
    (dict(n_shared_experts=0), "n_shared_experts"),
    (dict(norm_topk_prob="true"), "norm_topk_prob"),
    (dict(routed_scaling_factor="2.5"), "routed_scaling_factor"),
    (dict(routed_scaling_factor=-1.0), "routed_scaling_factor"),
    (dict(mlp_hidden_act="silu"), "mlp_hidden_act"),
    (dict(num_local_experts=16), "num_local_experts"),
    (dict(hybrid_override_pattern=None, layers_block_type=["mamba", "moe", "bogus"]), "layers_block_type"),
    (dict(layer_types=["mamba", "attention", "mlp"]), "layer_types"),
    (dict(eos_token_id=96), "eos_token_id"),
    (dict(eos_token_id="2"), "eos_token_id"),
    (dict(max_position_embeddings=0), "max_position_embeddings"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_config_names_the_field(change, field):
    with pytest.raises(ValueError, match=f"NemotronHConfig: .*{field}"):
        NemotronHConfig.from_dict({**BASE, **change})


def test_config_pattern_sources_agree():
    a = NemotronHConfig.from_dict(BASE)
    b = NemotronHConfig.from_dict({**{k: v for k, v in BASE.items() if k != "hybrid_override_pattern"},
                                   "layers_block_type": ["mamba", "attention", "moe"]})
    c = NemotronHConfig.from_dict({**BASE, "layer_types": ["linear_attention", "full_attention", "moe"],
                                   "num_local_experts": 8})
    assert a == b == c and a.pattern == "M*E" and a.max_position_embeddings is None
    assert NemotronHConfig.from_dict({**BASE, "max_position_embeddings": 8192}).max_position_embeddings == 8192


def test_presets_have_the_published_shapes():
    nano = PRESETS["nemotron-3-nano"]
    p = nano.pattern
    assert (len(p), p.count("M"), p.count("E"), p.count("*")) == (52, 23, 23, 6)
    assert (nano.d_model, nano.vocab_size, nano.mamba_nheads, nano.mamba_headdim, nano.d_state, nano.n_groups,
            nano.d_conv, nano.chunk_size) == (2688, 131072, 64, 64, 128, 8, 4, 128)
    assert (nano.n_heads, nano.n_kv_heads, nano.head_dim) == (32, 2, 128)
    assert (nano.n_routed_experts, nano.num_experts_per_tok, nano.moe_intermediate_size,
            nano.moe_shared_expert_intermediate_size, nano.n_group, nano.topk_group, nano.norm_topk_prob,
            nano.routed_scaling_factor, nano.moe_latent_size) == (128, 6, 1856, 3712, 1, 1, True, 2.5, None)
    sup = PRESETS["nemotron-3-super-slice"]
    m = NemotronHLM(sup, device="meta", dtype=torch.bfloat16)  # shapes only: no memory
    moe = m.backbone.layers[sup.layers_of("E")[0]].mixer
    assert tuple(moe.experts.up_proj.shape) == (512, 2688, 1024) and tuple(moe.experts.down_proj.shape) == (512, 1024, 2688)
    assert tuple(moe.fc1_latent_proj.weight.shape) == (1024, 4096) and tuple(moe.fc2_latent_proj.weight.shape) == (4096, 1024)
    assert tuple(moe.gate.weight.shape) == (512, 4096) and moe.gate.weight.dtype == torch.float32
    assert tuple(moe.shared_experts.up_proj.weight.shape) == (5376, 4096)
    assert (sup.num_experts_per_tok, sup.routed_scaling_factor, sup.mamba_nheads) == (22, 5.0, 128)
    assert set(sup.pattern) == set("ME*")


def test_tiny_preset_decodes_like_its_forward():
    from fastmamba.models import load_model

    m = load_model("nemotron-3-tiny", device="cpu")
    assert "E" in m.cfg.pattern and "-" in m.cfg.pattern
    ids = torch.randint(0, m.cfg.vocab_size, (9,), generator=seeded(4))
    full = m(ids[None])[0]
    cache = m.new_cache(1, max_seq_len=16, page_size=4)
    slot = cache.alloc(1)
    got = [m.prefill(ids[None, :3], cache, slot)[0]] + [m.decode(ids[t:t + 1], cache, slot)[0] for t in range(3, 9)]
    torch.testing.assert_close(torch.stack(got), full[2:], **FP32)


def test_config_json_of_a_released_checkpoint_reads(tmp_path):
    """The keys NVIDIA's Nano config.json uses (legacy names included) read into the preset's shape."""
    cfg = {"model_type": "nemotron_h", "hidden_size": 2688, "vocab_size": 131072, "num_hidden_layers": 52,
           "hybrid_override_pattern": PRESETS["nemotron-3-nano"].pattern, "num_attention_heads": 32,
           "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 1856, "mamba_num_heads": 64,
           "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4, "chunk_size": 128,
           "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
           "moe_shared_expert_intermediate_size": 3712, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
           "norm_topk_prob": True, "routed_scaling_factor": 2.5, "mlp_hidden_act": "relu2", "use_conv_bias": True,
           "use_bias": False, "mlp_bias": False, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False,
           "time_step_limit": [0.0, {"__float__": "Infinity"}], "eos_token_id": 2, "max_position_embeddings": 262144,
           "moe_latent_size": None, "num_nextn_predict_layers": 0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    got = NemotronHConfig.from_dir(tmp_path)
    want = PRESETS["nemotron-3-nano"]
    import dataclasses

    assert dataclasses.replace(got, eos_token_ids=(), max_position_embeddings=None) == want
    assert got.eos_token_ids == (2,) and got.max_position_embeddings == 262144


@pytest.mark.parametrize("latent", [None, 24], ids=["moe", "latent-moe"])
def test_moe_layer_runs_the_triton_kernels(monkeypatch, latent):
    """The MoE layer with the ops' Triton kernels (the interpreter on a CPU) equals it with their
    references, for one token (a decode step) and for a few (a prefill chunk): the model tests
    above run the references; the kernels have their own tests (tests/ops/moe/)."""
    from fastmamba.layers.moe import MoE, MoEConfig

    if not INTERPRETER_AT_START:
        pytest.skip("needs TRITON_INTERPRET=1 before Python starts (Triton reads it at import); the GPU tests "
                    "run the kernels on CUDA tensors")
    cfg = MoEConfig(d_model=48, n_experts=8, top_k=2, expert_width=20, shared_width=28, latent=latent, n_group=2,
                    topk_group=1, routed_scaling_factor=2.5)
    layer = MoE(cfg, dtype=torch.float32)
    g = seeded(6)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        layer.gate.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.1)
    for T in (1, 7):
        u = torch.randn(T, 48, generator=g)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        want = layer(u)
        with monkeypatch.context() as mp:  # the references must not run now
            mp.setenv("TRITON_INTERPRET", "1")
            for name in ("fused_moe_ref", "moe_route_ref"):
                mp.setattr(f"fastmamba.ops.moe.api.{name}", lambda *a, **k: pytest.fail("a reference ran"))
            torch.testing.assert_close(layer(u), want, **FP32)


@pytest.mark.parametrize("latent,bias", [(None, False), (24, True)], ids=["moe", "latent-moe-bias"])
def test_moe_layer_splits_over_ranks_by_width(latent, bias):
    """The tensor-parallel split the layer documents: w = 2 ranks each holding half the columns of
    every routed expert and of the shared expert (router and latent projections whole, output
    biases on rank 0) give partial outputs whose sum (``reduce``) is the whole layer's output."""
    from fastmamba.layers.moe import MoE, MoEConfig

    cfg = MoEConfig(d_model=48, n_experts=8, top_k=3, expert_width=20, shared_width=28, latent=latent, n_group=2,
                    topk_group=1, routed_scaling_factor=2.5, bias=bias)
    whole = MoE(cfg, dtype=torch.float32)
    g = seeded(8)
    with torch.no_grad():
        for p in whole.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    u = torch.randn(5, 48, generator=g)
    w = 2
    local = MoEConfig(**{**cfg.__dict__, "expert_width": 10, "shared_width": 14})
    partials = []
    for r in range(w):
        part = MoE(local, dtype=torch.float32)
        sd = {}
        for name, t in whole.state_dict().items():
            f = t.shape[1] // w if name == "experts.up_proj" else t.shape[-1] // w
            if name == "experts.up_proj":
                t = t[:, r * f:(r + 1) * f]
            elif name == "experts.down_proj":
                t = t[:, :, r * f:(r + 1) * f]
            elif name in ("shared_experts.up_proj.weight", "shared_experts.up_proj.bias"):
                t = t[r * (t.shape[0] // w):(r + 1) * (t.shape[0] // w)]
            elif name == "shared_experts.down_proj.weight":
                t = t[:, r * f:(r + 1) * f]
            elif name in ("shared_experts.down_proj.bias", "fc2_latent_proj.bias") and r > 0:
                t = torch.zeros_like(t)
            sd[name] = t
        part.load_state_dict(sd)
        partials.append(part(u))
    summed = MoE(local, dtype=torch.float32)
    summed.load_state_dict(dict(part.state_dict()))
    summed.reduce = lambda y: y + sum(partials[:-1])  # what an all-reduce over the ranks gives rank w-1
    torch.testing.assert_close(sum(partials), whole(u), **FP32)
    torch.testing.assert_close(summed(u), whole(u), **FP32)


def test_stack_experts_reports_what_it_stacked():
    """stack_experts stacks each layer's per-expert tensors under the fused name, in expert order,
    removes them, leaves fused layers alone, and lists the per-expert names behind each fused one."""
    from fastmamba.models.weights import stack_experts

    E, F, M = 3, 5, 4
    sd = {f"backbone.layers.1.mixer.experts.{e}.{p}.weight": torch.randn((F, M) if p == "up_proj" else (M, F))
          for e in (2, 0, 1) for p in ("up_proj", "down_proj")}
    fused_up = torch.randn(E, F, M)
    sd["backbone.layers.3.mixer.experts.up_proj"] = fused_up
    sd["backbone.layers.3.mixer.experts.down_proj"] = torch.randn(E, M, F)
    expect = {p: torch.stack([sd[f"backbone.layers.1.mixer.experts.{e}.{p}.weight"] for e in range(E)])
              for p in ("up_proj", "down_proj")}
    members = {}
    out = stack_experts(sd, [1, 3], E, members=members)
    assert out is sd
    assert members == {f"backbone.layers.1.mixer.experts.{p}": [f"backbone.layers.1.mixer.experts.{e}.{p}.weight"
                                                                for e in range(E)] for p in ("up_proj", "down_proj")}
    for p in ("up_proj", "down_proj"):
        assert torch.equal(sd[f"backbone.layers.1.mixer.experts.{p}"], expect[p])
    assert not any(".experts.0." in n or ".experts.2." in n for n in sd)
    assert sd["backbone.layers.3.mixer.experts.up_proj"] is fused_up
