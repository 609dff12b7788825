"""Plain-PyTorch references of the attention ops (fp32 inside, explicit loops over requests).

float8_e4m3fn pools hold K / k_scale and V / v_scale (``quantize_kv_ref``: saturated at +-448,
rounded to nearest even); a read gives the stored value times its scale (``_gather``).
"""
from __future__ import annotations

import math

import torch

from fastmamba.ops.fp8.ref import FP8_DTYPE, to_fp8_ref


def quantize_kv_ref(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """K or V values -> e4m3 page values: x / scale, saturated to +-448 (NaN stays NaN)."""
    s = scale.float().reshape(()) if isinstance(scale, torch.Tensor) else float(scale)
    return to_fp8_ref(x.float() / s)


def _check_slots(op: str, slots: list[int], num_slots: int) -> None:
    bad = [s for s in slots if s != -1 and not 0 <= s < num_slots][:4]
    if bad:
        raise ValueError(f"{op}: `slots` values must lie in [0, {num_slots}) or be -1 (pad); got {bad}")


def _gather(pages: torch.Tensor, block_table: torch.Tensor, slot: int, n: int, scale=None) -> torch.Tensor:
    """The first n tokens of request ``slot`` as [n, Hkv, Dh] (fp32; float8 pages times ``scale``)."""
    PAGE = pages.shape[1]
    ids = block_table[slot, : (n + PAGE - 1) // PAGE].long()
    x = pages[ids].reshape(-1, *pages.shape[2:])[:n].float()
    if pages.dtype == FP8_DTYPE:
        x = x * (scale.float().reshape(()) if isinstance(scale, torch.Tensor) else float(scale))
    return x


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, first_pos: int) -> torch.Tensor:
    """q [Lq, Hq, Dh] at positions first_pos.., k / v [Lk, Hkv, Dh] at 0..; causal; fp32 [Lq, Hq, Dh]."""
    G = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(G, dim=1)
    v = v.repeat_interleave(G, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    qpos = torch.arange(q.shape[0], device=q.device)[:, None] + first_pos
    kpos = torch.arange(k.shape[0], device=q.device)[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def paged_kv_write_ref(k, v, k_pages, v_pages, block_table, slots, positions, token_rows=None, *, k_scale=None,
                       v_scale=None):
    """Token t goes to request slots[token_rows[t]] at ``positions[t]``; pads (-1) write nothing.
    float8 pools store ``quantize_kv_ref(k, k_scale)`` / ``quantize_kv_ref(v, v_scale)``."""
    if k_pages.dtype == FP8_DTYPE:
        k, v = quantize_kv_ref(k, k_scale), quantize_kv_ref(v, v_scale)
    rows = list(range(k.shape[0])) if token_rows is None else token_rows.tolist()
    sl = slots.tolist()
    _check_slots("paged_kv_write_ref", sl, block_table.shape[0])
    PAGE = k_pages.shape[1]
    for t, r in enumerate(rows):
        s = sl[r]
        if s == -1:
            continue
        pos = int(positions[t])
        page = int(block_table[s, pos // PAGE])
        k_pages[page, pos % PAGE] = k[t].to(k_pages.dtype)  # (float8 already: unchanged)
        v_pages[page, pos % PAGE] = v[t].to(v_pages.dtype)


def varlen_prefill_attention_ref(q, k_pages, v_pages, block_table, slots, cu_seqlens, ctx_lens, *, scale=None,
                                 k_scale=None, v_scale=None):
    """Causal attention of packed prompts over their pages (which already hold the prompts' K/V).

    Prompt b's tokens are at positions ctx_lens[b] .. ctx_lens[b] + L_b - 1 of request slots[b].
    float8 pools: their values times k_scale / v_scale. Returns [T, Hq, Dh] fp32.
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    cu, ctx, sl = cu_seqlens.tolist(), ctx_lens.tolist(), slots.tolist()
    _check_slots("varlen_prefill_attention_ref", sl, block_table.shape[0])
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, s in enumerate(sl):
        if s == -1:
            continue
        n = ctx[b] + cu[b + 1] - cu[b]
        k, v = _gather(k_pages, block_table, s, n, k_scale), _gather(v_pages, block_table, s, n, v_scale)
        out[cu[b]:cu[b + 1]] = _attend(q[cu[b]:cu[b + 1]], k, v, scale, ctx[b])
    return out


def paged_decode_attention_ref(q, k_pages, v_pages, block_table, seq_lens, slots, *, scale=None, k_scale=None,
                               v_scale=None):
    """One query per request attending over the first seq_lens[slots[b]] tokens of its pages.

    q [B, Hq, Dh]; pad rows (slot -1) give zeros; float8 pools: their values times k_scale /
    v_scale. Returns [B, Hq, Dh] fp32.
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    sl = slots.tolist()
    _check_slots("paged_decode_attention_ref", sl, block_table.shape[0])
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, s in enumerate(sl):
        if s == -1:
            continue
        n = int(seq_lens[s])
        if n == 0:
            continue
        k, v = _gather(k_pages, block_table, s, n, k_scale), _gather(v_pages, block_table, s, n, v_scale)
        out[b] = _attend(q[b:b + 1], k, v, scale, n - 1)[0]
    return out
