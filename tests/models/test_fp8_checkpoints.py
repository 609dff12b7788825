"""FP8 Nemotron-3 checkpoints (issue 52): a tiny MoE hybrid quantised by the test into each
supported format loads with FP8 modules where the checkpoint stores FP8 and 16/32-bit ones where its
config excludes them; its logits equal a plain-PyTorch W8A8 reference built from the same weights;
greedy tokens are the same through the engine's chunked / unchunked prefill and prefix-cache hit /
miss; a corrupt or missing scale and an unsupported scheme are named in the error;
``quantization="fp8"`` quantises a 32-bit model on load.

FP8 K/V pages: the ModelOpt checkpoint ships ``k_scale`` / ``v_scale`` (kv_cache_quant_algo FP8),
so its caches hold float8_e4m3fn K/V; ``set_kv_cache_dtype(model, "fp8")`` gives a checkpoint
without scales float8 pages with scale 1.0, "fp32" keeps the model's dtype. The engine tests run
both fp8 forms (greedy tokens through chunked / unchunked prefill and prefix-cache hit / miss equal
full forwards, which round K and V through e4m3 the same way); the W8A8 reference rounds K and V
itself (a hook on k_proj / v_proj), independent of the layer's code.

Formats written here from public descriptions (ModelOpt's unified HF export, llm-compressor's
compressed-tensors), tensors made with torch.float8_e4m3fn and safetensors:

    modelopt-fp8        hf_quant_config.json quant_algo FP8: per-tensor weight_scale [], static
                        input_scale [] (max calibration), kv FP8 with k_proj.k_scale / v_proj.v_scale
    modelopt-channel    config.json quantization_config quant_method modelopt, FP8_PER_CHANNEL_PER_TOKEN
    ct-channel-token    compressed-tensors: weights strategy channel (weight_scale [N, 1]), dynamic
                        per-token activations, ``ignore`` with a "re:" pattern
    ct-tensor-static    compressed-tensors: weights strategy tensor ([1]), static tensor activations

Tolerances. (1) Against the W8A8 reference (dequantised weights, activations quantised by the
test's own fake-quantiser at the same points): the same arithmetic in fp32 in another order, so
fp32 tolerances hold unless an fp32 rounding difference moves an activation across an e4m3
rounding boundary (probability ~1e-6 per element at these sizes). (2) Against the same weights
with 32-bit activations: e4m3 keeps 3 mantissa bits, so round-to-nearest puts each quantised
activation within 2^-4 of its value, relatively (a value below the row's 2^-6 * amax lands in the
subnormal range, within 2^-10 * scale absolutely, smaller still); static scales calibrated on other
tokens may also clip a larger value. A linear layer's output error is then a sum of K such errors
with independent signs: at most 2^-4 and typically 2^-4 / sqrt(3) (uniform rounding error) of the
output's size in relative norm. A token's logits pass through about 9 quantised matmuls in
sequence here (per Mamba layer in_proj and out_proj; per MoE layer up, down and the shared
expert's two, in parallel), whose independent errors add in quadrature: sqrt(9) * 2^-4 / sqrt(3)
~ 0.11 typically, 9 * 2^-4 / sqrt(3) ~ 0.32 if they all lined up. FP8 K/V (ModelOpt) add two
rounding points per attention layer (K and V, each element within 2^-4 relative), 13 in all:
sqrt(13) * 2^-4 / sqrt(3) ~ 0.13 typically. We assert the logits' relative error in norm <= 2^-2
(between the two), and > 2^-12 (the activations were quantised at all). Measured when written:
0.089 (dynamic per token), 0.14 (static), 0.16 (static with FP8 K/V).

The ops run their PyTorch references (TRITON_INTERPRET=0 here, as the other model tests do); the
FP8 kernels have their own tests (tests/ops/fp8/).
"""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from fastmamba.generation.sampling import SamplingParams
from fastmamba.layers.fp8_linear import FP8Experts, FP8Linear
from fastmamba.models.loader import load_model
from fastmamba.models.nemotron_h import NemotronHConfig, NemotronHLM, load_nemotron_h, random_init
from fastmamba.models.quantization import kv_cache_note, read_quant_config, set_kv_cache_dtype
from fastmamba.ops._common.dispatch import interpreter_enabled
from tests.generation.test_engine_hybrid import assert_all_free, engine_of
from tests.generation.test_engine_hybrid_prefix import run, same_run, scrub, tokens
from tests.helpers import spread_moe_weights, tol

safetensors_torch = pytest.importorskip("safetensors.torch")

FP32 = tol(torch.float32)
INTERPRETER_AT_START = interpreter_enabled()  # Triton reads TRITON_INTERPRET once, at import
E4M3 = torch.float8_e4m3fn
VOCAB = 256
CONFIG_JSON = dict(model_type="nemotron_h", vocab_size=VOCAB, hidden_size=64, hybrid_override_pattern="*ME-M*E",
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                   mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4,
                   chunk_size=8, layer_norm_epsilon=1e-5, n_routed_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1,
                   norm_topk_prob=True, routed_scaling_factor=2.5, eos_token_id=3, tie_word_embeddings=False)
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LAYER = 3  # the "-" of the pattern: excluded as a whole in every format (modules kept in 16 bits)
FORMATS = ["modelopt-fp8", "modelopt-channel", "modelopt-mixed", "ct-channel-token", "ct-tensor-static"]
SPEC = {  # format -> (per_channel weight scales, static input scales)
    "modelopt-fp8": (False, True), "modelopt-channel": (True, False), "modelopt-mixed": (False, True),
    "ct-channel-token": (True, False), "ct-tensor-static": (False, True),
}
CALIBRATION = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def base_model() -> NemotronHLM:
    """The tiny MoE hybrid (fp32) with mixer weights large enough that every layer and each
    token's choice of experts moves the logits (as tests/generation/test_engine_moe.py)."""
    cfg = NemotronHConfig.from_dict(CONFIG_JSON)
    return spread_moe_weights(random_init(NemotronHLM(cfg, device="cpu", dtype=torch.float32), seed=3).eval())


def fp8_targets(model: nn.Module) -> list[str]:
    """Module names the checkpoints store in FP8: every Linear but attention, lm_head and the MLP
    layer; plus each MoE layer's experts (``...mixer.experts``)."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name != "lm_head" and not name.endswith(ATTN) \
                and not name.startswith(f"backbone.layers.{MLP_LAYER}."):
            out.append(name)
        elif name.endswith("mixer.experts"):
            out.append(name)
    return out


def input_amax(model: nn.Module, names: list[str]) -> dict[str, float]:
    """Max-calibration of the static activation scales: the largest |input| each module sees on
    CALIBRATION (for experts: the largest routed-expert input, the MoE layer's input or latent)."""
    amax: dict[str, float] = {}
    hooks = []
    for name in names:
        mod = model.get_submodule(name)
        target = mod if isinstance(mod, nn.Linear) else model.get_submodule(name.rsplit(".", 1)[0])

        def hook(m, args, name=name):
            amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
            m._fp8_test_input = args[0].detach().reshape(-1, args[0].shape[-1])
        hooks.append(target.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(CALIBRATION)
    for h in hooks:
        h.remove()
    for name in names:  # the experts' hidden relu(up x)^2, over every expert (a bound on the routed ones)
        if name.endswith("experts"):
            x = model.get_submodule(name.rsplit(".", 1)[0])._fp8_test_input
            up = model.get_submodule(name).up_proj
            with torch.no_grad():
                amax[name + ".hidden"] = float(torch.relu(torch.einsum("tm,efm->etf", x, up)).square().max())
    return amax


def q_weight(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    amax = w.abs().amax(dim=-1, keepdim=True) if per_channel else w.abs().amax()
    s = amax.clamp(min=1e-12) / 448.0
    return (w / s).clamp(-448, 448).to(E4M3), s


def write_checkpoint(root, fmt: str, *, edit=None) -> dict[str, torch.Tensor]:
    """The base model quantised into ``fmt`` under ``root`` (config.json, model.safetensors,
    hf_quant_config.json for ModelOpt's file form); ``edit(state_dict, config)`` changes it before
    writing. Experts in NVIDIA's per-expert layout. Returns the state dict written."""
    per_channel, static = SPEC[fmt]
    model = base_model()
    names = fp8_targets(model)
    amax = input_amax(model, names) if static else {}
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for name in names:
        if name.endswith("experts"):
            for proj in ("up_proj", "down_proj"):
                w3 = sd.pop(f"{name}.{proj}")
                for e in range(w3.shape[0]):
                    q, s = q_weight(w3[e], per_channel)
                    sd[f"{name}.{e}.{proj}.weight"] = q
                    sd[f"{name}.{e}.{proj}.weight_scale"] = _scale_shape(s, fmt, per_channel)
                    if static:  # per-expert input scales that differ (the loader folds them to their max)
                        a = amax[name] if proj == "up_proj" else amax[name + ".hidden"]
                        sd[f"{name}.{e}.{proj}.input_scale"] = torch.tensor(a / 448.0 * (1 + 0.05 * e))
            continue
        q, s = q_weight(sd[f"{name}.weight"], per_channel)
        sd[f"{name}.weight"] = q
        sd[f"{name}.weight_scale"] = _scale_shape(s, fmt, per_channel)
        if static:
            sd[f"{name}.input_scale"] = torch.tensor(amax[name] / 448.0).reshape(
                () if fmt.startswith("modelopt") else (1,))
    config = dict(CONFIG_JSON)
    hf_quant = None
    if fmt == "modelopt-fp8":
        hf_quant = {"producer": {"name": "modelopt"}, "quantization": {
            "quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
            "exclude_modules": ["lm_head", "*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj",
                                f"backbone.layers.{MLP_LAYER}.mixer*"]}}
        for i in NemotronHConfig.from_dict(CONFIG_JSON).layers_of("*"):
            sd[f"backbone.layers.{i}.mixer.k_proj.k_scale"] = torch.tensor(0.02)
            sd[f"backbone.layers.{i}.mixer.v_proj.v_scale"] = torch.tensor(0.03)
    elif fmt == "modelopt-mixed":  # MIXED_PRECISION, every listed module FP8 (experts listed per expert)
        listed = [f"{n}.{e}.{p}" for n in names if n.endswith("experts") for e in range(CONFIG_JSON["n_routed_experts"])
                  for p in ("up_proj", "down_proj")] + [n for n in names if not n.endswith("experts")]
        hf_quant = {"producer": {"name": "modelopt"}, "quantization": {
            "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
            "quantized_layers": {n: {"quant_algo": "FP8"} for n in listed}}}
    elif fmt == "modelopt-channel":
        config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN",
                                         "exclude_modules": ["lm_head", "*.[qkvo]_proj",
                                                             f"backbone.layers.{MLP_LAYER}.*"]}
    else:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                            "strategy": "channel" if per_channel else "tensor"},
                "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static,
                                      "strategy": "tensor" if static else "token"}}},
            "ignore": ["lm_head", r"re:.*mixer\.[qkvo]_proj$", f"backbone.layers.{MLP_LAYER}.mixer.up_proj",
                       f"backbone.layers.{MLP_LAYER}.mixer.down_proj"],
            "kv_cache_scheme": None}
    if edit is not None:
        edit(sd, config, hf_quant)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    if hf_quant is not None:
        (root / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    safetensors_torch.save_file({k: v.contiguous() for k, v in sd.items()}, str(root / "model.safetensors"))
    return sd


def _scale_shape(s: torch.Tensor, fmt: str, per_channel: bool) -> torch.Tensor:
    if per_channel:
        return s.reshape(-1, 1).float()                       # [N, 1] (both formats write it so)
    return s.reshape(() if fmt.startswith("modelopt") else (1,)).float()


@pytest.fixture(scope="module", params=FORMATS)
def fp8_dir(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    write_checkpoint(root, request.param)
    return request.param, root


# ---------------------------------------------------------------------------------------------
# the W8A8 reference: dequantised weights in a plain fp32 model, activations fake-quantised


def fake_quant(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x quantised to e4m3 and back: per token (scale None) or with one static scale."""
    s = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0 if scale is None else scale
    return (x * (1.0 / s)).clamp(-448, 448).to(E4M3).float() * s  # scaled by the reciprocal, as ops/fp8/ref.py


class SimExperts(nn.Module):
    """Dequantised experts with fake-quantised inputs (what FP8Experts must compute)."""

    def __init__(self, up, down, up_in, down_in):
        super().__init__()
        self.up, self.down, self.up_in, self.down_in = up, down, up_in, down_in
        self.up_proj, self.down_proj = up, down  # the experts' weights, where the MoE layer looks for them

    def run(self, h, routing):
        out = torch.zeros_like(h, dtype=torch.float32)
        for t in range(h.shape[0]):
            for j in range(routing.ids.shape[1]):
                e = int(routing.ids[t, j])
                a = torch.relu(fake_quant(h[t:t + 1].float(), self.up_in) @ self.up[e].t()).square()
                out[t] += routing.weights[t, j] * (fake_quant(a, self.down_in) @ self.down[e].t())[0]
        return out.to(h.dtype)


def dequantised(fp8: NemotronHLM, *, quantise_activations: bool) -> NemotronHLM:
    """A plain fp32 NemotronHLM holding the FP8 model's weights dequantised (w * scale), with the
    activations fake-quantised at the FP8 modules' inputs when ``quantise_activations``."""
    ref = NemotronHLM(fp8.cfg, device="cpu", dtype=torch.float32).eval()
    sd = {}
    for name, t in fp8.state_dict().items():
        sd[name] = t
    with torch.no_grad():
        for name, m in fp8.named_modules():
            if isinstance(m, FP8Linear):
                s = m.weight_scale.reshape(-1, 1) if m.weight_scale.dim() else m.weight_scale
                sd[f"{name}.weight"] = m.weight.float() * s
                for k in ("weight_scale", "input_scale"):
                    sd.pop(f"{name}.{k}", None)
        ref.load_state_dict({k: v for k, v in sd.items() if not k.endswith(("_weight_scale", "_input_scale"))
                             and not (".experts." in k and "_proj" in k)}, strict=False)
        for name, m in fp8.named_modules():
            if getattr(m, "kv_dtype", None) == E4M3 and quantise_activations:  # K and V as the pages hold them
                for proj, scale in (("k_proj", m.k_scale), ("v_proj", m.v_scale)):
                    ref.get_submodule(f"{name}.{proj}").register_forward_hook(
                        lambda mod, args, out, scale=scale: fake_quant(out, scale))
            if isinstance(m, FP8Linear) and quantise_activations:
                scale = m.input_scale
                ref.get_submodule(name).register_forward_pre_hook(
                    lambda mod, args, scale=scale: (fake_quant(args[0], scale),))
            if isinstance(m, FP8Experts):
                def deq(w, s):
                    return w.float() * (s[:, :, None] if s.dim() == 2 else s[:, None, None])
                up = deq(m.up_proj, m.up_proj_weight_scale)
                down = deq(m.down_proj, m.down_proj_weight_scale)
                if quantise_activations:
                    sim = SimExperts(up, down, m.up_proj_input_scale, m.down_proj_input_scale)
                else:
                    sim = ref.get_submodule(name)
                    sim.up_proj.copy_(up)
                    sim.down_proj.copy_(down)
                    continue
                parent, _, attr = name.rpartition(".")
                setattr(ref.get_submodule(parent), attr, sim)
    return ref


# ---------------------------------------------------------------------------------------------
# tests


def test_formats_load_with_fp8_modules_and_excluded_ones_in_16_bits(fp8_dir):
    fmt, root = fp8_dir
    per_channel, static = SPEC[fmt]
    model = load_nemotron_h(root, device="cpu")
    want = set(fp8_targets(base_model()))
    fp8 = {n for n, m in model.named_modules() if isinstance(m, (FP8Linear, FP8Experts))}
    assert fp8 == want
    for name in want:
        m = model.get_submodule(name)
        w = m.weight if isinstance(m, FP8Linear) else m.up_proj
        assert w.dtype == E4M3
        if isinstance(m, FP8Linear):
            assert m.per_channel == per_channel and (m.input_scale is not None) == static
    kept = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert "lm_head" in kept and any(n.endswith("q_proj") for n in kept)
    assert f"backbone.layers.{MLP_LAYER}.mixer.up_proj" in kept
    for n in kept:
        assert model.get_submodule(n).weight.dtype == torch.float32, n
    for i in model.cfg.layers_of("E"):
        assert model.backbone.layers[i].mixer.gate.weight.dtype == torch.float32
    kv = model.new_cache(1, max_seq_len=16, page_size=4).kv
    assert {t.dtype for t in kv.k + kv.v} == {E4M3 if fmt == "modelopt-fp8" else torch.float32}
    assert kv_cache_note(model).startswith("float8_e4m3fn (k_scale / v_scale from the checkpoint)"
                                           if fmt == "modelopt-fp8" else "float32 (the model's dtype)")
    if fmt == "modelopt-fp8":
        for i in model.cfg.layers_of("*"):
            attn = model.backbone.layers[i].mixer
            assert float(attn.k_scale) == pytest.approx(0.02) and float(attn.v_scale) == pytest.approx(0.03)
            assert attn.kv_dtype == E4M3
        experts = model.backbone.layers[model.cfg.layers_of("E")[0]].mixer.experts
        sd = safetensors_torch.load_file(str(root / "model.safetensors"))
        base = f"backbone.layers.{model.cfg.layers_of('E')[0]}.mixer.experts"
        want_in = max(float(sd[f"{base}.{e}.up_proj.input_scale"]) for e in range(8))
        assert float(experts.up_proj_input_scale) == want_in  # per-expert scales folded to their max


def test_logits_equal_the_w8a8_reference(fp8_dir):
    fmt, root = fp8_dir
    model = load_nemotron_h(root, device="cpu")
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = model(ids)
        sim = dequantised(model, quantise_activations=True)(ids)
        plain = dequantised(model, quantise_activations=False)(ids)
    torch.testing.assert_close(got, sim, atol=2e-4, rtol=2e-4)  # fp32 reorderings (module doc, (1))
    rel = float((got - plain).norm() / plain.norm())
    print(f"{fmt}: relative error vs 32-bit activations {rel:.3e}")
    assert 2 ** -12 < rel <= 2 ** -2, f"relative error {rel:.3e} vs 32-bit activations (module doc, (2))"


ENGINE_MODELS = {"modelopt-fp8": ("modelopt-fp8", None), "ct-channel-token": ("ct-channel-token", None),
                 "ct-channel-token-kv-fp8": ("ct-channel-token", "fp8")}


@pytest.fixture(scope="module", params=list(ENGINE_MODELS))
def engine_model(request, tmp_path_factory):
    """A static-scale checkpoint (FP8 K/V with its scales), a dynamic per-token one (16-bit K/V),
    and the latter with FP8 K/V pages at scale 1.0 (``set_kv_cache_dtype``), loaded."""
    fmt, kv = ENGINE_MODELS[request.param]
    root = tmp_path_factory.mktemp("engine")
    write_checkpoint(root, fmt)
    model = load_nemotron_h(root, device="cpu")
    if kv is not None:
        note = set_kv_cache_dtype(model, kv)
        assert note == "float8_e4m3fn (k_scale = v_scale = 1.0: the checkpoint ships no K/V scales)"
    model.fp8_kv = request.param != "ct-channel-token"  # what the tests expect of its pages
    return model


def check_pages(engine, model) -> None:
    """The engine's K/V pools are float8 exactly for the FP8 K/V models."""
    dtypes = {t.dtype for t in engine.cache.kv.k + engine.cache.kv.v}
    assert dtypes == {E4M3 if model.fp8_kv else torch.float32}


PROMPTS = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(11)).tolist() for n in (5, 13, 22)]


def test_chunked_prefill_equals_unchunked(engine_model):
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    want = engine_of(engine_model, max_batch=3).generate(PROMPTS, params)
    full = []
    for p in PROMPTS:  # greedy by full forwards: the definition
        ids = list(p)
        for _ in range(5):
            ids.append(int(engine_model(torch.tensor([ids]))[0, -1].argmax()))
        full.append(ids[len(p):])
    assert want == full
    for chunk in (3, 8):
        engine = engine_of(engine_model, max_batch=3, prefill_chunk=chunk)
        check_pages(engine, engine_model)
        assert engine.generate(PROMPTS, params) == want, f"prefill_chunk={chunk}"
        assert_all_free(engine)


def test_prefix_cache_hit_keeps_the_output(engine_model):
    shared = tokens(24, 7)
    first, second = shared + tokens(5, 8), shared + tokens(7, 9)
    plain = engine_of(engine_model, max_batch=2)
    want = [run(plain, first), run(plain, second)]
    eng = engine_of(engine_model, max_batch=2, prefix_cache_entries=8, prefix_block=8)
    check_pages(eng, engine_model)
    assert {t.dtype for t in eng.prefix.kv_k} == {E4M3 if engine_model.fp8_kv else torch.float32}
    same_run(run(eng, first), want[0])
    scrub(eng)
    same_run(run(eng, second), want[1])
    assert eng.prefix_stats["hits"] == 1
    assert_all_free(eng)


def test_kv_cache_dtype_choices(tmp_path):
    """``set_kv_cache_dtype``: "fp32" (the model's dtype) keeps 16/32-bit pages on a checkpoint that
    ships K/V scales and matches the plain forward; "auto" goes back to the checkpoint's float8 with
    its scales; a dtype other than the model's, or an unknown name, is refused."""
    root = tmp_path / "ckpt"
    write_checkpoint(root, "modelopt-fp8")
    model = load_nemotron_h(root, device="cpu")
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fp8_logits = model(ids)
        assert set_kv_cache_dtype(model, "fp32") == "float32 (the model's dtype)"
        plain = model(ids)
        assert model.new_cache(1, max_seq_len=16, page_size=4).kv.k[0].dtype == torch.float32
        assert not torch.equal(plain, fp8_logits)  # the forward rounded K and V through e4m3 before
        assert set_kv_cache_dtype(model, "auto") == "float8_e4m3fn (k_scale / v_scale from the checkpoint)"
        torch.testing.assert_close(model(ids), fp8_logits, atol=0, rtol=0)
    attn = model.backbone.layers[0].mixer
    assert float(attn.k_scale) == pytest.approx(0.02)  # the checkpoint's scales survive the round trip
    with pytest.raises(ValueError, match="'bf16' is not the model's dtype"):
        set_kv_cache_dtype(model, "bf16")
    with pytest.raises(ValueError, match=r"kv_cache_dtype: expected None or one of .* got 'int8'"):
        set_kv_cache_dtype(model, "int8")
    assert attn.kv_dtype == E4M3  # a refused choice changes nothing


def _drop(name):
    def edit(sd, config, hf):
        del sd[name]
    return edit


def _drop_all(*names):
    def edit(sd, config, hf):
        for name in names:
            del sd[name]
    return edit


def _set(name, value):
    def edit(sd, config, hf):
        sd[name] = value
    return edit


def _fp8_router(sd, config, hf):
    sd["backbone.layers.2.mixer.gate.weight"] = torch.zeros(8, 64).to(E4M3)
    sd["backbone.layers.2.mixer.gate.weight_scale"] = torch.ones(8, 1)


IN = "backbone.layers.1.mixer.in_proj"          # a Mamba layer of "*ME-M*E"
EXP = "backbone.layers.2.mixer.experts"


@pytest.mark.parametrize("fmt, edit, message", [
    ("modelopt-fp8", _drop(f"{IN}.weight_scale"), f"{IN}.weight_scale: missing"),
    ("modelopt-fp8", _drop(f"{IN}.input_scale"), f"{IN}.input_scale: missing"),
    ("modelopt-fp8", _set(f"{IN}.weight_scale", torch.tensor(float("nan"))), f"{IN}.weight_scale: 1 of 1 values"),
    ("modelopt-fp8", _set(f"{IN}.input_scale", torch.tensor(0.0)), f"{IN}.input_scale: 1 of 1 values"),
    ("modelopt-fp8", _set(f"{IN}.weight_scale", torch.ones(3)), f"{IN}.weight_scale: expected shape"),
    ("modelopt-fp8", _drop(f"{EXP}.5.down_proj.weight_scale"), f"{EXP}.5.down_proj.weight_scale: missing"),
    ("modelopt-fp8", _drop("backbone.layers.0.mixer.v_proj.v_scale"), "v_scale missing"),
    ("modelopt-fp8", _drop("backbone.layers.5.mixer.k_proj.k_scale"),
     "backbone.layers.5.mixer: k_scale missing (the other is present)"),
    ("modelopt-fp8", _drop_all("backbone.layers.5.mixer.k_proj.k_scale", "backbone.layers.5.mixer.v_proj.v_scale"),
     "backbone.layers.5.mixer.k_proj.k_scale, backbone.layers.5.mixer.v_proj.v_scale: missing"),
    ("modelopt-fp8", _set("backbone.layers.0.mixer.k_proj.k_scale", torch.tensor(float("nan"))),
     "backbone.layers.0.mixer.k_proj.k_scale: 1 of 1 values are not finite and > 0 (K/V cache scale)"),
    ("modelopt-fp8", _set("backbone.layers.5.mixer.k_proj.k_scale", torch.tensor(0.0)),
     "backbone.layers.5.mixer.k_proj.k_scale: 1 of 1 values are not finite and > 0"),
    ("modelopt-fp8", _set("backbone.layers.0.mixer.k_proj.k_scale", torch.ones(4)),
     "backbone.layers.0.mixer.k_proj.k_scale: expected shape () or (1,) (K/V cache scale), got (4,)"),
    ("ct-channel-token", _set("backbone.layers.0.mixer.k_proj.k_scale", torch.tensor(0.1)),
     "backbone.layers.0.mixer.k_proj.k_scale: unexpected"),
    ("ct-channel-token", _set(f"{IN}.weight_scale", -torch.ones(16 * 8 + 2 * 2 * 16 + 8 + 16 * 8, 1)),
     f"{IN}.weight_scale: "),
    ("ct-channel-token", _set(f"{IN}.weight", torch.full((2, 2), float("nan")).to(E4M3)), f"{IN}.weight"),
    ("ct-channel-token", _set("backbone.layers.0.mixer.q_proj.weight", torch.zeros(64, 64).to(E4M3)),
     "backbone.layers.0.mixer.q_proj.weight: 'backbone.layers.0.mixer.q_proj' is excluded"),
    ("ct-channel-token", _set("backbone.layers.2.mixer.gate.weight", torch.zeros(8, 64).to(E4M3)),
     "backbone.layers.2.mixer.gate.weight_scale: missing"),
    ("ct-channel-token", _fp8_router, "backbone.layers.2.mixer.gate: FP8 in the checkpoint, but the model has Router"),
    ("ct-channel-token", _set("backbone.layers.0.mixer.q_proj.weight_scale", torch.ones(64, 1)),
     "backbone.layers.0.mixer.q_proj.weight_scale: a scale without an FP8 weight"),
    ("ct-channel-token", _set(f"{IN}.input_scale", torch.ones(1)), f"{IN}.input_scale: unexpected"),
], ids=["missing-weight-scale", "missing-input-scale", "nan-scale", "zero-input-scale", "misshaped-scale",
        "missing-expert-scale", "missing-v-scale", "missing-k-scale", "missing-kv-scales", "nan-k-scale",
        "zero-k-scale", "misshaped-k-scale", "k-scale-without-fp8-kv", "negative-channel-scales", "nan-fp8-bytes",
        "fp8-in-excluded-module", "fp8-router-no-scale", "fp8-router", "stray-scale",
        "input-scale-with-dynamic"])
def test_bad_tensors_are_named(tmp_path, fmt, edit, message):
    root = tmp_path / "ckpt"
    write_checkpoint(root, fmt, edit=edit)
    with pytest.raises(ValueError) as e:
        load_nemotron_h(root, device="cpu")
    assert message in str(e.value)


def _quant(**change):
    def edit(sd, config, hf):
        (hf["quantization"] if hf is not None else config["quantization_config"]).update(change)
    return edit


def _mixed_entry(name, **spec):
    def edit(sd, config, hf):
        hf["quantization"]["quantized_layers"][name] = spec
    return edit


def _ct_group(key, **change):
    def edit(sd, config, hf):
        g = config["quantization_config"]["config_groups"]["group_0"]
        if change:
            g[key].update(change)
        else:
            g[key] = None
    return edit


@pytest.mark.parametrize("fmt, edit, message", [
    ("modelopt-fp8", _quant(quant_algo="NVFP4"), "`quant_algo` 'NVFP4' is not supported"),
    ("modelopt-fp8", _quant(kv_cache_quant_algo="INT8"), "`kv_cache_quant_algo` 'INT8'"),
    ("modelopt-channel", _quant(quant_method="gptq"), "`quant_method` 'gptq' is not supported"),
    ("modelopt-fp8", _quant(pre_quant_scale=True), "`pre_quant_scale` True is not supported"),
    ("modelopt-fp8", _quant(group_size=128), "`group_size` 128"),
    ("ct-channel-token", _ct_group("weights", strategy="group", group_size=128), "weights.strategy` 'group'"),
    ("ct-channel-token", _ct_group("weights", num_bits=4, type="int"), "num_bits=4 type='int'"),
    ("ct-channel-token", _ct_group("input_activations"), "input_activations` is null (weight-only FP8"),
    ("ct-channel-token", _quant(format="pack-quantized"), "`format` 'pack-quantized'"),
    ("modelopt-mixed", _mixed_entry("backbone.layers.2.mixer.experts.0.up_proj", quant_algo="NVFP4", group_size=16),
     "`quantized_layers['backbone.layers.2.mixer.experts.0.up_proj'].quant_algo` 'NVFP4' is not supported"),
    ("modelopt-mixed", _mixed_entry("backbone.layers.1.mixer.in_proj", quant_algo="FP8_PER_CHANNEL_PER_TOKEN"),
     "FP8_PER_CHANNEL_PER_TOKEN (backbone.layers.1.mixer.in_proj, ...): fastmamba reads one FP8 scale scheme"),
    ("modelopt-mixed", _quant(quantized_layers={}), "`quantized_layers` expected a non-empty object"),
], ids=["nvfp4", "kv-int8", "gptq", "awq-smoothing", "modelopt-groups", "group-scales", "int4", "weight-only", "packed",
        "mixed-nvfp4", "mixed-schemes", "mixed-empty"])
def test_unsupported_schemes_are_named_before_loading(tmp_path, fmt, edit, message):
    root = tmp_path / "ckpt"
    write_checkpoint(root, fmt, edit=edit)
    with pytest.raises(ValueError) as e:
        read_quant_config(root)
    assert message in str(e.value)
    with pytest.raises(ValueError, match="FP8 checkpoint"):
        load_nemotron_h(root, device="cpu")


def test_fp8_tensors_without_a_config_are_refused(tmp_path):
    root = tmp_path / "ckpt"

    def edit(sd, config, hf):
        config.pop("quantization_config")
    write_checkpoint(root, "ct-channel-token", edit=edit)
    with pytest.raises(ValueError, match="stores .* tensor\\(s\\) in FP8"):
        load_nemotron_h(root, device="cpu")


def test_quantization_fp8_on_load(tmp_path):
    """``load_model(..., quantization="fp8")`` on a 32-bit checkpoint: every Linear but attention
    and lm_head, and the routed experts, become FP8 (per channel, dynamic per token); the logits
    are within the bound of the module doc's (2) doubled, for the weights' own e4m3 rounding
    (2^-4 per element, like the activations'): <= 2^-1; and greedy decoding runs."""
    root = tmp_path / "bf"
    root.mkdir()
    model = base_model()
    (root / "config.json").write_text(json.dumps(CONFIG_JSON))
    safetensors_torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                                str(root / "model.safetensors"))
    q = load_model(root, device="cpu", quantization="fp8")
    fp8 = {n for n, m in q.named_modules() if isinstance(m, (FP8Linear, FP8Experts))}
    assert any(n.endswith("mixer.in_proj") for n in fp8) and any(n.endswith("experts") for n in fp8)
    assert f"backbone.layers.{MLP_LAYER}.mixer.up_proj" in fp8
    assert all(isinstance(q.get_submodule(n), FP8Linear) for n in fp8 if not n.endswith("experts"))
    assert isinstance(q.lm_head, nn.Linear) and isinstance(q.backbone.layers[0].mixer.q_proj, nn.Linear)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = model(ids), q(ids)
    rel = float((got - want).norm() / want.norm())
    print(f"quantised on load: relative error vs 32 bits {rel:.3e}")
    assert 2 ** -12 < rel <= 2 ** -1, rel
    out = engine_of(q, max_batch=2).generate([ids[0].tolist()], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(out[0]) == 4
    with pytest.raises(ValueError, match="`quantization` expected None or one of"):
        load_model(root, device="cpu", quantization="int8")


def test_quantization_fp8_on_a_preset_and_from_the_cli(monkeypatch, capsys):
    """The preset path quantises too, and ``fastmamba generate --quantization fp8`` reaches
    load_model (the generated ids equal those of the model it loads)."""
    from fastmamba import cli

    q = load_model("nemotron-3-tiny", device="cpu", quantization="fp8")
    assert any(isinstance(m, FP8Experts) for m in q.modules()) and any(isinstance(m, FP8Linear) for m in q.modules())
    seen = {}
    real = load_model

    def spy(*a, **kw):
        seen.update(kw)
        return real(*a, **kw)
    monkeypatch.setattr("fastmamba.models.load_model", spy)
    rc = cli.main(["generate", "--model", "nemotron-3-tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "2",
                   "--device", "cpu", "--quantization", "fp8"])
    assert rc == 0 and seen.get("quantization") == "fp8"
    want = engine_of(q, max_batch=1).generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, ignore_eos=True))[0]
    assert " ".join(map(str, want)) in capsys.readouterr().out


def watch_replaced_modules(monkeypatch) -> tuple[list, list[int]]:
    """Wrap the 16-bit -> FP8 conversions: returns (weak references to every module converted,
    how many earlier ones were still alive, after a gc, when each conversion began)."""
    import gc
    import weakref

    replaced: list[weakref.ref] = []
    alive_at_each_call: list[int] = []

    def watching(convert):
        def run(module):
            gc.collect()
            alive_at_each_call.append(sum(r() is not None for r in replaced))
            replaced.append(weakref.ref(module))
            return convert(module)
        return run

    monkeypatch.setattr(FP8Linear, "from_linear", watching(FP8Linear.from_linear))
    monkeypatch.setattr(FP8Experts, "from_experts", watching(FP8Experts.from_experts))
    return replaced, alive_at_each_call


def test_quantization_frees_each_16bit_module_before_the_next(monkeypatch):
    """``quantize_model`` converts one module at a time and keeps no reference to the ones it has
    replaced, so the peak is the 16-bit model plus one FP8 copy (a list of the modules kept every
    16-bit weight alive: out of memory quantising Nano on an 80 GB H100)."""
    import gc

    from fastmamba.models.quantization import quantize_model

    model = load_model("nemotron-3-tiny", device="cpu")
    seen, alive_at_each_call = watch_replaced_modules(monkeypatch)
    quantize_model(model)
    gc.collect()
    assert len(seen) > 4 and alive_at_each_call == [0] * len(seen)
    assert all(r() is None for r in seen)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["modelopt-fp8", "ct-channel-token"])
def test_fp8_checkpoint_on_gpu_matches_cpu_and_graphs_match_eager(tmp_path, fmt, monkeypatch):
    """On an FP8 GPU: the checkpoint in bf16 runs the Triton GEMV / torch._scaled_mm / dense FP8 MoE
    paths; its logits are within the bound of the module doc's (2) of the CPU fp32 model's (bf16
    activations add 2^-8 per element, far below); greedy tokens with CUDA graphs equal eager."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    root = tmp_path / fmt
    write_checkpoint(root, fmt)
    cpu = load_nemotron_h(root, device="cpu")
    gpu = load_nemotron_h(root, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want, got = cpu(ids), gpu(ids.cuda()).float().cpu()
    rel = float((got - want).norm() / want.norm())
    assert rel <= 2 ** -2, rel
    prm = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (6, 9, 5)]
    eager = engine_of(gpu, max_batch=4, cuda_graphs=False).generate(PROMPTS, prm)
    graphs = engine_of(gpu, max_batch=4, cuda_graphs=True)
    assert graphs.decoder is not None
    assert graphs.generate(PROMPTS, prm) == eager


@pytest.mark.skipif(not INTERPRETER_AT_START, reason="the Triton kernels run on the CPU only with TRITON_INTERPRET=1 set before Python starts")
def test_fp8_layers_run_the_triton_kernels(engine_model, monkeypatch):
    """The loaded FP8 modules on the Triton path (interpreter): a Mamba in_proj (GEMV), a MoE
    layer (pair GEMVs up and down, each quantising its input rows, and the k-sum) for 1 and 3
    tokens equal their reference path."""
    g = torch.Generator().manual_seed(9)
    moe = engine_model.backbone.layers[engine_model.cfg.layers_of("E")[0]].mixer
    lin = engine_model.backbone.layers[engine_model.cfg.layers_of("M")[0]].mixer.in_proj
    for T in (1, 3):
        x = torch.randn(T, 64, generator=g)
        with torch.no_grad():
            monkeypatch.setenv("TRITON_INTERPRET", "0")
            want = moe(x), lin(x)
            monkeypatch.setenv("TRITON_INTERPRET", "1")
            got = moe(x), lin(x)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **FP32)


@pytest.mark.gpu
def test_fp8_kv_pages_graphed_decode_gpu(tmp_path, monkeypatch):
    """The ModelOpt checkpoint in bf16 on the GPU: float8 K/V pages (its scales) through the
    graphed decode and prefill give the eager engine's greedy tokens; speculative verify (the same
    decode kernel over B*T rows) too; and the same run with 16-bit pages stays close (the logits
    of one forward within the FP8 bound of the module doc's (2))."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    root = tmp_path / "modelopt-fp8"
    write_checkpoint(root, "modelopt-fp8")
    gpu = load_nemotron_h(root, device="cuda", dtype=torch.bfloat16)
    prm = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 9, 16)]
    eager = engine_of(gpu, max_batch=4, cuda_graphs=False)
    assert {t.dtype for t in eager.cache.kv.k + eager.cache.kv.v} == {E4M3}
    want = eager.generate(PROMPTS, prm)
    graphs = engine_of(gpu, max_batch=4, cuda_graphs=True)
    assert graphs.decoder is not None and graphs.cache.kv.k[0].dtype == E4M3
    assert graphs.generate(PROMPTS, prm) == want
    assert graphs.generate(PROMPTS, prm) == want  # replays of captured graphs, pages reused
    spec = engine_of(gpu, max_batch=4, cuda_graphs=True, speculate=2)
    assert spec.cache.kv.k[0].dtype == E4M3 and spec.generate(PROMPTS, prm) == want
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4)).cuda()
    with torch.no_grad():
        fp8_kv = gpu(ids).float()
        set_kv_cache_dtype(gpu, "bf16")
        bf16_kv = gpu(ids).float()
    rel = float((fp8_kv - bf16_kv).norm() / bf16_kv.norm())
    assert 0 < rel <= 2 ** -2, rel


def _blocks_built(model: nn.Module) -> list[str]:
    return [f"backbone.layers.{i}" for i in range(len(model.backbone.layers))] + (
        [f"mtp.layers.{i}" for i in range(len(model.mtp.layers))] if getattr(model, "mtp", None) is not None else [])


def test_random_weights_are_the_same_built_whole_or_block_by_block():
    """``random_init`` seeds each module by its qualified name: initialising each block as it is
    built (``finishing_blocks``), then the rest, gives the weights of the whole model initialised at
    once (the MTP preset has blocks in two lists: backbone.layers and mtp.layers)."""
    from fastmamba.models.blocks import finishing_blocks
    from fastmamba.models.nemotron_h import PRESETS

    cfg = PRESETS["nemotron-3-tiny-mtp"]
    whole = random_init(NemotronHLM(cfg, device="cpu", dtype=torch.float32), seed=5)
    names: list[str] = []
    done: list[nn.Module] = []
    with finishing_blocks(lambda block, name: (random_init(block, seed=5, prefix=name), names.append(name),
                                               done.extend(block.modules()))):
        streamed = NemotronHLM(cfg, device="cpu", dtype=torch.float32)
    random_init(streamed, seed=5, skip=done)  # (MTP's first block gets eh_proj after it is finished)
    assert names == _blocks_built(whole) and names[-1].startswith("mtp.layers.")
    a, b = whole.state_dict(), streamed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert not torch.equal(a["backbone.layers.0.mixer.in_proj.weight"], a["backbone.layers.3.mixer.in_proj.weight"])


def test_quantized_preset_is_built_block_by_block(monkeypatch):
    """``load_model(preset, quantization="fp8")`` quantises each block right after building it: when
    block i is finished, blocks 0..i-1 hold no 16-bit matrix that the on-load recipe converts (the
    peak is the FP8 model plus one 16-bit block: Super's 240 GB of bf16 never exist whole); the
    result equals quantising the whole 16-bit model."""
    from fastmamba.models import quantization
    from fastmamba.models.blocks import finishing_blocks as real_finishing

    bf16_left_at_each_block: list[int] = []
    built: list[nn.Module] = []

    def counting(finish):
        def run(block, name):
            bf16_left_at_each_block.append(sum(isinstance(m, nn.Linear) and not quantization.on_load_config().excluded(
                f"x.{n}") or type(m).__name__ == "Experts" for b in built for n, m in b.named_modules()))
            finish(block, name)
            built.append(block)
        return real_finishing(run)

    monkeypatch.setattr("fastmamba.models.building.finishing_blocks", counting)
    q = load_model("nemotron-3-tiny", device="cpu", quantization="fp8")
    assert len(built) == len(q.backbone.layers) and bf16_left_at_each_block == [0] * len(built)
    want = quantization.quantize_model(load_model("nemotron-3-tiny", device="cpu"))
    a, b = q.state_dict(), want.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8) if a[k].dtype == torch.float8_e4m3fn else a[k],
                           b[k].view(torch.uint8) if b[k].dtype == torch.float8_e4m3fn else b[k]), k


def test_quantized_preset_keeps_no_16bit_module_it_replaced(monkeypatch):
    """Built block by block into FP8, no replaced 16-bit module stays referenced while the rest is
    built (each conversion finds every earlier original freed): the list of the
    modules already initialised once held the originals, so every block's 16-bit matrices lived to
    the end (FP8 Nano on an 80 GB H100: out of memory at 79 GB, GPU run 23 of 2026-12-07)."""
    import gc

    replaced, alive_at_each_call = watch_replaced_modules(monkeypatch)
    model = load_model("nemotron-3-tiny", device="cpu", quantization="fp8")
    gc.collect()
    assert len(replaced) > 4 and isinstance(model.backbone.layers[0].mixer.in_proj, FP8Linear)
    assert alive_at_each_call == [0] * len(replaced)
    assert [r() for r in replaced if r() is not None] == []


def test_fp8_checkpoint_is_checked_on_meta_then_built_block_by_block(tmp_path, monkeypatch):
    """An FP8 checkpoint's plan is checked against a meta-device build (nothing allocated), then
    each block's FP8 modules replace its 16-bit ones as it is built (``swap_planned`` with the
    block's name), before the next block exists."""
    from fastmamba.models import building, quantization

    write_checkpoint(tmp_path, "ct-channel-token")
    calls: list[tuple[str, bool]] = []
    real_swap, real_check = quantization.swap_planned, quantization.check_plan

    def swap(model, plan, *, prefix=""):
        calls.append((prefix, any(isinstance(m, nn.Linear) and n in plan.linears for n, m in
                                  ((f"{prefix}.{r}" if prefix and r else prefix or r, m) for r, m in model.named_modules()))))
        return real_swap(model, plan, prefix=prefix)

    def check(model, plan):
        calls.append(("check:" + next(model.parameters()).device.type, False))
        return real_check(model, plan)
    for module in (quantization, building):  # (building's own references, and apply_plan's)
        monkeypatch.setattr(module, "swap_planned", swap)
        monkeypatch.setattr(module, "check_plan", check)
    model = load_nemotron_h(tmp_path, device="cpu")
    blocks = [c for c in calls if c[0].startswith("backbone.layers.")]
    assert calls[0] == ("check:meta", False) and len(blocks) == len(model.backbone.layers)
    assert any(had for _, had in blocks)  # the blocks' planned modules were swapped as they were built
    assert calls[-1] == ("", False)  # apply_plan's pass over the whole model found nothing left to swap
    assert any(isinstance(m, FP8Linear) for m in model.modules())


def test_a_preset_larger_than_the_gpu_is_refused_before_it_is_built(monkeypatch):
    """Nemotron-3 Super (123.6 B parameters with its MTP layer): 247 GB in bf16 is refused on any
    GPU with the FP8 size in the message; in FP8 (~126 GB) it is refused on 80 GB and let through on
    141 GB; on a CPU the bound is the available RAM. Nothing is built on the device for the check (the
    meta device only)."""
    from fastmamba.models.building import check_preset_fits
    from fastmamba.models.nemotron_h import PRESETS

    cuda = torch.device("cuda")
    meta = lambda: NemotronHLM(PRESETS["nemotron-3-super"], device="meta", dtype=torch.bfloat16)  # noqa: E731
    free = {"gib": 80}
    cached = {"gib": 0}  # reserved by torch's caching allocator but unallocated: free to this process
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["gib"] << 30, free["gib"] << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: (cached["gib"] + 1) << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 << 30)
    with pytest.raises(ValueError, match=r"preset 'nemotron-3-super' takes 230\.\d GiB of weights \(bfloat16\), "
                                         r"more than the 80\.0 GiB free on cuda; with quantization='fp8' "
                                         r"\(--quantization fp8\) it takes 11\d\.\d GiB"):
        check_preset_fits("nemotron-3-super", meta, cuda, torch.bfloat16, quantized=False)
    with pytest.raises(ValueError, match=r"takes 11\d\.\d GiB of weights \(FP8\), more than the 80\.0 GiB free"):
        check_preset_fits("nemotron-3-super", meta, cuda, torch.bfloat16, quantized=True)
    free["gib"] = 139
    check_preset_fits("nemotron-3-super", meta, cuda, torch.bfloat16, quantized=True)  # one H200
    free["gib"] = 75
    check_preset_fits("nemotron-3-nano", lambda: pytest.fail("the count settles it"), cuda, torch.bfloat16,
                      quantized=False)
    # a model freed in this process leaves its blocks in torch's cache: the driver says 3 GiB free, the
    # process can allocate 75 (GPU run 18: nano freed, then the 8b preset was refused with "3.3 GiB free")
    free["gib"], cached["gib"] = 3, 72
    check_preset_fits("nemotron-3-nano", lambda: pytest.fail("the count settles it"), cuda, torch.bfloat16,
                      quantized=False)
    cached["gib"] = 0
    with pytest.raises(ValueError, match=r"more than the 3\.0 GiB free on cuda"):
        check_preset_fits("nemotron-3-nano", lambda: NemotronHLM(PRESETS["nemotron-3-nano"], device="meta",
                                                                 dtype=torch.bfloat16),
                          cuda, torch.bfloat16, quantized=False)
    from fastmamba.models import building

    monkeypatch.setattr(building, "_available_ram", lambda: 64 << 30)  # a CPU: its available RAM
    with pytest.raises(ValueError, match=r"takes 460\.\d GiB of weights \(float32\), more than the 64\.0 GiB free on cpu"):
        check_preset_fits("nemotron-3-super", lambda: NemotronHLM(PRESETS["nemotron-3-super"], device="meta",
                                                                  dtype=torch.float32),
                          torch.device("cpu"), torch.float32, quantized=False)
    check_preset_fits("nemotron-3-tiny", lambda: pytest.fail("the count settles it"), torch.device("cpu"),
                      torch.float32, quantized=False)


def test_capacity_plan_counts_the_fp8_bytes(fp8_dir):
    """``meta_model`` (what ``fastmamba serve`` plans with before loading) of an FP8 checkpoint holds
    the FP8 modules the loader will build: its weight bytes equal the loaded model's, byte for byte
    (Super: ~126 GB planned, not the 247 GB of its bf16 form); the same for ``quantization="fp8"``."""
    from fastmamba.generation.capacity import meta_model, weight_bytes

    fmt, root = fp8_dir
    loaded = load_nemotron_h(root, device="cpu")
    meta = meta_model(str(root), torch.float32)
    assert weight_bytes(meta) == weight_bytes(loaded)
    assert [n for n, m in meta.named_modules() if isinstance(m, (FP8Linear, FP8Experts))] == \
        [n for n, m in loaded.named_modules() if isinstance(m, (FP8Linear, FP8Experts))]
    if fmt == FORMATS[0]:
        q = load_model("nemotron-3-tiny", device="cpu", quantization="fp8")
        assert weight_bytes(meta_model("nemotron-3-tiny", torch.float32, quantization="fp8")) == weight_bytes(q)
        assert weight_bytes(meta_model("nemotron-3-tiny", torch.float32)) > weight_bytes(q)
