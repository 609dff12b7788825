"""Chunked SSD scan (Mamba-2 prefill): mamba_ssm's dense call and the packed varlen serving call."""
from fastmamba.ops.ssd_scan.api import chunk_offsets, mamba_chunk_scan_combined, num_chunks, ssd_scan_varlen

__all__ = ["chunk_offsets", "mamba_chunk_scan_combined", "num_chunks", "ssd_scan_varlen"]
