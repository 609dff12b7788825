"""Stateless layers for transformers' Mamba-2 hooks (``kernelize`` replaces the hook wrapper's
``forward`` with the layer's). Each ``forward`` has the hook's signature; ``self`` is transformers'
wrapper, whose own ``forward`` (its PyTorch code) serves what fastmamba leaves to it (a cache that
records past states). Inference only (``has_backward = False``: kernelize keeps transformers' code
in training mode).
"""
import torch

from fastmamba.integrations import hf_ops


class CausalConv1dForward(torch.nn.Module):
    """``causal_conv1d_forward``: the conv with transformers' cache (one token: update in place)."""

    has_backward = False
    forward = hf_ops.causal_conv1d_forward_hook


class Mamba2ScanForward(torch.nn.Module):
    """``mamba2_scan_forward``: chunked SSD scan (prefill) or state update in place (decode)."""

    has_backward = False
    forward = hf_ops.mamba2_scan_forward_hook


class CausalConv1dFn(torch.nn.Module):
    """``causal_conv1d_fn``: depthwise causal conv over whole prompts."""

    has_backward = False
    forward = hf_ops.causal_conv1d_fn_hook


class CausalConv1dUpdate(torch.nn.Module):
    """``causal_conv1d_update``: the conv's decode step, state in place."""

    has_backward = False
    forward = hf_ops.causal_conv1d_update_hook


class SelectiveStateUpdate(torch.nn.Module):
    """``selective_state_update`` (transformers' argument order)."""

    has_backward = False
    forward = hf_ops.selective_state_update_hook


class MambaChunkScanCombined(torch.nn.Module):
    """``mamba_chunk_scan_combined`` (transformers' ``mamba2_chunk_scan`` arguments)."""

    has_backward = False
    forward = hf_ops.chunk_scan_hook


# transformers' hook name (a KernelConfig key) -> this build's layer name
HOOK_LAYERS = {
    "causal_conv1d_forward": "CausalConv1dForward",
    "mamba2_scan_forward": "Mamba2ScanForward",
    "causal_conv1d_fn": "CausalConv1dFn",
    "causal_conv1d_update": "CausalConv1dUpdate",
    "selective_state_update": "SelectiveStateUpdate",
    "mamba_chunk_scan_combined": "MambaChunkScanCombined",
}
