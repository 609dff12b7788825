"""Quantisation configs of FP8 checkpoints, read before any tensor: ModelOpt's (``hf_quant_config.json``
or a modelopt ``quantization_config``; FP8, FP8_PER_CHANNEL_PER_TOKEN, and MIXED_PRECISION of one of
them) and compressed-tensors' (llm-compressor); ``--quantization fp8``'s on-load recipe. What each
field means and what is refused: ``fastmamba.models.quantization``'s docstring."""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
from typing import Any

HF_QUANT_CONFIG = "hf_quant_config.json"
MODELOPT_ALGOS = {"FP8": (False, True), "FP8_PER_CHANNEL_PER_TOKEN": (True, False)}  # (per_channel, static_input)
QUANTIZATION_CHOICES = ("fp8",)  # load_model(..., quantization=) / --quantization
# --quantization fp8 keeps these in 16 bits (NVIDIA's FP8 Nemotron recipe: attention Q/K/V/O and lm_head)
ON_LOAD_EXCLUDE = ("lm_head", "*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """What a checkpoint's quantisation config promises."""

    method: str                 # "modelopt", "compressed-tensors" or "fp8" (quantised on load)
    per_channel: bool           # weight scales per output channel (else one per tensor)
    static_input: bool          # activation scales from the checkpoint (``input_scale``), else per token
    kv_cache_fp8: bool          # the checkpoint ships k_scale / v_scale
    exclude: tuple[str, ...]    # module-name patterns kept in 16 bits
    source: str                 # the file and field it came from (for error messages)
    # ModelOpt MIXED_PRECISION: the modules its ``quantized_layers`` lists and every dotted prefix of
    # them (an MoE layer's ``experts`` for its per-expert entries); any other module stays in 16 bits
    include: frozenset[str] | None = None

    def excluded(self, name: str) -> bool:
        """Whether module ``name`` (e.g. ``backbone.layers.3.mixer.in_proj``) is kept in 16 bits."""
        if self.include is not None and name not in self.include:
            return True
        for pat in self.exclude:
            if pat.startswith("re:"):
                if re.match(pat[3:], name):
                    return True
            elif fnmatch.fnmatchcase(name, pat) or name == pat:
                return True
        return False


# ---------------------------------------------------------------------------------------------
# configs


def _bad(source: str, field: str, msg: str) -> ValueError:
    return ValueError(f"FP8 checkpoint: {source}: `{field}` {msg}")


def _names(source: str, field: str, v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
        raise _bad(source, field, f"expected a list of module names or patterns, got {v!r}")
    return tuple(v)


def _mixed_precision(q: dict, source: str) -> tuple[str, frozenset[str]]:
    """ModelOpt's MIXED_PRECISION: a ``quantized_layers`` map {module: {"quant_algo": ...}} (per-expert
    names for MoE experts). Read when every entry is one of MODELOPT_ALGOS, the same one; anything
    else (NVFP4 experts, a mix of FP8 scale schemes) is named. Returns (that algo, the modules listed
    and every dotted prefix of them)."""
    layers = q.get("quantized_layers")
    if not isinstance(layers, dict) or not layers:
        raise _bad(source, "quantized_layers", "expected a non-empty object {module: {\"quant_algo\": ...}} "
                   f"with quant_algo MIXED_PRECISION, got {type(layers).__name__}")
    first: dict[str, str] = {}  # algo -> the first module that has it
    for name, spec in layers.items():
        algo = spec.get("quant_algo") if isinstance(spec, dict) else None
        if algo not in MODELOPT_ALGOS:
            raise _bad(source, f"quantized_layers[{name!r}].quant_algo", f"{algo!r} is not supported; fastmamba "
                       f"reads {', '.join(MODELOPT_ALGOS)} (NVFP4, FP8_PB_WO, INT8, W4A16 ... are not)")
        if spec.get("group_size") not in (None, 0, -1):
            raise _bad(source, f"quantized_layers[{name!r}].group_size",
                       f"{spec['group_size']!r}: group / block scales are not supported")
        first.setdefault(algo, name)
    if len(first) > 1:
        raise _bad(source, "quantized_layers", "mixes " + ", ".join(f"{a} ({n}, ...)" for a, n in first.items())
                   + ": fastmamba reads one FP8 scale scheme per checkpoint")
    include = set()
    for name in layers:
        parts = name.split(".")
        include.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return next(iter(first)), frozenset(include)


def parse_modelopt(q: dict, source: str) -> QuantConfig:
    """ModelOpt's fields (``hf_quant_config.json``'s "quantization" or a modelopt quantization_config)."""
    algo = q.get("quant_algo")
    include = None
    if algo == "MIXED_PRECISION":
        algo, include = _mixed_precision(q, source)
    elif algo not in MODELOPT_ALGOS:
        raise _bad(source, "quant_algo", f"{algo!r} is not supported; fastmamba reads "
                   f"{', '.join(MODELOPT_ALGOS)} or MIXED_PRECISION of one of them (NVFP4, FP8_PB_WO, INT8, "
                   "W4A16 ... are not)")
    for key in ("has_zero_point", "pre_quant_scale"):  # asymmetric / AWQ-style smoothing: not plain FP8
        if q.get(key) not in (None, False):
            raise _bad(source, key, f"{q.get(key)!r} is not supported; expected false or absent for FP8")
    gs = q.get("group_size")
    if gs not in (None, 0, -1) and include is None:  # (MIXED_PRECISION: per entry, above)
        raise _bad(source, "group_size", f"{gs!r}: group / block scales are not supported")
    kv = q.get("kv_cache_quant_algo")
    if isinstance(q.get("kv_cache_scheme"), dict) and kv is None:
        kv = _kv_scheme(q["kv_cache_scheme"], source)
    if kv not in (None, "FP8"):
        raise _bad(source, "kv_cache_quant_algo", f"{kv!r} is not supported; expected null or 'FP8'")
    excl = q.get("exclude_modules", q.get("ignore"))
    per_channel, static = MODELOPT_ALGOS[algo]
    return QuantConfig("modelopt", per_channel, static, kv == "FP8",
                       _names(source, "exclude_modules", excl), source, include)


def _kv_scheme(kv: Any, source: str) -> str | None:
    if kv is None:
        return None
    if not isinstance(kv, dict) or kv.get("num_bits") != 8 or kv.get("type") != "float" \
            or kv.get("strategy", "tensor") != "tensor":
        raise _bad(source, "kv_cache_scheme", f"{kv!r} is not supported; expected 8-bit float per tensor or null")
    return "FP8"


def _args(source: str, field: str, a: Any, *, strategies: tuple[str, ...], dynamic: bool | None) -> dict:
    if not isinstance(a, dict):
        raise _bad(source, field, f"expected an object, got {a!r}")
    if a.get("num_bits") != 8 or a.get("type") != "float":
        raise _bad(source, field, f"num_bits={a.get('num_bits')!r} type={a.get('type')!r} is not supported; "
                   "expected num_bits 8 type 'float' (FP8 e4m3)")
    if a.get("symmetric", True) is not True:
        raise _bad(source, f"{field}.symmetric", f"{a.get('symmetric')!r}: only symmetric FP8 is supported")
    if a.get("strategy") not in strategies:
        raise _bad(source, f"{field}.strategy", f"{a.get('strategy')!r} is not supported; expected one of {strategies}")
    for key in ("group_size", "block_structure"):
        if a.get(key) is not None:
            raise _bad(source, f"{field}.{key}", f"{a.get(key)!r}: group / block scales are not supported")
    if dynamic is not None and bool(a.get("dynamic", False)) != dynamic:
        raise _bad(source, f"{field}.dynamic", f"{a.get('dynamic')!r} does not fit strategy {a.get('strategy')!r}")
    return a


def parse_compressed_tensors(q: dict, source: str) -> QuantConfig:
    """llm-compressor's ``quantization_config`` (quant_method compressed-tensors), FP8 W8A8 only."""
    fmt = q.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _bad(source, "format", f"{fmt!r} is not supported; expected 'float-quantized' (FP8 weights stored "
                   "as e4m3)")
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise _bad(source, "quantization_status", f"{status!r}: expected 'compressed' (weights stored in FP8)")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _bad(source, "config_groups", f"expected at least one group, got {groups!r}")
    schemes = set()
    for name, g in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(g, dict):
            raise _bad(source, where, f"expected an object, got {g!r}")
        if g.get("targets") != ["Linear"]:
            raise _bad(source, f"{where}.targets", f"{g.get('targets')!r} is not supported; expected ['Linear']")
        w = _args(source, f"{where}.weights", g.get("weights"), strategies=("channel", "tensor"), dynamic=False)
        a = g.get("input_activations")
        if a is None:
            raise _bad(source, f"{where}.input_activations", "is null (weight-only FP8, W8A16) is not supported; "
                       "expected FP8 activations (dynamic per token or static per tensor)")
        a = _args(source, f"{where}.input_activations", a, strategies=("token", "tensor"), dynamic=None)
        if (a["strategy"] == "token") != bool(a.get("dynamic", False)):
            raise _bad(source, f"{where}.input_activations", f"strategy {a['strategy']!r} with dynamic="
                       f"{a.get('dynamic')!r} is not supported; expected dynamic token or static tensor")
        if g.get("output_activations") is not None:
            raise _bad(source, f"{where}.output_activations", "is not supported (expected null)")
        schemes.add((w["strategy"] == "channel", a["strategy"] == "tensor"))
    if len(schemes) > 1:
        raise _bad(source, "config_groups", "mixes FP8 schemes across groups; fastmamba reads one scheme per model")
    per_channel, static = schemes.pop()
    kv = _kv_scheme(q.get("kv_cache_scheme"), source)
    return QuantConfig("compressed-tensors", per_channel, static, kv == "FP8",
                       _names(source, "ignore", q.get("ignore")), source)


def read_quant_config(path: str | os.PathLike, config: dict | None = None) -> QuantConfig | None:
    """The FP8 scheme of checkpoint directory ``path`` (config.json's ``quantization_config``, else
    ``hf_quant_config.json``), or None for a 16-bit checkpoint. Raises ValueError naming the file and
    field for an unknown or unsupported scheme."""
    root = os.fspath(path)
    if config is None:
        with open(os.path.join(root, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    q = config.get("quantization_config") if isinstance(config, dict) else None
    if q is not None:
        source = f"{os.path.join(root, 'config.json')} quantization_config"
        if not isinstance(q, dict):
            raise _bad(source, "quantization_config", f"expected an object, got {q!r}")
        method = q.get("quant_method")
        if method == "modelopt":
            return parse_modelopt(q, source)
        if method == "compressed-tensors":
            return parse_compressed_tensors(q, source)
        raise _bad(source, "quant_method", f"{method!r} is not supported; fastmamba reads FP8 from 'modelopt' and "
                   "'compressed-tensors' (fp8 / gptq / awq / bitsandbytes ... are not)")
    hf = os.path.join(root, HF_QUANT_CONFIG)
    if os.path.isfile(hf):
        try:
            with open(hf, encoding="utf-8") as f:
                data = json.load(f)
        except ValueError as e:
            raise ValueError(f"FP8 checkpoint: {hf} is not valid JSON: {e}") from e
        if not isinstance(data, dict) or not isinstance(data.get("quantization"), dict):
            raise _bad(hf, "quantization", "expected an object holding quant_algo")
        return parse_modelopt(data["quantization"], hf)
    return None


def on_load_config() -> QuantConfig:
    """``--quantization fp8``: per-channel weights, dynamic per-token activations, attention and
    lm_head kept in 16 bits."""
    return QuantConfig("fp8", True, False, False, ON_LOAD_EXCLUDE, "--quantization fp8")


def check_quantization_arg(quantization: Any, where: str = "load_model") -> str | None:
    if quantization is None:
        return None
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"{where}: `quantization` expected None or one of {QUANTIZATION_CHOICES}, got {quantization!r}")
    return quantization
