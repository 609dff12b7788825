"""One row of every layer of stacked state pools into a row of others (prefix-cache restore and save)."""
from fastmamba.ops.row_copy.api import copy_rows

__all__ = ["copy_rows"]
