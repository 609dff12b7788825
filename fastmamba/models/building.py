"""Building a model block by block (``fastmamba.models.blocks.finishing_blocks``), so that one whose
16-bit form does not fit the GPU loads in FP8: a random-weight preset quantised as it is built
(``random_quantized``), an FP8 checkpoint's modules swapped in as each block is built
(``build_planned``), and the check that refuses a preset larger than the GPU before it is built
(``check_preset_fits``, with ``built_bytes``). Nemotron-3 Super: 247 GB in bf16, ~126 GB in FP8."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fastmamba.layers.fp8_linear import FP8Experts, FP8Linear
from fastmamba.models.blocks import finishing_blocks
from fastmamba.models.defaults import random_init
from fastmamba.models.quant_config import QuantConfig
from fastmamba.models.quantization import QuantPlan, apply_plan, check_plan, on_load_targets, quantize_model, swap_planned


def built_bytes(meta_model: nn.Module, *, quantized: bool) -> int:
    """The bytes the parameters and buffers of ``meta_model`` (built on the meta device) take once
    built for real: as they are, or with ``quantized`` the on-load targets' matrices at one byte a
    value plus their fp32 per-channel scales."""
    total = sum(t.numel() * t.element_size() for t in (*meta_model.parameters(), *meta_model.buffers()))
    if quantized:
        for name, _ in on_load_targets(meta_model):
            for p in meta_model.get_submodule(name).parameters():
                if p.dim() >= 2:  # a matrix (or the experts' [E, N, K]): 1 byte a value, a scale per row
                    total -= p.numel() * p.element_size() - p.numel() - p[..., 0].numel() * 4
    return total


def random_quantized(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()``'s model with random weights (``random_init``) quantised as ``quantize_model``
    does, block by block while it is built (``finishing_blocks``): each block's 16-bit matrices are
    drawn, converted and freed before the next block exists, so the peak is the FP8 model plus one
    16-bit block (Nemotron-3 Super: ~125 GB in FP8 on one H200; 240 GB in bf16 would fit no GPU).
    The weights are those ``random_init`` gives the whole 16-bit model, before quantisation."""
    done: list[nn.Module] = []  # the blocks' modules, initialised (an MTP block gets more modules later)

    def finish(block: nn.Module, name: str) -> None:
        random_init(block, prefix=name)
        done.extend(block.modules())
        quantize_model(block, prefix=name)

    with finishing_blocks(finish):
        model = build()
    random_init(model, skip=done)  # the embeddings, lm_head, an MTP layer's eh_proj and norms
    return quantize_model(model)


def build_planned(build: Callable[..., nn.Module], plan: QuantPlan, device: torch.device) -> nn.Module:
    """``build(device)``'s model for an FP8 checkpoint without its whole 16-bit form: the plan is
    checked on a meta-device build first (``check_plan``: nothing allocated), then each block's
    planned modules become FP8 as the block is built (``finishing_blocks``), then ``apply_plan``
    does the rest (Super's 120 B parameters are ~125 GB in FP8; 240 GB in bf16 would fit no GPU)."""
    check_plan(build(torch.device("meta")), plan)
    with finishing_blocks(lambda block, name: swap_planned(block, plan, prefix=name)):
        model = build(device)
    return apply_plan(model, plan)


def check_preset_fits(name: str, build_meta, device: torch.device, dtype: torch.dtype, *, quantized: bool,
                      where: str = "load_model") -> None:
    """Refuse (ValueError, before anything is allocated) a preset whose weights exceed the device's
    free memory (a GPU's, or a CPU's available RAM), saying how much it needs and what would fit:
    Nemotron-3 Super takes 247 GB in bf16 (no GPU) and ~126 GB in FP8 (one H200). ``build_meta()``:
    the model on the meta device, built only when the parameter count alone cannot settle it."""
    from fastmamba.presets import PRESET_INFO

    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else _available_ram()
    if free is None:
        return
    info = next((p for p in PRESET_INFO if p.name == name), None)
    size = torch.tensor([], dtype=dtype).element_size()
    if info is not None and info.params * (1 if quantized else size) * 1.05 < free:
        return  # clearly fits (FP8 keeps some matrices in 16 bits: the estimate below is exact)
    meta = build_meta()
    need = built_bytes(meta, quantized=quantized)
    if need <= free:
        return
    gib = 1 << 30
    hint = "" if quantized else (f"; with quantization='fp8' (--quantization fp8) it takes "
                                 f"{built_bytes(meta, quantized=True) / gib:.1f} GiB")
    raise ValueError(f"{where}: preset {name!r} takes {need / gib:.1f} GiB of weights "
                     f"({'FP8' if quantized else str(dtype).replace('torch.', '')}), more than the "
                     f"{free / gib:.1f} GiB free on {device}{hint}")


def _available_ram() -> int | None:
    """The host's available memory in bytes (Linux: /proc/meminfo's MemAvailable), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def fp8_twin(meta_model: nn.Module, cfg: QuantConfig) -> nn.Module:
    """``meta_model`` (built on the meta device) with the modules that an FP8 checkpoint of config
    ``cfg`` (or ``--quantization fp8``: ``on_load_config()``) holds in FP8 turned into FP8 meta
    modules: the structure, and the bytes, of the model once loaded (the capacity plan's weights:
    Nemotron-3 Super plans at ~126 GB, not its 247 GB of bf16). In place; returns it."""
    embeddings = getattr(getattr(meta_model, "backbone", None), "embeddings", None)
    tied = getattr(embeddings, "weight", None)
    targets = []
    for name, m in meta_model.named_modules():
        if isinstance(m, nn.Linear) and not cfg.excluded(name) and m.weight is not tied:
            targets.append((name, FP8Linear(m.in_features, m.out_features, bias=m.bias is not None,
                                            per_channel=cfg.per_channel, static_input=cfg.static_input,
                                            device="meta", dtype=m.weight.dtype)))
        elif name.endswith("experts") and type(m).__name__ == "Experts" and not cfg.excluded(name):
            targets.append((name, FP8Experts(*m.up_proj.shape, per_channel=cfg.per_channel,
                                             static_input=cfg.static_input, device="meta")))
    for name, new in targets:
        parent, _, attr = name.rpartition(".")
        setattr(meta_model.get_submodule(parent) if parent else meta_model, attr, new)
    return meta_model
