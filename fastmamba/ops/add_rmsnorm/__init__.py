from fastmamba.ops.add_rmsnorm.api import PendingNorm, add_rmsnorm

__all__ = ["PendingNorm", "add_rmsnorm"]
