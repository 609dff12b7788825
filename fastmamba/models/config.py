"""The model configs' old home: ``Mamba2Config`` and the Mamba-2 presets now live in
``fastmamba.models.mamba2``, the JSON reading every family shares in ``fastmamba.models.checkpoint_config``;
both are re-exported here so existing imports keep working."""
from fastmamba.models.checkpoint_config import _as_float, _Fields, checkpoint_eos_token_ids
from fastmamba.models.mamba2 import PRESETS, Mamba2Config

__all__ = ["PRESETS", "Mamba2Config", "_Fields", "_as_float", "checkpoint_eos_token_ids"]
