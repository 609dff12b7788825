"""Packed prefill attention (``varlen_prefill_attention``), the attention layers' prefill op of a hybrid model.

B prompts packed into one call attend causally over their requests' pages, which already hold the
prompts' own K/V (the model writes them first) after ``ctx`` cached tokens per request (a prompt
continued after a prefix-cache hit or an earlier chunk). GQA with Nemotron-H's attention shape (32
query / 8 KV heads of 128), bf16, pages of 16 tokens handed out in a random order (a fragmented
pool). Our call is the runtime's: host copies of cu_seqlens and slots, ctx_lens and the work table
on the device, so it reads nothing on the host and is timed inside a CUDA graph.

Peer: PyTorch's ``scaled_dot_product_attention`` on contiguous K/V gathered beforehand (not timed:
the best case for a dense kernel, which a paged cache would first have to gather), equal-length
prompts batched into one call; without cached tokens it is causal with GQA (the flash kernel), with
them the mask is causal from the bottom right (``causal_lower_right``) over K/V repeated to the query
heads (its flash path takes no GQA there). Oracle: that peer (fp32 softmax, any size).

Bytes per call: q read, out written, K and V of every attended token read once, the block table's
used entries. FLOPs: 4 x Hq x Dh per (query, key) pair under the causal mask.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fastmamba.bench.ops._attention import AttentionBench, paged_pool
from fastmamba.bench.ops._base import DTYPE_NAMES, Case, Provider
from fastmamba.bench.timing import TimingConfig

# name -> (Hq, Hkv, Dh, PAGE)
GPU_SHAPES = {"nemotron-h": (32, 8, 128, 16)}
CPU_SHAPES = {"tiny": (4, 2, 16, 4)}
# (prompts, tokens each, cached tokens before each): a short prompt, one long and one longer, a batch
# of equal prompts, and a continued batch (after a prefix-cache hit or an earlier chunk)
GPU_BATCHES = ((1, 128, 0), (1, 2048, 0), (1, 8192, 0), (8, 1024, 0), (4, 512, 1536))
CPU_BATCHES = ((1, 7, 0), (3, 5, 6))
DTYPE = torch.bfloat16


def causal_pairs(n: int, ctx: int) -> int:
    """(query, key) pairs of one prompt of n tokens after ctx cached ones: query i sees ctx + i + 1 keys."""
    return n * ctx + n * (n + 1) // 2


def attention_bytes(B: int, n: int, ctx: int, Hq: int, Hkv: int, Dh: int, page: int, dtype: torch.dtype) -> int:
    e = dtype.itemsize
    return 2 * B * n * Hq * Dh * e + 2 * B * (ctx + n) * Hkv * Dh * e + B * (-(-(ctx + n) // page)) * 4


def _ours(q, k_pages, v_pages, block_table, slots, cu, ctx, k_dense, v_dense, host):
    from fastmamba.ops.attention import varlen_prefill_attention

    return varlen_prefill_attention(q, k_pages, v_pages, block_table, slots, cu, ctx, cu_seqlens_host=host["cu"],
                                    slots_host=host["slots"], work=host["work"])


def _sdpa(q, k_pages, v_pages, block_table, slots, cu, ctx, k_dense, v_dense, host):
    B, n = host["B"], host["n"]
    qb = q.view(B, n, *q.shape[1:]).transpose(1, 2)  # [B, Hq, n, Dh]
    if host["ctx"] == 0:
        o = F.scaled_dot_product_attention(qb, k_dense, v_dense, is_causal=True, enable_gqa=True)
    else:
        from torch.nn.attention.bias import causal_lower_right

        o = F.scaled_dot_product_attention(qb, k_dense, v_dense, attn_mask=causal_lower_right(n, k_dense.shape[2]))
    return o.transpose(1, 2).reshape(q.shape)


def _ref(q, k_pages, v_pages, block_table, slots, cu, ctx, k_dense, v_dense, host):
    from fastmamba.ops.attention.ref import varlen_prefill_attention_ref

    return varlen_prefill_attention_ref(q, k_pages, v_pages, block_table, slots, cu, ctx)


class PrefillAttentionBench(AttentionBench):
    key = "attn"
    title = "varlen_prefill_attention"
    op_name = "varlen_prefill_attention"
    sdpa_note = "torch scaled_dot_product_attention on contiguous K/V, prompts batched"
    ours, sdpa, ref = staticmethod(_ours), staticmethod(_sdpa), staticmethod(_ref)
    timing = TimingConfig.prefill()
    quick_timing = TimingConfig.prefill_quick()

    def cases(self, device: torch.device, batches: Sequence[int] | None = None) -> list[Case]:
        """``batches`` is ignored: the rows are fixed prompt sets (GPU_BATCHES)."""
        cuda = device.type == "cuda"
        out = []
        for shape, (Hq, Hkv, Dh, page) in (GPU_SHAPES if cuda else CPU_SHAPES).items():
            for B, n, ctx in GPU_BATCHES if cuda else CPU_BATCHES:
                variant = f"{B}x{n}" + (f"+ctx{ctx}" if ctx else "")
                out.append(Case(
                    op=self.key, shape=shape, dims=f"Hq{Hq} Hkv{Hkv} Dh{Dh} page{page} {variant}",
                    dtype=DTYPE_NAMES[DTYPE], batch=B,
                    nbytes=attention_bytes(B, n, ctx, Hq, Hkv, Dh, page, DTYPE),
                    flops=4 * Hq * Dh * B * causal_pairs(n, ctx),
                    params=dict(Hq=Hq, Hkv=Hkv, Dh=Dh, page=page, n=n, ctx=ctx, dtype=DTYPE), variant=variant,
                ))
        return out

    def skip_reason(self, prov: Provider, case: Case) -> str:
        p = case.params
        if prov.kind == "ref" and case.batch * p["Hq"] * p["n"] * (p["n"] + p["ctx"]) > (1 << 28):
            return "reference: full fp32 score matrices, too large at this size (the check uses the peer)"
        return ""

    def make_set(self, case: Case, device: torch.device, seed: int) -> dict:
        from fastmamba.ops.attention import PrefillWork, prefill_block_tokens, prefill_work

        p = case.params
        B, n, ctx, Hq, Hkv, Dh, page, dtype = case.batch, p["n"], p["ctx"], p["Hq"], p["Hkv"], p["Dh"], p["page"], p["dtype"]
        g = torch.Generator(device=device).manual_seed(seed)
        pool = paged_pool(B, ctx + n, Hkv, Dh, page, dtype, g, device)
        k_dense, v_dense = pool.pop("k_dense"), pool.pop("v_dense")
        if ctx:  # the peer's masked path takes no GQA: K/V repeated to the query heads
            k_dense, v_dense = (t.repeat_interleave(Hq // Hkv, dim=1) for t in (k_dense, v_dense))
        cu = list(range(0, B * n + 1, n))
        block_m = prefill_block_tokens(Hq, Hkv, Dh, dtype, device)
        work = PrefillWork(torch.tensor(prefill_work(cu, block_m), dtype=torch.int32, device=device).view(-1, 2),
                           block_m)
        return {
            "q": torch.randn(B * n, Hq, Dh, generator=g, device=device).to(dtype),
            **pool,
            "slots": torch.arange(B, dtype=torch.int32, device=device),
            "cu": torch.tensor(cu, dtype=torch.int32, device=device),
            "ctx": torch.full((B,), ctx, dtype=torch.int32, device=device),
            "k_dense": k_dense, "v_dense": v_dense,  # contiguous: paged_pool's, or repeat_interleave's copies
            "host": {"cu": cu, "slots": list(range(B)), "work": work, "B": B, "n": n, "ctx": ctx},
        }

    def args(self, case: Case, inp: dict) -> tuple:
        return (inp["q"], inp["k_pages"], inp["v_pages"], inp["block_table"], inp["slots"], inp["cu"], inp["ctx"],
                inp["k_dense"], inp["v_dense"], inp["host"])


BENCH = PrefillAttentionBench()
