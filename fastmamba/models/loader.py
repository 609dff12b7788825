"""``load_model``: a Mamba-2 LM from a local checkpoint directory or a named random preset."""
from __future__ import annotations

import difflib
import json
import os

import torch
from torch import nn

from fastmamba.layers.mamba2 import Mamba2Mixer
from fastmamba.layers.moe import MoE
from fastmamba.models.config import PRESETS, Mamba2Config
from fastmamba.models.mamba2_lm import Mamba2LM

# the weight dtypes the kernels run; strings accepted for each (case-insensitive, "torch." prefix allowed)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def parse_dtype(dtype: torch.dtype | str | None, *, where: str = "load_model") -> torch.dtype | None:
    """``dtype`` as a torch dtype the model can run in, or None for "auto" / None (the default).

    Accepts torch.float32 / float16 / bfloat16 or their names ("float32", "fp32", "float16", "fp16",
    "half", "bfloat16", "bf16", "torch.bfloat16", any case). Raises ValueError for another dtype or
    name, TypeError for another type.
    """
    if dtype is None:
        return None
    names = "float32 (fp32), float16 (fp16), bfloat16 (bf16)"
    if isinstance(dtype, str):
        key = dtype.strip().lower()
        key = key[len("torch."):] if key.startswith("torch.") else key
        if key == "auto":
            return None
        if key not in _DTYPE_NAMES:
            raise ValueError(f"{where}: `dtype` {dtype!r} is not a supported dtype; expected one of {names} or 'auto'")
        return _DTYPE_NAMES[key]
    if isinstance(dtype, torch.dtype):
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{where}: `dtype` {dtype} is not supported by the kernels; expected one of {names}")
        return dtype
    raise TypeError(f"{where}: `dtype` expected a torch.dtype or a name such as 'bf16', got {type(dtype).__name__}")


def _default_device(device, *, where: str = "load_model") -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{where}: `device` {device!r} is not a device (e.g. 'cuda', 'cuda:1', 'cpu'): {e}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{where}: `device` {device!r} asks for CUDA but torch sees no CUDA GPU; "
                         "use device='cpu' (the kernels then need TRITON_INTERPRET=1)")
    return dev


@torch.no_grad()
def random_init(model: nn.Module, seed: int = 0) -> nn.Module:
    """Deterministic random weights of any of our LMs (presets, demos, benchmarks): N(0, 0.02)
    matrices (MoE routers and experts too, zero selection bias), Mamba-2's A_log / dt_bias / D
    initialisation in every ``Mamba2Mixer``, unit norms.
    Same seed, same weights (the matrices and the SSM parameters draw from separate generators)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dev_gen = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d)):
            module.weight.normal_(0.0, 0.02, generator=dev_gen)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        if isinstance(module, Mamba2Mixer):
            module.reset_ssm_parameters(gen)
        if isinstance(module, MoE):  # router and the 3-D expert weights (its Linears are done above)
            module.reset_parameters(dev_gen)
    return model


def _checkpoint_dtype(state_dict: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype the checkpoint stores its matrices in (the embeddings', else the first floating
    tensor's); fp32 when that is one the kernels do not run (fp64, fp8 ...)."""
    for name in ("backbone.embeddings.weight", "lm_head.weight"):
        if name in state_dict and state_dict[name].is_floating_point():
            dtype = state_dict[name].dtype
            break
    else:
        dtype = next((t.dtype for t in state_dict.values() if t.is_floating_point()), torch.float32)
    return dtype if dtype in SUPPORTED_DTYPES else torch.float32


def load_model(path_or_preset: str | os.PathLike, dtype: torch.dtype | str | None = None, device=None) -> Mamba2LM:
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

    Raises FileNotFoundError naming the path when it is neither a directory nor a preset, or lacks
    config.json or weights; NotADirectoryError for a file; ValueError naming the file and field for
    a bad config.json or a corrupt weight file (see ``Mamba2Config.from_dir``, ``read_checkpoint``,
    ``load_into``), for weights holding NaN or inf (naming each such tensor: ``check_finite``), or for
    an unsupported ``dtype`` / ``device``.
    """
    dtype = parse_dtype(dtype)
    device = _default_device(device)
    key = os.fspath(path_or_preset) if isinstance(path_or_preset, os.PathLike) else path_or_preset
    if not isinstance(key, str):
        raise TypeError(f"load_model: expected a checkpoint directory or a preset name, got {type(key).__name__}")
    from fastmamba.models.nemotron_h import PRESETS as NEMOTRON_H_PRESETS, load_nemotron_h

    if key in PRESETS:
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        return random_init(Mamba2LM(PRESETS[key], device=device, dtype=dtype)).eval()
    if key in NEMOTRON_H_PRESETS:
        return load_nemotron_h(key, dtype=dtype, device=device)
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
            return load_nemotron_h(key, dtype=dtype, device=device)
    from fastmamba.models.weights import check_finite, load_into, normalize_names, read_checkpoint

    cfg = Mamba2Config.from_dir(key)  # config.json (+ generation_config.json's eos_token_id)
    state_dict = normalize_names(read_checkpoint(key))
    check_finite(state_dict)
    model = Mamba2LM(cfg, device=device, dtype=dtype or _checkpoint_dtype(state_dict))
    load_into(model, state_dict)
    return model.eval()
