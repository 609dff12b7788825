"""Triton kernel: decode attention over a paged KV cache (one query token per request, GQA)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["S", "num_pages", "scale"])
def _paged_decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, slots_ptr, out_ptr,
    S, num_pages, scale,
    stride_q_b, stride_q_h, stride_q_d,
    stride_k_p, stride_k_t, stride_k_h, stride_k_d,
    stride_v_p, stride_v_t, stride_v_h, stride_v_d,
    stride_bt_s, stride_bt_p,
    stride_o_b, stride_o_h, stride_o_d,
    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program per (request, KV head): its G query heads attend over the request's pages with
    # an online softmax (fp32), one page of PAGE tokens per loop trip
    b = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    valid = (slot >= 0) & (slot < S)  # outside the pool = a pad row: nothing read, zero output
    slot = tl.where(valid, slot, 0)
    L = tl.load(lens_ptr + slot).to(tl.int64)
    L = tl.where(valid, L, 0)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, PAGE)
    gmask = offs_g < G
    dmask = offs_d < D
    qh = kh * G + offs_g
    q = tl.load(q_ptr + b * stride_q_b + qh[:, None] * stride_q_h + offs_d[None, :] * stride_q_d,
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32) * scale

    m = tl.full([BLOCK_G], -1e30, tl.float32)  # finite: a fully masked page leaves alpha = 1, p = 0
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    npages = (L + PAGE - 1) // PAGE
    for p in range(0, npages):
        page = tl.load(bt_ptr + slot * stride_bt_s + p * stride_bt_p).to(tl.int64)
        page_ok = (page >= 0) & (page < num_pages)  # never read outside the pool
        page = tl.where(page_ok, page, 0)
        pos = p * PAGE + offs_t
        tmask = (pos < L) & page_ok
        kv_mask = tmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + page * stride_k_p + offs_t[:, None] * stride_k_t + kh * stride_k_h
                    + offs_d[None, :] * stride_k_d, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BLOCK_G, PAGE]
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        pexp = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(pexp, axis=1)
        v = tl.load(v_ptr + page * stride_v_p + offs_t[:, None] * stride_v_t + kh * stride_v_h
                    + offs_d[None, :] * stride_v_d, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(pexp[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + b * stride_o_b + qh[:, None] * stride_o_h + offs_d[None, :] * stride_o_d,
             out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


def launch_paged_decode_attention(q, k_pages, v_pages, block_table, seq_lens, slots, out, scale: float) -> None:
    """q, out [B, Hq, Dh]; k_pages, v_pages [Np, PAGE, Hkv, Dh]; block_table [S, Pmax]; seq_lens [S]; slots [B]."""
    B, Hq, D = q.shape
    Np, PAGE, Hkv, _ = k_pages.shape
    G = Hq // Hkv
    _paged_decode_attention_kernel[(B, Hkv)](
        q, k_pages, v_pages, block_table, seq_lens, slots, out,
        block_table.shape[0], Np, scale,
        *q.stride(), *k_pages.stride(), *v_pages.stride(), *block_table.stride(), *out.stride(),
        G=G, D=D, PAGE=PAGE, BLOCK_G=triton.next_power_of_2(G), BLOCK_D=triton.next_power_of_2(D),
        num_warps=4,
    )
