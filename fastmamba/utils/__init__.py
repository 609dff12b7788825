"""Small helpers with no dependencies beyond the standard library."""
from fastmamba.utils.progress import Progress

__all__ = ["Progress"]
