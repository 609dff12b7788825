"""Building a model block by block (``fastmamba.models.blocks.finishing_blocks``), so that one whose
16-bit form does not fit the GPU loads in FP8: a random-weight preset quantised as it is built
(``random_quantized``, ``random_preset``), an FP8 checkpoint's modules swapped in as each block is built
(``build_planned``), and the check that refuses a preset larger than the GPU before it is built
(``check_preset_fits``, with ``fp8_twin``). Nemotron-3 Super: 247 GB in bf16, ~126 GB in FP8."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fastmamba.models.blocks import finishing_blocks
from fastmamba.models.defaults import random_init
from fastmamba.models.quant_config import on_load_config
from fastmamba.models.quantization import QuantPlan, apply_plan, check_plan, fp8_twin, quantize_model, swap_planned


def _bytes(model: nn.Module) -> int:
    """The bytes of ``model``'s parameters and buffers (a meta-device model: once built for real)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def random_quantized(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()``'s model with random weights (``random_init``) quantised as ``quantize_model``
    does, block by block while it is built (``finishing_blocks``): each block's 16-bit matrices are
    drawn, converted and freed before the next block exists, so the peak is the FP8 model plus one
    16-bit block (Nemotron-3 Super: ~125 GB in FP8 on one H200; 240 GB in bf16 would fit no GPU).
    The weights are those ``random_init`` gives the whole 16-bit model, before quantisation."""
    done: list[nn.Module] = []  # the blocks' modules, initialised (an MTP block gets more modules later)

    def finish(block: nn.Module, name: str) -> None:
        random_init(block, prefix=name)
        quantize_model(block, prefix=name)
        # the modules the block holds now: holding those quantisation replaced would keep every
        # block's 16-bit matrices alive (Nano in FP8 then took 79 GB of an H100 and failed)
        done.extend(block.modules())

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


def random_preset(name: str, make: Callable[[torch.device | str], nn.Module], device: torch.device,
                  dtype: torch.dtype, *, quantized: bool, where: str = "load_model") -> nn.Module:
    """Preset ``name``'s model with its random weights, in eval mode: ``make(device)`` builds it;
    refused first when it cannot fit (``check_preset_fits``, on a meta build), then drawn whole
    (``random_init``) or, ``quantized``, block by block into FP8 (``random_quantized``)."""
    check_preset_fits(name, lambda: make("meta"), device, dtype, quantized=quantized, where=where)
    build = lambda: make(device)  # noqa: E731
    return (random_quantized(build) if quantized else random_init(build())).eval()


def check_preset_fits(name: str, build_meta, device: torch.device, dtype: torch.dtype, *, quantized: bool,
                      where: str = "load_model") -> None:
    """Refuse (ValueError, before anything is allocated) a preset whose weights exceed the device's
    free memory (a GPU's, or a CPU's available RAM), saying how much it needs and what would fit:
    Nemotron-3 Super takes 247 GB in bf16 (no GPU) and ~126 GB in FP8 (one H200). ``build_meta()``:
    the model on the meta device, built only when the parameter count alone cannot settle it."""
    from fastmamba.presets import PRESET_INFO

    free = cuda_free_bytes(device) if device.type == "cuda" else _available_ram()
    if free is None:
        return
    info = next((p for p in PRESET_INFO if p.name == name), None)
    size = torch.tensor([], dtype=dtype).element_size()
    if info is not None and info.params * (1 if quantized else size) * 1.05 < free:
        return  # clearly fits (FP8 keeps some matrices in 16 bits: the estimate below is exact)
    meta = build_meta()
    need_16 = _bytes(meta)
    need_fp8 = _bytes(fp8_twin(meta, on_load_config()))  # (meta is its FP8 twin from here on)
    need = need_fp8 if quantized else need_16
    if need <= free:
        return
    gib = 1 << 30
    hint = "" if quantized else f"; with quantization='fp8' (--quantization fp8) it takes {need_fp8 / gib:.1f} GiB"
    raise ValueError(f"{where}: preset {name!r} takes {need / gib:.1f} GiB of weights "
                     f"({'FP8' if quantized else str(dtype).replace('torch.', '')}), more than the "
                     f"{free / gib:.1f} GiB free on {device}{hint}")


def cuda_free_bytes(device: torch.device) -> int:
    """The bytes this process can still allocate on a CUDA device: the driver's free memory plus what
    torch's caching allocator holds reserved but unallocated (a model deleted in this process leaves
    its blocks cached: the driver alone would call a 58 GiB card full after Nano is freed)."""
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


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
