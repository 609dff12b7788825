"""``load_model``: a Mamba-2 or Nemotron-H LM from a local checkpoint directory or a named random preset."""
from __future__ import annotations

import difflib
import json
import os

import torch

from fastmamba.models.defaults import SUPPORTED_DTYPES, checkpoint_dtype, default_device, parse_dtype, random_init
from fastmamba.models.mamba2 import PRESETS, Mamba2Config
from fastmamba.models.mamba2_lm import Mamba2LM
from fastmamba.models.nemotron_h import PRESETS as NEMOTRON_H_PRESETS, load_nemotron_h

# the old private names, for code that imported them from here
_default_device, _checkpoint_dtype = default_device, checkpoint_dtype
__all__ = ["SUPPORTED_DTYPES", "load_model", "parse_dtype", "random_init"]


def load_model(path_or_preset: str | os.PathLike, dtype: torch.dtype | str | None = None, device=None, *,
               quantization: str | None = None) -> Mamba2LM:
    """A ready-to-run ``Mamba2LM``.

    path_or_preset  a local directory with ``config.json`` (state-spaces or Hugging Face format;
                    ``generation_config.json`` too when present, for ``cfg.eos_token_ids``) and weights
                    (``model.safetensors``, sharded safetensors with an index, or ``pytorch_model.bin``),
                    or a preset name (``mamba2-tiny``, ``mamba2-130m`` ... ``mamba2-2.7b``) for a
                    randomly initialised model with a fixed seed (no tokenizer: token ids only)
    dtype           weights' dtype: torch.float32 / float16 / bfloat16 or a name ("fp16", "bf16",
                    "bfloat16", "float32" ...); default (None or "auto"): the checkpoint's, or bf16
                    on a GPU / fp32 on a CPU for presets
    device          default: CUDA when present
    quantization    None, or "fp8": quantise a 16-bit model on load (per-channel e4m3 weights, dynamic
                    per-token activations: ``fastmamba.models.quantization.quantize_model``). FP8
                    checkpoints (ModelOpt, compressed-tensors) load as FP8 without it.

    Raises FileNotFoundError naming the path when it is neither a directory nor a preset, or lacks
    config.json or weights; NotADirectoryError for a file; ValueError naming the file and field for
    a bad config.json or a corrupt weight file (see ``Mamba2Config.from_dir``, ``read_checkpoint``,
    ``load_into``), for weights holding NaN or inf (naming each such tensor: ``check_finite``), or for
    an unsupported ``dtype`` / ``device``.
    """
    from fastmamba.models.building import random_preset
    from fastmamba.models.quantization import apply_plan, check_quantization_arg, prepare_fp8_checkpoint, quantize_model

    dtype = parse_dtype(dtype)
    device = default_device(device)
    check_quantization_arg(quantization)
    key = os.fspath(path_or_preset) if isinstance(path_or_preset, os.PathLike) else path_or_preset
    if not isinstance(key, str):
        raise TypeError(f"load_model: expected a checkpoint directory or a preset name, got {type(key).__name__}")
    if key in PRESETS:
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        return random_preset(key, lambda dev: Mamba2LM(PRESETS[key], device=dev, dtype=dtype), device, dtype,
                             quantized=bool(quantization))
    if key in NEMOTRON_H_PRESETS:
        return load_nemotron_h(key, dtype=dtype, device=device, quantization=quantization)
    if os.path.isfile(key):
        raise NotADirectoryError(f"load_model: {key!r} is a file; pass the checkpoint directory that holds "
                                 f"config.json and the weights ({os.path.dirname(os.path.abspath(key))!r}?)")
    if not os.path.isdir(key):
        presets = [*PRESETS, *NEMOTRON_H_PRESETS]
        close = difflib.get_close_matches(key, presets, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise FileNotFoundError(
            f"load_model: {key!r} is neither a directory nor a preset; presets (random weights): "
            f"{', '.join(presets)}{hint}"
        )
    config_path = os.path.join(key, "config.json")
    if os.path.isfile(config_path):  # the model class by model_type (a bad file: from_dir says why)
        try:
            with open(config_path, encoding="utf-8") as f:
                model_type = json.load(f).get("model_type")
        except (OSError, ValueError, AttributeError):
            model_type = None
        if model_type == "nemotron_h":
            return load_nemotron_h(key, dtype=dtype, device=device, quantization=quantization)
    from fastmamba.models.weights import check_finite, load_into, normalize_names, read_checkpoint

    cfg = Mamba2Config.from_dir(key)  # config.json (+ generation_config.json's eos_token_id)
    state_dict = normalize_names(read_checkpoint(key))
    fp8_plan = prepare_fp8_checkpoint(key, state_dict, cfg)  # None unless the checkpoint is FP8 (models.quantization)
    check_finite(state_dict)
    model = Mamba2LM(cfg, device=device, dtype=dtype or checkpoint_dtype(state_dict))
    if fp8_plan is not None:
        apply_plan(model, fp8_plan)
    load_into(model, state_dict)
    return (quantize_model(model) if quantization and fp8_plan is None else model).eval()
