"""Prefill depthwise causal conv: dense batches (`causal_conv1d_fn`) and packed sequences with a
slot cache (`causal_conv1d_varlen`)."""
from fastmamba.ops.conv1d_fn.api import causal_conv1d_fn, causal_conv1d_varlen

__all__ = ["causal_conv1d_fn", "causal_conv1d_varlen"]
