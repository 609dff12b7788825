"""What building a model needs besides its config: the dtype and device defaults, the checkpoint's
dtype, and deterministic random weights (presets, demos, benchmarks)."""
from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from fastmamba.layers.mamba2 import Mamba2Mixer
from fastmamba.layers.moe import MoE

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


def default_device(device, *, where: str = "load_model") -> torch.device:
    """``device`` as a torch.device (default: CUDA when present); ValueError for a bad or absent one."""
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


def named_modules_in(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, str, nn.Module]]:
    """(name relative to ``model``, qualified name in the whole model, module) of every module of
    ``model``; ``prefix``: ``model``'s own qualified name when it is one block of a model being built
    (``fastmamba.models.blocks.finishing_blocks``), else ""."""
    for rel, module in model.named_modules():
        yield rel, (f"{prefix}.{rel}" if prefix and rel else (prefix or rel)), module


def _generator(device: torch.device, seed: int, name: str) -> torch.Generator:
    """A generator on ``device`` seeded by (seed, a module's qualified name)."""
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62))


@torch.no_grad()
def random_init(model: nn.Module, seed: int = 0, *, prefix: str = "", skip: Iterable[nn.Module] = ()) -> nn.Module:
    """Deterministic random weights of any of our LMs (presets, demos, benchmarks): N(0, 0.02)
    matrices (MoE routers and experts too, zero selection bias), Mamba-2's A_log / dt_bias / D
    initialisation in every ``Mamba2Mixer``, unit norms.

    Each module draws from generators seeded by (seed, its qualified name), so a model gets the same
    weights whether it is initialised whole or block by block as it is built: ``prefix`` is the
    qualified name of ``model`` inside the whole (e.g. ``backbone.layers.3``), and the modules in
    ``skip`` (initialised already; not their children added since) are left as they are."""
    skip_ids = {id(m) for m in skip}
    for _, name, module in named_modules_in(model, prefix):
        if id(module) in skip_ids:
            continue
        if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d)):
            module.weight.normal_(0.0, 0.02, generator=_generator(module.weight.device, seed, name))
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        if isinstance(module, Mamba2Mixer):
            module.reset_ssm_parameters(_generator(torch.device("cpu"), seed, name + "/ssm"))
        if isinstance(module, MoE):  # router and the 3-D expert weights (its Linears are done above)
            module.reset_parameters(_generator(module.gate.weight.device, seed, name + "/moe"))
    return model


def checkpoint_dtype(state_dict: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype the checkpoint stores its matrices in (the embeddings', else the first floating
    tensor's); fp32 when that is one the kernels do not run (fp64, fp8 ...)."""
    for name in ("backbone.embeddings.weight", "lm_head.weight"):
        if name in state_dict and state_dict[name].is_floating_point():
            dtype = state_dict[name].dtype
            break
    else:
        dtype = next((t.dtype for t in state_dict.values() if t.is_floating_point()), torch.float32)
    return dtype if dtype in SUPPORTED_DTYPES else torch.float32
