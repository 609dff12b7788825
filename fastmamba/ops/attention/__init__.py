from fastmamba.ops.attention.api import (
    PrefillWork, paged_decode_attention, paged_kv_write, prefill_block_tokens, varlen_prefill_attention,
)
from fastmamba.ops.attention.prefill_kernel import prefill_kv_values, prefill_work, work_items_bound
from fastmamba.ops.attention.ref import quantize_kv_ref  # K/V rounded as float8 pages hold them (a cache-less forward)

__all__ = ["PrefillWork", "paged_decode_attention", "paged_kv_write", "prefill_block_tokens", "prefill_kv_values",
           "prefill_work", "quantize_kv_ref", "varlen_prefill_attention", "work_items_bound"]
