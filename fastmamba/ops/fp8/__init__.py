from fastmamba.ops.fp8.api import (
    GEMV_MAX_ROWS,
    MOE_GEMV_MAX_TOKENS,
    fp8_gemv,
    fp8_linear,
    fp8_moe,
    fp8_moe_grouped,
    quantize_per_token,
    quantize_static,
    scaled_mm_supported,
)
from fastmamba.ops.fp8.ref import FP8_DTYPE, FP8_MAX, quantize_weight_ref

__all__ = ["GEMV_MAX_ROWS", "MOE_GEMV_MAX_TOKENS", "FP8_DTYPE", "FP8_MAX", "fp8_gemv", "fp8_linear", "fp8_moe", "fp8_moe_grouped", "quantize_per_token",
           "quantize_static", "quantize_weight_ref", "scaled_mm_supported"]
