"""Paged decode attention (``paged_decode_attention``), the attention layers' decode op of a hybrid model.

B requests of one query token each attend over L cached tokens (all requests the same L), GQA with
Nemotron-H's attention shape (32 query / 8 KV heads of 128), bf16, pages of 16 tokens handed out
in a random order (a fragmented pool, as after churn). Peer: PyTorch's
``scaled_dot_product_attention`` on a contiguous cache [B, Hkv, L, Dh] gathered beforehand (not
timed: the best case for a dense kernel, which a paged cache would first have to gather).
Bytes per call: K and V of every cached token read once, q read, out written, the block table's
used entries and the lengths read. Each shape also runs with float8_e4m3fn pages (``kv fp8``,
scales 1.0: K and V of N(0, 1) fit e4m3's range), half the K/V bytes; the gathered peer then
reads the same values in bf16 (twice the bytes its row's GB/s counts: a dense bf16 cache is what
it has).

Every provider takes the same arguments (the paged pools, block table, lengths, slots, and the
gathered cache) and uses its own part of them.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fastmamba.bench.ops._attention import AttentionBench, paged_pool
from fastmamba.bench.ops._base import DTYPE_NAMES, Case, Provider

# name -> (Hq, Hkv, Dh, PAGE)
GPU_SHAPES = {"nemotron-h": (32, 8, 128, 16)}
CPU_SHAPES = {"tiny": (4, 2, 16, 4)}
GPU_CONTEXTS = (1024, 4096, 8192, 32768)
CPU_CONTEXTS = (16, 37)
GPU_EXTRA_BATCHES = (32,)  # the bar: >= 80% of copy at batch >= 32, 8k context
MAX_CACHED_TOKENS = 1 << 21  # B x L cap (paged + gathered copies: 2 x 8 GiB at the GPU shape)
DTYPE = torch.bfloat16


KV_DTYPES = (None, torch.float8_e4m3fn)  # pages in the queries' dtype, then float8
_ONES: dict[torch.device, torch.Tensor] = {}  # the float8 runs' scale (1.0) per device, made once


def attention_bytes(B: int, L: int, Hq: int, Hkv: int, Dh: int, page: int, dtype: torch.dtype,
                    kv_dtype: torch.dtype | None = None) -> int:
    e, kv = dtype.itemsize, (kv_dtype or dtype).itemsize
    return 2 * B * L * Hkv * Dh * kv + 2 * B * Hq * Dh * e + B * (-(-L // page)) * 4 + B * 4 * 2


def _scales(k_pages) -> dict:
    """The ops' scale arguments: 1.0 (a device tensor made once) for float8 pages, none else."""
    if k_pages.dtype != torch.float8_e4m3fn:
        return {}
    one = _ONES.setdefault(k_pages.device, torch.ones((), device=k_pages.device))
    return {"k_scale": one, "v_scale": one}


def _ours(q, k_pages, v_pages, block_table, seq_lens, slots, k_dense, v_dense):
    from fastmamba.ops.attention import paged_decode_attention

    return paged_decode_attention(q, k_pages, v_pages, block_table, seq_lens, slots, **_scales(k_pages))


def _sdpa(q, k_pages, v_pages, block_table, seq_lens, slots, k_dense, v_dense):
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k_dense, v_dense, enable_gqa=q.shape[1] != k_dense.shape[1])
    return o.squeeze(2)


def _ref(q, k_pages, v_pages, block_table, seq_lens, slots, k_dense, v_dense):
    from fastmamba.ops.attention.ref import paged_decode_attention_ref

    return paged_decode_attention_ref(q, k_pages, v_pages, block_table, seq_lens, slots, **_scales(k_pages))


class PagedAttentionBench(AttentionBench):
    key = "attn"
    title = "paged_decode_attention"
    op_name = "paged_decode_attention"
    sdpa_note = "torch scaled_dot_product_attention on a contiguous [B, Hkv, L, Dh] cache"
    ours, sdpa, ref = staticmethod(_ours), staticmethod(_sdpa), staticmethod(_ref)

    def cases(self, device: torch.device, batches: Sequence[int]) -> list[Case]:
        cuda = device.type == "cuda"
        shapes = GPU_SHAPES if cuda else CPU_SHAPES
        contexts = GPU_CONTEXTS if cuda else CPU_CONTEXTS
        batches = sorted(set(batches) | set(GPU_EXTRA_BATCHES)) if cuda else list(batches)
        out = []
        for shape, (Hq, Hkv, Dh, page) in shapes.items():
            for kv in KV_DTYPES:
                for L in contexts:
                    for B in batches:
                        if B * L > MAX_CACHED_TOKENS:
                            continue
                        tag = " kv fp8" if kv is not None else ""
                        out.append(Case(
                            op=self.key, shape=shape, dims=f"Hq{Hq} Hkv{Hkv} Dh{Dh} page{page} L{L}{tag}",
                            dtype=DTYPE_NAMES[DTYPE], batch=B,
                            nbytes=attention_bytes(B, L, Hq, Hkv, Dh, page, DTYPE, kv),
                            params=dict(Hq=Hq, Hkv=Hkv, Dh=Dh, page=page, L=L, dtype=DTYPE, kv_dtype=kv),
                            variant=f"L{L}{'-kv-fp8' if kv is not None else ''}",
                        ))
        return out

    def skip_reason(self, prov: Provider, case: Case) -> str:
        if prov.kind == "ref" and case.batch * case.params["L"] > (1 << 16):
            return "reference: one Python-level SDPA per request, too slow at this size (the check uses it below)"
        return ""

    def make_set(self, case: Case, device: torch.device, seed: int) -> dict:
        p = case.params
        B, L, Hq, Hkv, Dh, page, dtype = case.batch, p["L"], p["Hq"], p["Hkv"], p["Dh"], p["page"], p["dtype"]
        g = torch.Generator(device=device).manual_seed(seed)
        pool = paged_pool(B, L, Hkv, Dh, page, dtype, g, device)
        if p.get("kv_dtype") is not None:  # float8 pages; the gathered peer reads the same values
            for name in ("k_pages", "v_pages"):
                pool[name] = pool[name].to(p["kv_dtype"])
            for name in ("k_dense", "v_dense"):
                pool[name] = pool[name].to(p["kv_dtype"]).to(dtype)
        return {
            "q": torch.randn(B, Hq, Dh, generator=g, device=device).to(dtype),
            "seq_lens": torch.full((B,), L, dtype=torch.int32, device=device),
            "slots": torch.arange(B, dtype=torch.int32, device=device),
            **pool,
        }

    def args(self, case: Case, inp: dict) -> tuple:
        return (inp["q"], inp["k_pages"], inp["v_pages"], inp["block_table"], inp["seq_lens"], inp["slots"],
                inp["k_dense"], inp["v_dense"])


BENCH = PagedAttentionBench()
