"""Depthwise causal conv1d ops: the decode step (`causal_conv1d_update`)."""
from fastmamba.ops.conv1d.api import causal_conv1d_update

__all__ = ["causal_conv1d_update"]
