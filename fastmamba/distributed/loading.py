"""Loading a tensor-parallel model by family: a preset or checkpoint directory of Mamba-2
(``shard.build_tp_mamba2``) or Nemotron-H (``nemotron_h.build_tp_nemotron_h``), checked for the
world size from config.json alone (``check_tp_source``) before any process starts or weight is read.

The family dispatch lives here, above both builders, so that ``shard`` (the Mamba-2 builder and the
slicing helpers) and ``nemotron_h`` (which uses them) import one way only.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from fastmamba.distributed.group import TPGroup
from fastmamba.distributed.nemotron_h import build_tp_nemotron_h, check_tp_nemotron_h
from fastmamba.distributed.shard import (_SAFETENSORS_DTYPES, _safetensors_files, build_tp_mamba2, check_tp,
                                         load_safetensors_slices, shard_state_dict_into)
from fastmamba.models.config import Mamba2Config


def _family_of_dir(root: Path) -> str:
    """"nemotron_h" when ``root``'s config.json says ``model_type: nemotron_h``, else "mamba2" (a bad or
    missing config.json is reported by the config reader that comes next)."""
    try:
        model_type = json.loads((root / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    return "nemotron_h" if model_type == "nemotron_h" else "mamba2"


def _nemotron_h_config(root: Path):
    """A Nemotron-H directory's config as ``load_nemotron_h`` reads it (EOS ids included)."""
    from fastmamba.models.nemotron_h import NemotronHConfig

    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"load_tp_model: no config.json in {str(root)!r}")
    return NemotronHConfig.from_dir(root)


def _source(key: str, world_size: int, who: str):
    """(family, whole config, checkpoint directory or None for a preset) of ``key``, checked for
    ``world_size`` ranks (``check_tp`` / ``check_tp_nemotron_h``); reads config.json only."""
    from fastmamba.models.config import PRESETS
    from fastmamba.models.nemotron_h import PRESETS as NEMOTRON_H_PRESETS

    if key in NEMOTRON_H_PRESETS:
        family, cfg, root = "nemotron_h", NEMOTRON_H_PRESETS[key], None
    elif key in PRESETS:
        family, cfg, root = "mamba2", PRESETS[key], None
    elif os.path.isdir(key):
        root = Path(key)
        family = _family_of_dir(root)
        cfg = _nemotron_h_config(root) if family == "nemotron_h" else Mamba2Config.from_dir(root)
        from fastmamba.models.quantization import read_quant_config

        quant = read_quant_config(root)  # FP8 weights and their scales are not sliced: refuse, never cast
        if quant is not None and world_size > 1:
            raise ValueError(f"{who}: {str(root)!r} is an FP8 checkpoint ({quant.source}); tensor parallelism "
                             f"(tp={world_size}) does not shard FP8 weights and their scales yet: serve it with "
                             "tp=1, or use the 16-bit checkpoint")
    else:
        raise FileNotFoundError(f"{who}: {key!r} is neither a checkpoint directory nor a preset "
                                f"({', '.join([*PRESETS, *NEMOTRON_H_PRESETS])})")
    if family == "nemotron_h":
        check_tp_nemotron_h(cfg, world_size, who=who)
    else:
        check_tp(cfg, world_size, who=who)
    return family, cfg, root


def check_tp_source(path_or_preset: str | os.PathLike, world_size: int, *, who: str = "check_tp_source"):
    """The config of a preset or checkpoint directory, Mamba-2 or Nemotron-H (config.json only, no
    weight read), checked for ``world_size`` ranks: what a launcher calls before it starts any
    process. Returns the ``Mamba2Config`` or ``NemotronHConfig``."""
    return _source(os.fspath(path_or_preset), world_size, who)[1]


def load_tp_model(path_or_preset: str | os.PathLike, tp: TPGroup, *, dtype: torch.dtype | str | None = None,
                  fuse_norm_reduce: bool = True):
    """Rank ``tp.rank``'s share of a Mamba-2 LM or a Nemotron-H hybrid, on ``tp.device``, ready to run.

    path_or_preset  a safetensors checkpoint directory (config.json + model.safetensors or a sharded
                    index; Mamba-2 in state-spaces or Hugging Face names, or ``model_type:
                    nemotron_h``): each rank reads its own slices only; or a Mamba-2 or Nemotron-H
                    preset name: the whole random model is built on this rank's device (same seed
                    on every rank, so the weights equal TP=1's) and sliced
    dtype           as ``load_model``'s (default: the checkpoint's; presets: bf16 on a GPU, fp32 on a CPU)
    fuse_norm_reduce  see ``build_tp_mamba2``
    The sizes are checked (``check_tp`` / ``check_tp_nemotron_h``) before any weight is read.
    ``model.load_stats`` holds the bytes this rank read.
    """
    from fastmamba.models.loader import parse_dtype

    dtype = parse_dtype(dtype, where="load_tp_model")
    family, cfg, root = _source(os.fspath(path_or_preset), tp.world_size, "load_tp_model")
    build = build_tp_nemotron_h if family == "nemotron_h" else build_tp_mamba2
    if root is None:  # a preset: built whole (same seed on every rank) and sliced
        from fastmamba.models.loader import load_model

        dtype = dtype or (torch.bfloat16 if tp.device.type == "cuda" else torch.float32)
        whole = load_model(os.fspath(path_or_preset), dtype=dtype, device=tp.device)
        model = build(cfg, tp, dtype=dtype, fuse_norm_reduce=fuse_norm_reduce)
        shard_state_dict_into(model, whole.state_dict())
        del whole
        return model.eval()
    files = _safetensors_files(root)
    if dtype is None:
        from safetensors import safe_open

        with safe_open(str(files[0]), framework="pt", device="cpu") as f:
            keys = list(f.keys())
            key0 = next((k for k in ("backbone.embeddings.weight", "backbone.embedding.weight") if k in keys), keys[0])
            dtype = _SAFETENSORS_DTYPES.get(f.get_slice(key0).get_dtype(), torch.float32)
        dtype = dtype if dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32
    model = build(cfg, tp, dtype=dtype, fuse_norm_reduce=fuse_norm_reduce)
    load_safetensors_slices(model, root)
    return model.eval()


def tp_meta_model(path_or_preset: str | os.PathLike, world_size: int, dtype: torch.dtype | str | None = None):
    """Rank 0's share of a preset or checkpoint directory for ``world_size`` ranks, built on the meta
    device from config.json alone (no memory, no weight read): what capacity planning needs per GPU
    under tensor parallelism. Rank 0 holds the largest share (an uneven vocabulary split gives the
    first ranks a row more). dtype: as ``capacity.meta_model`` resolves it (the checkpoint's
    ``torch_dtype``, else bf16). The sizes are checked as ``check_tp_source`` checks them."""
    from fastmamba.generation.capacity import default_dtype
    from fastmamba.models.loader import parse_dtype

    key = os.fspath(path_or_preset)
    family, cfg, _ = _source(key, world_size, "tp_meta_model")
    dtype = parse_dtype(dtype, where="tp_meta_model") or default_dtype(key)
    build = build_tp_nemotron_h if family == "nemotron_h" else build_tp_mamba2
    return build(cfg, TPGroup(0, world_size, torch.device("meta")), dtype=dtype)
