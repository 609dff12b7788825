from fastmamba.ops.gemv.api import gemv

__all__ = ["gemv"]
