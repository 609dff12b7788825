"""Chunked SSD scan (Mamba-2 prefill): mamba_ssm's dense call and the packed varlen serving call."""
from fastmamba.ops.ssd_scan.api import mamba_chunk_scan_combined, ssd_scan_varlen
from fastmamba.ops.ssd_scan.plan import chunk_offsets, num_chunks

__all__ = ["chunk_offsets", "mamba_chunk_scan_combined", "num_chunks", "ssd_scan_varlen"]
