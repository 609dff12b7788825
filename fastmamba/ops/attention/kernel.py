"""Triton kernels: decode attention over a paged KV cache (one query token per request, GQA), with
an optional split over the context (split-K) and the kernel that merges the splits."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["S", "num_pages", "scale", "pages_per_split"])
def _paged_decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, slots_ptr, out_ptr, part_m_ptr, part_l_ptr, part_o_ptr,
    S, num_pages, scale, pages_per_split,
    stride_q_b, stride_q_h, stride_q_d,
    stride_k_p, stride_k_t, stride_k_h, stride_k_d,
    stride_v_p, stride_v_t, stride_v_h, stride_v_d,
    stride_bt_s, stride_bt_p,
    stride_o_b, stride_o_h, stride_o_d,
    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    NSPLIT: tl.constexpr,
):
    # one program per (request, KV head, split of the context): its G query heads attend over the
    # split's pages with an online softmax (fp32), one page of PAGE tokens per loop trip. With
    # NSPLIT == 1 it writes the output; otherwise its (max, sum, unnormalised output) partials,
    # which _paged_decode_combine_kernel merges.
    b = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
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
    p_lo = split * pages_per_split
    p_hi = tl.minimum(p_lo + pages_per_split, npages)
    for p in range(p_lo, p_hi):
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
    if NSPLIT == 1:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + b * stride_o_b + qh[:, None] * stride_o_h + offs_d[None, :] * stride_o_d,
                 out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])
    else:
        # partials [B, Hq, NSPLIT] (m, l) and [B, Hq, NSPLIT, BLOCK_D] (acc), contiguous fp32
        row = (b * (G * tl.num_programs(1)) + qh) * NSPLIT + split
        tl.store(part_m_ptr + row, m, mask=gmask)
        tl.store(part_l_ptr + row, l, mask=gmask)
        tl.store(part_o_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=gmask[:, None])


@triton.jit
def _paged_decode_combine_kernel(
    part_m_ptr, part_l_ptr, part_o_ptr, out_ptr,
    stride_o_b, stride_o_h, stride_o_d,
    H: tl.constexpr, D: tl.constexpr, NSPLIT: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program per (request, query head): merges its NSPLIT partial softmaxes
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, NSPLIT)
    offs_d = tl.arange(0, BLOCK_D)
    row = (b * H + h) * NSPLIT + offs_s
    m = tl.load(part_m_ptr + row)
    l = tl.load(part_l_ptr + row)
    acc = tl.load(part_o_ptr + row[:, None] * BLOCK_D + offs_d[None, :])
    m_all = tl.max(m, axis=0)
    w = tl.exp(m - m_all)
    l_all = tl.sum(l * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(l_all > 0, l_all, 1.0)
    tl.store(out_ptr + b * stride_o_b + h * stride_o_h + offs_d * stride_o_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < D)


def launch_paged_decode_attention(q, k_pages, v_pages, block_table, seq_lens, slots, out, scale: float,
                                  *, num_splits: int = 1) -> None:
    """q, out [B, Hq, Dh]; k_pages, v_pages [Np, PAGE, Hkv, Dh]; block_table [S, Pmax]; seq_lens [S];
    slots [B]; num_splits a power of two: the context of each request is cut into that many runs
    of ceil(Pmax / num_splits) pages (split-K), merged by a second kernel."""
    import torch

    B, Hq, D = q.shape
    Np, PAGE, Hkv, _ = k_pages.shape
    G = Hq // Hkv
    block_d = triton.next_power_of_2(D)
    pages_per_split = triton.cdiv(block_table.shape[1], num_splits)
    if num_splits > 1:
        part_m = torch.empty(B, Hq, num_splits, device=q.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_o = torch.empty(B, Hq, num_splits, block_d, device=q.device, dtype=torch.float32)
    else:
        part_m = part_l = part_o = out  # not touched
    _paged_decode_attention_kernel[(B, Hkv, num_splits)](
        q, k_pages, v_pages, block_table, seq_lens, slots, out, part_m, part_l, part_o,
        block_table.shape[0], Np, scale, pages_per_split,
        *q.stride(), *k_pages.stride(), *v_pages.stride(), *block_table.stride(), *out.stride(),
        G=G, D=D, PAGE=PAGE, BLOCK_G=triton.next_power_of_2(G), BLOCK_D=block_d, NSPLIT=num_splits,
        num_warps=4,
    )
    if num_splits > 1:
        _paged_decode_combine_kernel[(B, Hq)](
            part_m, part_l, part_o, out, *out.stride(), H=Hq, D=D, NSPLIT=num_splits, BLOCK_D=block_d,
            num_warps=4,
        )
