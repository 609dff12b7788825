"""Gated RMSNorm: group-wise RMSNorm with an optional SiLU gate (mamba_ssm's ``rmsnorm_fn``)."""
from fastmamba.ops.gated_rmsnorm.api import RMSNormGated, rmsnorm_fn

__all__ = ["rmsnorm_fn", "RMSNormGated"]
