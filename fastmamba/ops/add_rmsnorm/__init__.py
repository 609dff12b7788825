from fastmamba.ops.add_rmsnorm.api import add_rmsnorm

__all__ = ["add_rmsnorm"]
