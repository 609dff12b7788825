"""A Mamba layer's prefix-cache snapshots of one prefill, copied into the cache's pools by one kernel."""
from fastmamba.ops.snapshot_copy.api import copy_snapshots

__all__ = ["copy_snapshots"]
