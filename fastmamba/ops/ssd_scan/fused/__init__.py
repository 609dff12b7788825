"""The fused scan: all of a short call's chunks in one launch (``kernel.py``), the rule that picks it
(``api.choose_fused``) and its tuning table (``configs.py``)."""
from fastmamba.ops.ssd_scan.fused.api import choose_fused, longest_sequence_bound, ssd_scan_varlen_fused_impl

__all__ = ["choose_fused", "longest_sequence_bound", "ssd_scan_varlen_fused_impl"]
