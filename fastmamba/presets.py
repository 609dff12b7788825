"""Preset names and sizes as plain data, for the command line's help (no torch import).

The presets themselves (configs, random weights) live in ``fastmamba.models.config.PRESETS``
(Mamba-2) and ``fastmamba.models.nemotron_h.PRESETS`` (Nemotron-H); this table repeats their
names and sizes so that ``fastmamba --help`` and ``generate --help`` answer without importing
torch. ``tests/test_packaging.py`` checks it against those registries (names, layers, widths,
vocabularies and parameter counts), so it cannot drift.

Also here: what to say about a model name that looks like a Hugging Face Hub id
(``state-spaces/mamba2-130m``): fastmamba reads local directories, so the answer is how to
download it.
"""
from __future__ import annotations

import os
import re
from typing import NamedTuple


class PresetInfo(NamedTuple):
    name: str
    family: str  # "mamba2", "nemotron_h" or "nemotron_3" (Nemotron-H with MoE layers)
    n_layer: int
    d_model: int
    vocab_size: int
    params: int  # parameters of the model as built (tied embeddings counted once)


PRESET_INFO: tuple[PresetInfo, ...] = (
    PresetInfo("mamba2-tiny", "mamba2", 2, 64, 256, 72_752),
    PresetInfo("mamba2-130m", "mamba2", 24, 768, 50_288, 128_989_632),
    PresetInfo("mamba2-370m", "mamba2", 48, 1024, 50_288, 368_346_624),
    PresetInfo("mamba2-780m", "mamba2", 48, 1536, 50_288, 780_161_280),
    PresetInfo("mamba2-1.3b", "mamba2", 48, 2048, 50_288, 1_343_757_312),
    PresetInfo("mamba2-2.7b", "mamba2", 64, 2560, 50_288, 2_702_599_680),
    PresetInfo("nemotron-h-tiny", "nemotron_h", 7, 64, 256, 173_320),
    PresetInfo("nemotron-3-tiny", "nemotron_3", 6, 64, 256, 201_328),
    PresetInfo("nemotron-3-nano", "nemotron_3", 52, 2688, 131_072, 31_577_937_344),
    PresetInfo("nemotron-3-tiny-mtp", "nemotron_3", 6, 64, 256, 263_600),  # + one MTP layer (attention, MoE)
    PresetInfo("nemotron-3-nano-mtp", "nemotron_3", 52, 2688, 131_072, 32_913_263_168),  # + one MTP layer
    PresetInfo("nemotron-3-super-slice", "nemotron_3", 7, 4096, 131_072, 10_057_628_800),
    PresetInfo("nemotron-3-super", "nemotron_3", 88, 4096, 131_072, 123_611_012_096),  # + one MTP layer; FP8 only
    PresetInfo("nemotron-h-4b", "nemotron_h", 52, 3072, 131_072, 4_489_223_040),
    PresetInfo("nemotron-h-8b", "nemotron_h", 52, 4096, 131_072, 8_100_852_736),
)
PRESET_NAMES: tuple[str, ...] = tuple(p.name for p in PRESET_INFO)

_FAMILY = {"mamba2": "Mamba-2", "nemotron_h": "Nemotron-H hybrid", "nemotron_3": "Nemotron-3 MoE hybrid"}


def _size(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e7 else f"{n / 1e6:.2f}M"


def preset_lines() -> str:
    """One help line per preset: name, family, layers, width, vocabulary, parameters."""
    width = max(len(p.name) for p in PRESET_INFO)
    return "\n".join(f"  {p.name:{width}}  {_FAMILY[p.family]:21} {p.n_layer:2d} layers, d_model {p.d_model:4d}, "
                     f"vocab {p.vocab_size:6d}  ~{_size(p.params)} parameters" for p in PRESET_INFO)


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def hub_id_hint(name: object, *, then: str = "--model DIR") -> str | None:
    """For a name shaped like a Hub id (``org/model``) that is no local path: how to download it
    (``then`` says how to pass the directory afterwards). None for anything else."""
    if not isinstance(name, str) or not _HUB_ID.fullmatch(name) or os.path.exists(name):
        return None
    local = "./" + name.split("/")[1]  # "./": a bare name may be a preset's (random weights)
    return (f"{name!r} is not a local directory; it looks like a Hugging Face Hub id, and fastmamba loads local "
            f"checkpoint directories only: download it first (huggingface-cli download {name} --local-dir {local}), "
            f"then pass {then.replace('DIR', local)}")
