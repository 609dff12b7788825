"""FP8 checkpoints: read their quantisation config, check their scales, and swap the model's
16-bit linears (and MoE experts) for ``fastmamba.layers.fp8_linear``'s FP8 modules before the
weights are copied.

Formats read (facts from NVIDIA ModelOpt's and llm-compressor's public docs):

  ModelOpt   ``hf_quant_config.json`` {"quantization": {"quant_algo", "kv_cache_quant_algo",
             "exclude_modules"}} or config.json's ``quantization_config`` with
             ``quant_method: modelopt`` (same fields; ``ignore`` accepted for ``exclude_modules``).
             quant_algo "FP8": per-tensor ``weight_scale`` [] and static ``input_scale`` [];
             "FP8_PER_CHANNEL_PER_TOKEN": per-channel ``weight_scale`` [N] / [N, 1], dynamic
             per-token activations. ``k_proj.k_scale`` / ``v_proj.v_scale`` (or ``mixer.k_scale`` /
             ``v_scale``) with kv_cache_quant_algo "FP8". Exclusions are fnmatch patterns.
             quant_algo "MIXED_PRECISION" (Nemotron-3 Super's releases): a ``quantized_layers`` map
             {module: {"quant_algo": ...}}, per expert for MoE experts; read when every entry is the
             same one of the two above (modules not listed stay in 16 bits); an NVFP4 entry or a mix
             of schemes is refused naming the module.
  compressed-tensors (llm-compressor)  config.json ``quantization_config`` {"quant_method":
             "compressed-tensors", "format": "float-quantized" | "naive-quantized", "config_groups":
             {name: {"targets": ["Linear"], "weights": {num_bits 8, type float, symmetric,
             strategy channel | tensor, dynamic false}, "input_activations": {num_bits 8, type float,
             dynamic true, strategy token} (or static strategy tensor)}}, "ignore": [names or
             "re:<regex>"], "kv_cache_scheme": null or 8-bit float per tensor}; tensors ``weight``
             (e4m3) and ``weight_scale`` ([N, 1] per channel, [1] per tensor), ``input_scale`` when static.

Anything else (NVFP4, block or group scales, int8, weight-only FP8, e5m2, asymmetric ...) raises a
ValueError naming the field and value, before a tensor is read.

K/V cache: a checkpoint with FP8 K/V (ModelOpt ``kv_cache_quant_algo: FP8``, compressed-tensors'
8-bit float ``kv_cache_scheme``) must ship ``k_scale`` and ``v_scale`` for every attention layer
(a missing, misshaped, non-finite or non-positive one is named); they are copied into the attention
modules' ``k_scale`` / ``v_scale`` buffers, and those layers ask for float8_e4m3fn K/V pages
(``Attention.kv_dtype``): the caches ``new_cache`` builds then store K / k_scale and V / v_scale
in e4m3, half the bytes of bf16. ``set_kv_cache_dtype(model, choice)`` (``Engine(kv_cache_dtype=)``,
``--kv-cache-dtype``) changes that: "fp8" for float8 pages on any model (the checkpoint's scales,
else 1.0 as vLLM does for a checkpoint without any: K and V then only need to fit e4m3's +-448,
which activations of these models do; calibrated scales are more accurate), "bf16" / "fp16" /
"fp32" for pages in the model's own dtype even when the checkpoint ships scales, "auto" for the
checkpoint's choice.
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable

import torch
from torch import nn

from fastmamba.layers.fp8_linear import FP8Experts, FP8Linear
from fastmamba.models.defaults import named_modules_in
from fastmamba.models.quant_config import (  # noqa: F401  (the configs' names, re-exported here)
    HF_QUANT_CONFIG, MODELOPT_ALGOS, ON_LOAD_EXCLUDE, QUANTIZATION_CHOICES, QuantConfig, check_quantization_arg,
    on_load_config, parse_compressed_tensors, parse_modelopt, read_quant_config)
from fastmamba.ops.fp8 import FP8_DTYPE


# ---------------------------------------------------------------------------------------------
# tensors


@dataclasses.dataclass
class QuantPlan:
    """What ``prepare_state_dict`` found: the FP8 linears and expert layers, and the K/V scales."""

    cfg: QuantConfig
    linears: dict[str, int]                      # module name -> out_features N
    experts: list[str]                           # MoE ``...mixer.experts`` module names with FP8 weights
    kv_scales: dict[str, tuple[torch.Tensor, torch.Tensor]]  # attention module name -> (k_scale, v_scale)


def _fp8_nan(t: torch.Tensor) -> bool:
    return bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())  # e4m3fn's NaN encodings


def _scale(sd: dict, name: str, *, n: int | None, problems: list[str], what: str) -> torch.Tensor | None:
    """Checked fp32 scale: one value ([] / [1]) or, with n, n values ([n] / [n, 1]); None on a problem."""
    t = sd.get(name)
    if t is None:
        problems.append(f"{name}: missing ({what})")
        return None
    if not t.is_floating_point() or t.element_size() < 2:
        problems.append(f"{name}: expected a 16- or 32-bit float scale, got {t.dtype}")
        return None
    want = [(), (1,)] if n is None else [(n,), (n, 1)]
    if tuple(t.shape) not in want:
        problems.append(f"{name}: expected shape {' or '.join(map(str, want))} ({what}), got {tuple(t.shape)}")
        return None
    t = t.float()
    if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
        bad = int((~torch.isfinite(t) | (t <= 0)).sum())
        problems.append(f"{name}: {bad} of {t.numel()} values are not finite and > 0 ({what})")
        return None
    return t.reshape(()) if n is None else t.reshape(n)


def _stack_expert_scales(sd: dict, layers: Iterable[int], n_experts: int, cfg: QuantConfig,
                         problems: list[str]) -> list[str]:
    """Per-expert FP8 tensors of NVIDIA's layout (``experts.{e}.up_proj.weight`` e4m3 with its
    ``weight_scale`` / ``input_scale``) -> the stacked scales FP8Experts holds; the weights
    themselves are stacked by ``weights.stack_experts``. Returns the expert modules found FP8."""
    found = []
    for i in layers:
        base = f"backbone.layers.{i}.mixer.experts"
        w0 = sd.get(f"{base}.0.up_proj.weight")
        fused = sd.get(f"{base}.up_proj")
        if fused is not None and fused.dtype == FP8_DTYPE:
            problems.append(f"{base}.up_proj: FP8 experts are read in NVIDIA's per-expert layout "
                            f"({base}.{{e}}.up_proj.weight + weight_scale), not the fused 3-D form")
            continue
        if w0 is None or w0.dtype != FP8_DTYPE:
            continue
        if cfg.excluded(base) or cfg.excluded(f"{base}.0.up_proj"):
            problems.append(f"{base}: excluded from quantisation by {cfg.source}, but its weights are FP8")
            continue
        for proj in ("up_proj", "down_proj"):
            ws, xs = [], []
            for e in range(n_experts):
                name = f"{base}.{e}.{proj}"
                w = sd.get(f"{name}.weight")
                if w is None:
                    continue  # stack_experts names the missing expert
                if w.dtype != FP8_DTYPE:
                    problems.append(f"{name}.weight: expected float8_e4m3fn like expert 0, got {w.dtype}")
                    continue
                if _fp8_nan(w):
                    problems.append(f"{name}.weight: holds FP8 NaN bytes")
                ws.append(_scale(sd, f"{name}.weight_scale", n=w.shape[0] if cfg.per_channel else None,
                                 problems=problems, what="weight scale"))
                sd.pop(f"{name}.weight_scale", None)
                if cfg.static_input:
                    xs.append(_scale(sd, f"{name}.input_scale", n=None, problems=problems, what="input scale"))
                sd.pop(f"{name}.input_scale", None)
            if ws and all(s is not None for s in ws):
                sd[f"{base}.{proj}_weight_scale"] = torch.stack(ws)
            if xs and all(s is not None for s in xs):
                # one activation scale for all experts (their maximum: no expert's inputs clip)
                sd[f"{base}.{proj}_input_scale"] = torch.stack(xs).max()
        found.append(base)
    return found


def prepare_state_dict(state_dict: dict[str, torch.Tensor], cfg: QuantConfig, *, moe_layers: Iterable[int] = (),
                       n_experts: int = 0, attn_layers: Iterable[int] = ()) -> QuantPlan:
    """Check an FP8 checkpoint's tensors against its config and bring the scales to the shapes the
    FP8 modules hold ([] per tensor, [N] per channel; per-expert scales stacked), **in place**,
    before any model exists. Raises one ValueError listing every problem: a missing, misshaped,
    non-finite or non-positive scale (named), FP8 NaN bytes, an FP8 weight of an excluded module,
    an FP8 tensor that no FP8 module takes; with an FP8 K/V cache, a ``k_scale`` / ``v_scale`` missing
    for one of ``attn_layers`` (the backbone's attention layer indices)."""
    problems: list[str] = []
    experts = _stack_expert_scales(state_dict, moe_layers, n_experts, cfg, problems)
    linears: dict[str, int] = {}
    for name in [n for n in state_dict if n.endswith(".weight")]:
        w = state_dict[name]
        if w.dtype != FP8_DTYPE or re.search(r"\.experts\.\d+\.(up|down)_proj\.weight$", name):
            continue
        mod = name[: -len(".weight")]
        if cfg.excluded(mod):
            problems.append(f"{name}: {mod!r} is excluded from quantisation by {cfg.source}, but its weight is FP8")
            continue
        if w.dim() != 2:
            problems.append(f"{name}: expected a 2-D FP8 matrix, got shape {tuple(w.shape)}")
            continue
        if _fp8_nan(w):
            problems.append(f"{name}: holds FP8 NaN bytes")
        s = _scale(state_dict, f"{mod}.weight_scale", n=w.shape[0] if cfg.per_channel else None, problems=problems,
                   what=f"{'per-channel' if cfg.per_channel else 'per-tensor'} weight scale")
        if s is not None:
            state_dict[f"{mod}.weight_scale"] = s
        if cfg.static_input:
            s = _scale(state_dict, f"{mod}.input_scale", n=None, problems=problems, what="static input scale")
            if s is not None:
                state_dict[f"{mod}.input_scale"] = s
        elif f"{mod}.input_scale" in state_dict:
            problems.append(f"{mod}.input_scale: unexpected, {cfg.source} asks for dynamic per-token activations")
        linears[mod] = w.shape[0]
    kv_scales: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    kv_names = [n for n in state_dict if re.search(r"\.(k_scale|v_scale)$", n)]
    for n in kv_names:
        t = state_dict.pop(n)
        attn = re.sub(r"(\.[kv]_proj)?\.[kv]_scale$", "", n)
        if not cfg.kv_cache_fp8:
            problems.append(f"{n}: unexpected, {cfg.source} has no FP8 K/V cache")
            continue
        tmp = {n: t}
        s = _scale(tmp, n, n=None, problems=problems, what="K/V cache scale")
        if s is not None:
            k, v = kv_scales.get(attn, (None, None))
            kv_scales[attn] = (s, v) if n.endswith("k_scale") else (k, s)
    for attn, (k, v) in kv_scales.items():
        if k is None or v is None:
            problems.append(f"{attn}: {'k_scale' if k is None else 'v_scale'} missing (the other is present)")
    if cfg.kv_cache_fp8:
        bad_names = {re.sub(r"(\.[kv]_proj)?\.[kv]_scale$", "", n) for n in kv_names}  # named above if corrupt
        for i in attn_layers:
            attn = f"backbone.layers.{i}.mixer"
            if attn not in kv_scales and attn not in bad_names:
                problems.append(f"{attn}.k_proj.k_scale, {attn}.v_proj.v_scale: missing ({cfg.source} asks for an "
                                "FP8 K/V cache: every attention layer needs both)")
    # anything else stored in FP8 would be cast to 16 bits silently by load_into
    taken = set(linears) | set(experts)

    def owner(n: str) -> str:  # the module a tensor belongs to (an expert's tensors: the experts module)
        m = re.match(r"(.*\.experts)\.\d+\.(up|down)_proj\.", n) or re.match(r"(.*\.experts)\.(up|down)_proj_", n)
        return m.group(1) if m else n.rsplit(".", 1)[0]
    for n, t in state_dict.items():
        if t.dtype == FP8_DTYPE and owner(n) not in taken:
            problems.append(f"{n}: stored in FP8 but fastmamba keeps this tensor in 16/32 bits")
        if n.endswith((".weight_scale", ".input_scale")) and owner(n) not in taken:
            problems.append(f"{n}: a scale without an FP8 weight")
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise ValueError(f"FP8 checkpoint ({cfg.source}): the tensors do not fit ({len(problems)} problem(s); "
                         "nothing was loaded)\n" + "\n".join("    " + p for p in shown))
    return QuantPlan(cfg, linears, experts, kv_scales)


# ---------------------------------------------------------------------------------------------
# modules


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def check_plan(model: nn.Module, plan: QuantPlan) -> None:
    """Raise ValueError naming every ``nn.Linear`` of ``model`` (which may live on the meta device)
    that the config neither excludes nor stores in FP8, and every planned name that is not a Linear
    of that shape (or an FP8 one already) or no MoE experts."""
    cfg = plan.cfg
    problems = []
    modules = dict(model.named_modules())
    for name, n_out in plan.linears.items():
        m = modules.get(name)
        if not isinstance(m, (nn.Linear, FP8Linear)) or m.out_features != n_out:
            problems.append(f"{name}: FP8 in the checkpoint, but the model has "
                            f"{type(m).__name__ if m is not None else 'no such module'} there")
    for name, m in modules.items():
        if isinstance(m, nn.Linear) and name not in plan.linears and not cfg.excluded(name):
            problems.append(f"{name}: in 16 bits in the checkpoint but not excluded by {cfg.source}")
    for name in plan.experts:
        if not hasattr(modules.get(name), "up_proj"):
            problems.append(f"{name}: FP8 experts in the checkpoint, but the model has no MoE experts there")
    if problems:
        raise ValueError(f"FP8 checkpoint ({cfg.source}): the model and the checkpoint's FP8 modules disagree "
                         f"({len(problems)} problem(s))\n" + "\n".join("    " + p for p in problems[:20]))


def empty_fp8(m: nn.Module, cfg: QuantConfig) -> nn.Module:
    """An empty FP8 module (``load_into`` fills it) in place of 16-bit module ``m`` (an ``nn.Linear``
    or a MoE layer's ``Experts``) on ``m``'s device (the meta device too), with ``cfg``'s scales (per
    channel or tensor, static inputs or not)."""
    if isinstance(m, nn.Linear):
        return FP8Linear(m.in_features, m.out_features, bias=m.bias is not None, per_channel=cfg.per_channel,
                         static_input=cfg.static_input, device=m.weight.device, dtype=m.weight.dtype)
    return FP8Experts(*m.up_proj.shape, per_channel=cfg.per_channel, static_input=cfg.static_input,
                      device=m.up_proj.device)


def swap_planned(model: nn.Module, plan: QuantPlan, *, prefix: str = "") -> nn.Module:
    """Replace the 16-bit modules of ``model`` that ``plan`` names (``prefix``: ``model``'s
    qualified name when it is one block of a model being built) with empty FP8 modules; modules that
    are FP8 already stay. No checks: ``check_plan`` does them."""
    targets = [rel for rel, name, m in named_modules_in(model, prefix)  # names only (see quantize_model)
               if (isinstance(m, nn.Linear) and name in plan.linears)
               or (name in plan.experts and type(m).__name__ == "Experts")]
    for rel in targets:  # one at a time: each 16-bit original is freed before the next
        _swap(model, rel, empty_fp8(model.get_submodule(rel), plan.cfg))
    return model


def fp8_twin(meta_model: nn.Module, cfg: QuantConfig) -> nn.Module:
    """``meta_model`` (built on the meta device) with the modules that an FP8 checkpoint of config
    ``cfg`` (or ``--quantization fp8``: ``on_load_config()``) holds in FP8 turned into FP8 meta
    modules: the structure, and the bytes, of the model once loaded (the capacity plan's weights:
    Nemotron-3 Super plans at ~126 GB, not its 247 GB of bf16). In place; returns it."""
    for rel, _ in fp8_targets(meta_model, cfg):
        _swap(meta_model, rel, empty_fp8(meta_model.get_submodule(rel), cfg))
    return meta_model


def apply_plan(model: nn.Module, plan: QuantPlan) -> nn.Module:
    """Replace the model's modules named by ``plan`` with empty FP8 modules (``load_into`` then
    copies the checkpoint's bytes) and set the attention layers' K/V scales. Raises ValueError
    (``check_plan``) before anything is swapped. Modules swapped already (a block of a model built
    under ``finishing_blocks`` with ``swap_planned``) stay."""
    check_plan(model, plan)
    swap_planned(model, plan)
    for attn, (k, v) in plan.kv_scales.items():
        m = model.get_submodule(attn)
        m.k_scale.copy_(k)
        m.v_scale.copy_(v)
        if attn.startswith("backbone."):  # the checkpoint's choice: float8 pages (set_kv_cache_dtype changes it)
            m.kv_dtype = FP8_DTYPE
    model.quantization = plan.cfg
    return model


# ---------------------------------------------------------------------------------------------
# the K/V cache dtype

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "bf16", "fp16", "fp32")  # Engine(kv_cache_dtype=) / --kv-cache-dtype
_16_BIT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _attention_layers(model: nn.Module) -> list[nn.Module]:
    """The backbone's attention mixers (an MTP drafter keeps its own 16-bit pages)."""
    from fastmamba.layers.attention import Attention

    layers = getattr(getattr(model, "backbone", None), "layers", ())
    return [b.mixer for b in layers if isinstance(getattr(b, "mixer", None), Attention)]


def set_kv_cache_dtype(model: nn.Module, choice: str | None) -> str:
    """Set the K/V page dtype ``model``'s caches get (``new_cache``; each attention layer's
    ``kv_dtype``) and say which, for the start-up log.

    choice  None: leave the model's setting (what loading chose), only say what it is;
            "auto": the checkpoint's (float8 when it ships k_scale / v_scale, else the model's dtype);
            "fp8" / "fp8_e4m3": float8_e4m3fn with the checkpoint's scales, else 1.0;
            "bf16" / "fp16" / "fp32": the model's own dtype (named, so a typo is not silently
            another dtype), float8 scales left unused
    Raises ValueError for another value, a 16/32-bit name that is not the model's dtype, or a
    choice other than "auto" for a model without attention layers (it has no K/V pages)."""
    if choice is None:
        return kv_cache_note(model)
    if choice not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: expected None or one of {KV_CACHE_DTYPES}, got {choice!r}")
    layers = _attention_layers(model)
    if not layers and choice != "auto":
        raise ValueError(f"kv_cache_dtype: {choice!r} sets the dtype of K/V pages; {type(model).__name__} has no "
                         "attention layers (use None or 'auto')")
    dtype = model.lm_head.weight.dtype
    if choice in _16_BIT and _16_BIT[choice] != dtype:
        raise ValueError(f"kv_cache_dtype: {choice!r} is not the model's dtype ({dtype}); K/V pages are kept in the "
                         "model's dtype or in fp8 ('auto', 'fp8')")
    from_ckpt = bool(getattr(getattr(model, "quantization", None), "kv_cache_fp8", False))
    fp8 = choice in ("fp8", "fp8_e4m3") or (choice == "auto" and from_ckpt)
    for m in layers:
        m.kv_dtype = FP8_DTYPE if fp8 else None
        if fp8 and not from_ckpt:  # no checkpoint scales: 1.0
            m.k_scale.fill_(1.0)
            m.v_scale.fill_(1.0)
    return kv_cache_note(model)


def plan_kv_cache_dtype(model: nn.Module, path: str | os.PathLike, choice: str | None) -> str:
    """For a model built from a checkpoint's config alone (``capacity.meta_model``, no weights read):
    the K/V page dtype loading ``path`` and then ``set_kv_cache_dtype(choice)`` would give, set on
    it (float8 when the checkpoint's quantisation config has an FP8 K/V cache: its scales come with
    the weights); returns ``set_kv_cache_dtype``'s note."""
    q = read_quant_config(path) if os.path.isdir(os.fspath(path)) else None
    if q is not None and q.kv_cache_fp8:
        model.quantization = q
        for m in _attention_layers(model):
            m.kv_dtype = FP8_DTYPE
    return set_kv_cache_dtype(model, choice)


def kv_cache_note(model: nn.Module) -> str:
    """What ``set_kv_cache_dtype`` would say of the model's current setting (the loader's choice)."""
    layers = _attention_layers(model)
    if not layers:
        return "no K/V pages (no attention layers)"
    if layers[0].kv_dtype != FP8_DTYPE:
        return f"{str(model.lm_head.weight.dtype).replace('torch.', '')} (the model's dtype)"
    from_ckpt = bool(getattr(getattr(model, "quantization", None), "kv_cache_fp8", False))
    return ("float8_e4m3fn (k_scale / v_scale from the checkpoint)" if from_ckpt
            else "float8_e4m3fn (k_scale = v_scale = 1.0: the checkpoint ships no K/V scales)")


@torch.no_grad()
def quantize_model(model: nn.Module, *, prefix: str = "") -> nn.Module:
    """``--quantization fp8``: a loaded 16-bit model's linears (Mamba in/out projections, MLPs,
    shared experts, latent projections) and routed experts quantised in place to e4m3 with
    per-channel weight scales and dynamic per-token activations; attention Q/K/V/O, lm_head, the
    router (fp32) and conv1d stay as they are. One module at a time, each 16-bit original freed
    before the next is converted: the peak is the 16-bit model plus one module's FP8 copy (Nano's
    63 GB of bf16 weights fit an 80 GB H100 this way). Modules that are FP8 already stay.

    ``prefix``: ``model``'s qualified name when it is one block of a model being built (the
    exclusions match the whole model's names); see ``random_quantized``."""
    cfg = on_load_config()
    # names only: a list of the modules would keep every 16-bit weight alive to the end
    targets = [(name, FP8Experts.from_experts if experts else FP8Linear.from_linear)
               for name, experts in fp8_targets(model, cfg, prefix=prefix)]
    for name, convert in targets:  # one module at a time: its 16-bit weights are freed before the next
        _swap(model, name, convert(model.get_submodule(name)))
    if not prefix:
        model.quantization = cfg
    return model


def fp8_targets(model: nn.Module, cfg: QuantConfig, *, prefix: str = "") -> list[tuple[str, bool]]:
    """(name relative to ``model``, is-experts) of each 16-bit module that ``cfg`` keeps in FP8: the
    Linears it does not exclude (not a head tied to the embeddings) and the MoE layers' routed
    experts it does not exclude. With ``on_load_config()``: what ``quantize_model`` converts."""
    embeddings = getattr(getattr(model, "backbone", None), "embeddings", None)
    tied = getattr(embeddings, "weight", None)
    out = []
    for rel, name, m in named_modules_in(model, prefix):
        if isinstance(m, nn.Linear) and not cfg.excluded(name):
            if m.weight is not tied:  # (a head tied to the embeddings stays)
                out.append((rel, False))
        elif name.endswith("experts") and type(m).__name__ == "Experts" and not cfg.excluded(name):
            out.append((rel, True))
    return out


def prepare_fp8_checkpoint(path: str | os.PathLike, state_dict: dict[str, torch.Tensor], model_cfg) -> QuantPlan | None:
    """The loader's hook, called right after the checkpoint is read (before ``check_finite`` and
    ``stack_experts``): None for a 16-bit checkpoint; otherwise the config parsed and refused if
    unsupported, the tensors checked and their scales reshaped in place (``prepare_state_dict``).
    ``model_cfg``: the model's config (``layers_of("E")`` and ``n_routed_experts`` for MoE models)."""
    qcfg = read_quant_config(path)
    if qcfg is None:
        fp8 = [n for n, t in state_dict.items() if t.dtype == FP8_DTYPE]
        if fp8:
            raise ValueError(f"FP8 checkpoint: {os.fspath(path)!r} stores {len(fp8)} tensor(s) in FP8 (e.g. {fp8[0]!r}) "
                             f"but neither config.json's quantization_config nor {HF_QUANT_CONFIG} says how to read them")
        return None
    layers = model_cfg.layers_of("E") if hasattr(model_cfg, "layers_of") else ()
    attn = model_cfg.layers_of("*") if hasattr(model_cfg, "layers_of") else ()
    return prepare_state_dict(state_dict, qcfg, moe_layers=layers, n_experts=getattr(model_cfg, "n_routed_experts", 0),
                              attn_layers=attn)
