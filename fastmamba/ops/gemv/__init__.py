from fastmamba.ops.gemv.api import gemv, rmsnorm_gemv

__all__ = ["gemv", "rmsnorm_gemv"]
