from fastmamba.ops.gemv.api import gemv, gemv_covers

__all__ = ["gemv", "gemv_covers"]
