"""``python -m fastmamba.bench hf``: transformers' ``generate`` with and without fastmamba as its
kernel provider (fastmamba.integrations.transformers), on one checkpoint.

A random-weight checkpoint of a preset's shape (``mamba2-2.7b``, ``nemotron-h-8b``, any fastmamba
preset) is written with ``save_pretrained`` into a temporary directory and loaded back with
``from_pretrained``, as a user's model would be. Then greedy ``generate`` (``--new-tokens`` exactly,
prompt of ``--prompt-len`` random ids) is timed per batch size and provider:

  torch      transformers' PyTorch path (its function hooks forced to their torch code)
  default    transformers as loaded: mamba_ssm's / causal_conv1d's ops where they import (a row
             only when one of them does; otherwise it is the torch path)
  mamba_ssm  the torch path with mamba_ssm's Triton scan ops in the scan hooks (what transformers
             picks when mamba_ssm imports; a row only on a GPU where its ops load)
  fastmamba-eager  ``use(model, cuda_graphs=False)``: fastmamba's ops, every step launched from Python
  fastmamba  ``fastmamba.integrations.transformers.use(model)``: the same, decode steps replayed
             from CUDA graphs (fastmamba.integrations.hf_graphs)

Each timing is the median of ``--repeats`` runs after a short warm-up; the table gives seconds,
generated tokens/s (batch x new tokens / time), ms per generated step, the speedup over the torch
path and over the default path, and how many greedy tokens match the torch path's.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import statistics
import sys
import tempfile
import time
from types import MethodType

import torch

_FUNCTION_HOOKS = ("causal_conv1d_fn", "causal_conv1d_update", "selective_state_update",
                   "mamba_chunk_scan_combined")
PROVIDERS = ("torch", "default", "mamba_ssm", "fastmamba-eager", "fastmamba")


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return vals


def _providers(text: str) -> list[str]:
    vals = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in vals if v not in PROVIDERS]
    if not vals or bad:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(PROVIDERS)}, got {text!r}")
    return vals


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a fastmamba preset (mamba2-2.7b, nemotron-h-8b, ...; default mamba2-2.7b on a GPU, "
                             "mamba2-tiny on a CPU) or a transformers checkpoint directory")
    parser.add_argument("--batch", type=_int_list, default=None, help="comma-separated (default 1,16; 1 on a CPU)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated (default 256; 8 on a CPU)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128; 8 on a CPU)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                        help="weights and activations (default bf16 on a GPU, fp32 on a CPU)")
    parser.add_argument("--providers", type=_providers, default=list(PROVIDERS),
                        help=f"comma-separated from {','.join(PROVIDERS)} (default: all)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per row, median (default 3; 1 on a CPU)")
    parser.add_argument("--json", metavar="PATH", help="append one JSON line per row")


def hf_config(name: str, dtype: torch.dtype):
    """transformers' config for a fastmamba preset's shape."""
    import transformers

    from fastmamba.models.config import PRESETS as MAMBA2
    from fastmamba.models.nemotron_h import PRESETS as HYBRID

    if name in MAMBA2:
        c = MAMBA2[name]
        return transformers.Mamba2Config(
            hidden_size=c.d_model, num_hidden_layers=c.n_layer, vocab_size=c.vocab_size, state_size=c.d_state,
            conv_kernel=c.d_conv, expand=c.expand, head_dim=c.headdim, num_heads=c.expand * c.d_model // c.headdim,
            n_groups=c.ngroups, chunk_size=c.chunk_size, use_conv_bias=c.conv_bias, use_bias=c.proj_bias,
            layer_norm_epsilon=c.norm_eps, tie_word_embeddings=c.tie_embeddings, dtype=dtype,
            pad_token_id=0, eos_token_id=None, bos_token_id=None)
    if name in HYBRID:
        c = HYBRID[name]
        kw = dict(vocab_size=c.vocab_size, hidden_size=c.d_model, hybrid_override_pattern=c.pattern,
                  num_hidden_layers=len(c.pattern), num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                  head_dim=c.head_dim, intermediate_size=c.intermediate_size, mlp_hidden_act=c.mlp_act,
                  mlp_bias=c.mlp_bias, mamba_num_heads=c.mamba_nheads, mamba_head_dim=c.mamba_headdim,
                  n_groups=c.n_groups, ssm_state_size=c.d_state, conv_kernel=c.d_conv, chunk_size=c.chunk_size,
                  use_conv_bias=c.conv_bias, use_bias=c.mamba_proj_bias, layer_norm_epsilon=c.norm_eps,
                  tie_word_embeddings=c.tie_embeddings, dtype=dtype, pad_token_id=0, eos_token_id=None,
                  bos_token_id=None)
        if "E" in c.pattern:
            kw.update(n_routed_experts=c.n_routed_experts, num_experts_per_tok=c.num_experts_per_tok,
                      moe_intermediate_size=c.moe_intermediate_size,
                      moe_shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size,
                      moe_latent_size=c.moe_latent_size, n_group=c.n_group, topk_group=c.topk_group,
                      norm_topk_prob=c.norm_topk_prob, routed_scaling_factor=c.routed_scaling_factor)
        return transformers.NemotronHConfig(**kw)
    raise ValueError(f"--model: {name!r} is neither a directory nor a preset ({', '.join([*MAMBA2, *HYBRID])})")


def write_checkpoint(name: str, path: str, dtype: torch.dtype, device: torch.device) -> None:
    """A random-weight checkpoint of preset ``name`` at ``path`` (save_pretrained, ``dtype``)."""
    import transformers

    cfg = hf_config(name, dtype)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(path)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


_MODULE_FUNCTIONS = ("causal_conv1d_fn", "causal_conv1d_update", "mamba2_selective_state_update", "mamba2_chunk_scan")


def _closure(fn, name: str):
    """The value of free variable ``name`` in ``fn``'s closure (None if absent)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None:
        return None
    for var, cell in zip(code.co_freevars, cells):
        if var == name:
            return cell.cell_contents
    return None


def _hook_function(obj):
    """transformers' function behind a modeling-module hook: the function itself, or the one a
    kernels ``Func`` module (kernels installed) was built from."""
    if isinstance(obj, torch.nn.Module):
        return _closure(type(obj).forward, "func")
    return obj


def _mixer_modules(model) -> list:
    import importlib

    return sorted({importlib.import_module(type(m).__module__) for m in model.modules()
                   if type(m).__name__ in ("Mamba2Mixer", "NemotronHMamba2Mixer")}, key=lambda m: m.__name__)


# the modeling module's function behind each hook name (transformers 5.25)
_MODULE_FUNCTION_OF = dict(zip(_FUNCTION_HOOKS, _MODULE_FUNCTIONS))


def _with_kwargs_of(fn):
    """``fn`` called with only the keyword arguments it declares (transformers' hub fallback does
    the same for an original package's function)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn
    return lambda *a, **k: fn(*a, **{n: v for n, v in k.items() if n in params})


def force_torch_path(model, overrides: dict | None = None) -> list:
    """Make the model's Mamba function hooks run transformers' PyTorch code (not mamba_ssm's /
    causal_conv1d's), or ``overrides[hook name]`` where given (a function with the hook's
    signature, e.g. mamba_ssm's Triton op); returns what changed, for ``release_torch_path``. With
    per-mixer wrappers (kernels installed) each wrapper's instance ``forward``; without, the
    modeling module's functions themselves (for the duration of the row)."""
    overrides = {n: _with_kwargs_of(f) for n, f in (overrides or {}).items()}
    changed = []
    for m in model.modules():
        funcs = getattr(m, "_kernel_funcs", None)
        if not isinstance(funcs, dict) or not all(n in funcs for n in _FUNCTION_HOOKS):
            continue
        for name in _FUNCTION_HOOKS:
            w = funcs[name]
            fn = overrides.get(name) or _hook_function(w)
            if fn is None:
                raise RuntimeError(f"cannot find transformers' torch code behind hook {name}")
            fn = inspect.unwrap(fn)
            w.__dict__["forward"] = MethodType(lambda self, *a, _fn=fn, **k: _fn(*a, **k), w)
            changed.append(("instance", w, None))
    if changed:
        return changed
    by_attr = {_MODULE_FUNCTION_OF[n]: f for n, f in overrides.items()}
    for mod in _mixer_modules(model):
        for attr in _MODULE_FUNCTIONS:
            original = getattr(mod, attr, None)
            fn = by_attr.get(attr) or _hook_function(original)
            if fn is None:
                continue
            setattr(mod, attr, inspect.unwrap(fn))
            changed.append(("module", mod, (attr, original)))
    if not changed:
        raise RuntimeError("found no Mamba function hooks to switch to transformers' torch code")
    return changed


def release_torch_path(changed: list) -> None:
    for kind, obj, extra in reversed(changed):
        if kind == "instance":
            obj.__dict__.pop("forward", None)
        else:
            setattr(obj, *extra)


def default_ops(model) -> str:
    """What transformers' Mamba function hooks run on a GPU by default: the packages its hooks
    resolved to at import ('torch' when none did: the default path is then the torch path)."""
    found = set()
    for mod in _mixer_modules(model):
        for attr in _MODULE_FUNCTIONS:
            fn = _hook_function(getattr(mod, attr, None))
            impl, torch_fn = _closure(fn, "implementation"), _closure(fn, "torch_function")
            if impl is not None and torch_fn is not None and impl is not torch_fn:
                found.add(impl.__module__.split(".")[0])
    return "+".join(sorted(found)) if found else "torch"


def mamba_ssm_hooks(device: torch.device) -> tuple[dict, str]:
    """mamba_ssm's Triton scan ops for transformers' ``selective_state_update`` and
    ``mamba_chunk_scan_combined`` hooks, as transformers itself would pick them were ``import
    mamba_ssm`` to work (its pure-Python wheel's package import needs CUDA extensions: the ops are
    loaded without it, fastmamba.bench.peers); the conv hooks keep transformers' torch code
    (causal_conv1d is a CUDA build). Returns ({hook name: function}, "") or ({}, why not)."""
    if device.type != "cuda":
        return {}, "mamba_ssm's Triton ops need a CUDA device"
    from fastmamba.bench import peers

    ssu, scan = peers.mamba_ssm_selective_state_update(), peers.mamba_ssm_chunk_scan_combined()
    if not (ssu.available and scan.available):
        return {}, ssu.reason or scan.reason
    return {"selective_state_update": ssu.fn, "mamba_chunk_scan_combined": scan.fn}, ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_generate(model, ids: torch.Tensor, new_tokens: int, repeats: int, device: torch.device):
    """Median seconds of greedy generate of exactly ``new_tokens`` tokens, the tokens [B, new_tokens]
    and the prompt's last-position logits [B, V] fp32 (one more forward, untimed)."""
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True,
              attention_mask=torch.ones_like(ids))
    times, out = [], None
    with torch.no_grad():
        model.generate(ids, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up: compiles, allocates
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            out = model.generate(ids, **kw)
            _sync(device)
            times.append(time.perf_counter() - t0)
        last = model(ids, attention_mask=kw["attention_mask"]).logits[:, -1].float()  # the prompt's last logits
    return statistics.median(times), out[:, ids.shape[1]:], last


def run(args: argparse.Namespace, command: str) -> int:
    import transformers

    from fastmamba.integrations import transformers as provider

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    name = args.model or ("mamba2-2.7b" if cuda else "mamba2-tiny")
    batches = args.batch or ([1, 16] if cuda else [1])
    new_tokens = args.new_tokens if args.new_tokens is not None else (256 if cuda else 8)
    prompt_len = args.prompt_len if args.prompt_len is not None else (128 if cuda else 8)
    repeats = args.repeats if args.repeats is not None else (3 if cuda else 1)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if cuda else "fp32")]
    for flag, v in (("--new-tokens", new_tokens), ("--prompt-len", prompt_len), ("--repeats", repeats)):
        if v < 1:
            print(f"error: {flag} must be >= 1, got {v}", file=sys.stderr)
            return 2
    try:
        provider.check_transformers_version()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory(prefix="fastmamba_hf_") as tmp:
        import os

        path = name if os.path.isdir(name) else tmp
        if path == tmp:
            t0 = time.perf_counter()
            write_checkpoint(name, tmp, dtype, device)
            print(f"# {name}: random weights, save_pretrained in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        # no device_map (it needs accelerate): load, then move
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_kernels=False)
        model = model.to(device).eval()
        rows = _measure(model, name, batches, new_tokens, prompt_len, repeats, device, dtype, args.providers)
        default = default_ops(model) if device.type == "cuda" else "torch"
        del model

    from fastmamba.bench.env import collect

    header = {**collect(device, command), "transformers": transformers.__version__, "default_ops": default}
    if not cuda:
        header["device"] += " (ops: PyTorch references, or Triton's interpreter with TRITON_INTERPRET=1)"
    print(format_table(rows, header))
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps({**header, **r}) + "\n")
    return 0


def _measure(model, name, batches, new_tokens, prompt_len, repeats, device, dtype, providers) -> list[dict]:
    from fastmamba.integrations import transformers as provider

    vocab = model.config.vocab_size
    rows = []
    # transformers sends CPU tensors to its torch code whatever imported
    default = default_ops(model) if device.type == "cuda" else "torch"
    for b in batches:
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(1, vocab, (b, prompt_len), generator=g).to(device)
        results: dict[str, tuple[float, torch.Tensor, torch.Tensor]] = {}
        for p in providers:
            if p == "default" and default == "torch":
                continue  # the same path as "torch"
            if p in ("torch", "mamba_ssm"):
                overrides = {}
                if p == "mamba_ssm":
                    overrides, why = mamba_ssm_hooks(device)
                    if not overrides:
                        print(f"# batch {b}: no mamba_ssm row: {why}", file=sys.stderr)
                        continue
                changed = force_torch_path(model, overrides)
                try:
                    results[p] = time_generate(model, ids, new_tokens, repeats, device)
                finally:
                    release_torch_path(changed)
            elif p == "default":
                results[p] = time_generate(model, ids, new_tokens, repeats, device)
            else:
                with provider.use(model, cuda_graphs=p == "fastmamba") as used:
                    results[p] = time_generate(model, ids, new_tokens, repeats, device)
                    if used.graphs is not None:
                        st = used.graphs.stats
                        print(f"# batch {b} {p}: {st.captures} graph captures, {st.replays} replays, eager steps "
                              f"{dict(st.eager)}", file=sys.stderr)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        base_torch = results.get("torch")
        base_default = results.get("default")
        base_ssm = results.get("mamba_ssm")
        for p, (sec, tokens, last) in results.items():
            rows.append({
                "model": name, "dtype": str(dtype).replace("torch.", ""), "batch": b, "prompt_len": prompt_len,
                "new_tokens": new_tokens, "provider": p if p != "default" else f"default ({default})",
                "seconds": sec, "tok_s": b * new_tokens / sec, "ms_per_step": 1e3 * sec / new_tokens,
                "vs_torch": base_torch[0] / sec if base_torch else None,
                "vs_default": base_default[0] / sec if base_default else None,
                "vs_mamba_ssm": base_ssm[0] / sec if base_ssm else None,
                "same_tokens_as_torch": (float((tokens == base_torch[1]).float().mean()) if base_torch else None),
                # random weights give near-uniform logits: greedy tokens part at the first near-tie, so
                # the prompt's logits against the torch path's say more (relative error, Frobenius norm)
                "logits_rel_err_vs_torch": (float((last - base_torch[2]).norm() / base_torch[2].norm())
                                            if base_torch else None),
            })
    return rows


def format_table(rows: list[dict], header: dict) -> str:
    def x(v: float | None) -> str:
        return "-" if v is None or not math.isfinite(v) else f"{v:.2f}x"

    lines = [f"# transformers {header['transformers']} generate, {header['device']}; default path ops: "
             f"{header['default_ops']}",
             f"# {header['command']}",
             "| model | dtype | batch | provider | s | tok/s | ms/step | vs torch | vs default | vs mamba_ssm | "
             "same tokens as torch | prompt logits rel. err vs torch |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        same = "-" if r["same_tokens_as_torch"] is None else f"{100 * r['same_tokens_as_torch']:.0f}%"
        err = "-" if r["logits_rel_err_vs_torch"] is None else f"{r['logits_rel_err_vs_torch']:.1e}"
        lines.append(f"| {r['model']} | {r['dtype']} | {r['batch']} | {r['provider']} | {r['seconds']:.3f} | "
                     f"{r['tok_s']:.1f} | {r['ms_per_step']:.2f} | {x(r['vs_torch'])} | {x(r['vs_default'])} | "
                     f"{x(r['vs_mamba_ssm'])} | "
                     f"{same} | {err} |")
    return "\n".join(lines)
