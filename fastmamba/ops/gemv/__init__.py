from fastmamba.ops.gemv.api import add_rmsnorm_gemv, gemv, rmsnorm_gemv

__all__ = ["add_rmsnorm_gemv", "gemv", "rmsnorm_gemv"]
