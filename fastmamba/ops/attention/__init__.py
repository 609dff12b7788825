from fastmamba.ops.attention.api import paged_decode_attention, paged_kv_write, varlen_prefill_attention

__all__ = ["paged_decode_attention", "paged_kv_write", "varlen_prefill_attention"]
