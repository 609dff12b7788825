"""``load_model``: a Mamba-2 LM from a local checkpoint directory or a named random preset."""
from __future__ import annotations

import os

import torch
from torch import nn

from fastmamba.models.config import PRESETS, Mamba2Config
from fastmamba.models.mamba2_lm import Mamba2LM


def _default_device(device) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@torch.no_grad()
def random_init(model: Mamba2LM, seed: int = 0) -> Mamba2LM:
    """Deterministic random weights (for presets, demos and benchmarks): N(0, 0.02) matrices,
    Mamba-2's A_log / dt_bias / D initialisation, unit norms. Same seed, same weights."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dev_gen = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d)):
            module.weight.normal_(0.0, 0.02, generator=dev_gen)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
    for block in model.backbone.layers:
        block.mixer.reset_ssm_parameters(gen)
    return model


def load_model(path_or_preset: str | os.PathLike, dtype: torch.dtype | None = None, device=None) -> Mamba2LM:
    """A ready-to-run ``Mamba2LM``.

    path_or_preset  a local directory with ``config.json`` (state-spaces or Hugging Face format)
                    and weights (``model.safetensors``, sharded safetensors with an index, or
                    ``pytorch_model.bin``), or a preset name (``mamba2-tiny``, ``mamba2-130m`` ...
                    ``mamba2-2.7b``) for a randomly initialised model with a fixed seed
    dtype           weights' dtype; default: the checkpoint's, or bf16 on a GPU / fp32 on a CPU
    device          default: CUDA when present
    """
    device = _default_device(device)
    key = str(path_or_preset)
    if key in PRESETS:
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        return random_init(Mamba2LM(PRESETS[key], device=device, dtype=dtype)).eval()
    if not os.path.isdir(key):
        raise FileNotFoundError(
            f"load_model: {key!r} is neither a directory nor a preset; presets: {', '.join(PRESETS)}"
        )
    from fastmamba.models.weights import load_into, normalize_names, read_checkpoint

    cfg = Mamba2Config.from_dir(key)  # config.json (+ generation_config.json's eos_token_id)
    state_dict = normalize_names(read_checkpoint(key))
    if dtype is None:
        dtype = next((t.dtype for t in state_dict.values() if t.is_floating_point()), torch.float32)
    model = Mamba2LM(cfg, device=device, dtype=dtype)
    load_into(model, state_dict)
    return model.eval()
