"""Triton kernel: causal prefill attention of packed prompts over a paged KV cache (GQA).

One program per (work item, KV head). A work item is a block of ``BLOCK_M`` consecutive query
tokens of one prompt: ``work[i] = (prompt b, first token of the block within the prompt)``, built
on the host from the prompts' lengths (``prefill_work``), where the caller holds them already;
unused items hold prompt -1 and exit at once. So the grid depends only on a bound of the packed
length and the prompt count, never on device values, and a CUDA graph captured for a bucket of
(tokens, prompts) replays for any batch of that bucket with the work table as a static input.

A program's rows are its BLOCK_M tokens times the G query heads of its KV head (padded to G_PAD,
a power of two), so K and V are read once per KV head, not once per query head. Its keys are the
request's first ``ctx + last query token + 1`` positions, which the pages hold already (the
prompt's own K/V are written before the attention runs): each loop trip takes BLOCK_N of them,
page ids gathered per tile as in the decode kernel (``kernel.load_kv_tile``), computes q K^T with the causal mask (key
position <= ctx + query token; the trips wholly before the block's first query position skip
it), an online softmax in fp32 (base 2), and p V.

Robust to any metadata: a prompt index outside [0, n_seqs) ends the program, a slot outside [0, S)
gives zero output and reads nothing, a page id outside [0, num_pages) is read as masked, and no
key past the block table's row is read.
"""
from __future__ import annotations

from collections.abc import Sequence

import triton
import triton.language as tl

from fastmamba.ops._common.host_math import cdiv, next_power_of_2
from fastmamba.ops._common.launch import lean
from fastmamba.ops.attention.kernel import kv_in, kv_scales, load_kv_tile, online_softmax_step, upcast_and_precision

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["S", "num_pages", "max_pages", "n_seqs", "qk_scale"])
def _paged_prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, slots_ptr, cu_ptr, ctx_ptr, work_ptr, out_ptr, ks_ptr, vs_ptr,
    S, num_pages, max_pages, n_seqs, qk_scale,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_p, stride_k_t, stride_k_h, stride_k_d,
    stride_v_p, stride_v_t, stride_v_h, stride_v_d,
    stride_bt_s, stride_bt_p,
    stride_o_t, stride_o_h, stride_o_d,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGES_PER_TILE: tl.constexpr, UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    item = tl.program_id(0)
    kh = tl.program_id(1).to(tl.int64)
    b = tl.load(work_ptr + 2 * item).to(tl.int64)
    if (b < 0) | (b >= n_seqs):
        return
    q0 = tl.load(work_ptr + 2 * item + 1).to(tl.int64)  # the block's first token within its prompt
    t0 = tl.load(cu_ptr + b).to(tl.int64)
    L = tl.load(cu_ptr + b + 1).to(tl.int64) - t0
    slot = tl.load(slots_ptr + b).to(tl.int64)
    valid = (slot >= 0) & (slot < S)  # outside the pool = a pad prompt: zero output, nothing read
    slot = tl.where(valid, slot, 0)
    ctx = tl.maximum(tl.load(ctx_ptr + b).to(tl.int64), 0)

    R: tl.constexpr = BLOCK_M * G_PAD
    offs_r = tl.arange(0, R)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tok = q0 + offs_r // G_PAD  # each row's token within the prompt ...
    gi = offs_r % G_PAD  # ... and query head within the KV head's group
    qh = kh * G + gi
    dmask = offs_d < D
    row_ok = (tok < L) & (tok >= 0) & (gi < G)
    q_rows = q_ptr + (t0 + tok) * stride_q_t + qh * stride_q_h
    q = tl.load(q_rows[:, None] + offs_d[None, :] * stride_q_d, mask=row_ok[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    qpos = ctx + tok  # each row's position in its request
    # keys: every position up to the block's last query token, never past the table's row
    hi = ctx + tl.minimum(q0 + BLOCK_M, L)
    hi = tl.where(valid, tl.minimum(hi, max_pages * PAGE), 0)
    bt_row = bt_ptr + slot * stride_bt_s
    k_head = k_ptr + kh * stride_k_h + offs_d[None, :] * stride_k_d
    v_head = v_ptr + kh * stride_v_h + offs_d[None, :] * stride_v_d
    s_scale, o_scale = kv_scales(qk_scale, ks_ptr, vs_ptr, KV_FP8)

    m = tl.full([R], -1e30, tl.float32)  # finite: a fully masked tile leaves alpha = 1, p = 0
    l = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, BLOCK_D], tl.float32)
    # keys before the block's first query position are visible to every row: no causal mask there
    full = tl.minimum((ctx + q0) // BLOCK_N * BLOCK_N, hi)
    for start in range(0, full, BLOCK_N):
        k, v, pos, tok_ok = load_kv_tile(start, offs_n, hi, bt_row, k_head, v_head, num_pages, stride_bt_p, stride_k_p,
                                         stride_k_t, stride_v_p, stride_v_t, dmask, D, BLOCK_D, PAGE, BLOCK_N,
                                         PAGES_PER_TILE)
        k, v = kv_in(k, v, q)
        m, l, acc = online_softmax_step(q, k, v, tok_ok[None, :], m, l, acc, s_scale, DOT_PRECISION)
    for start in range(full, hi, BLOCK_N):  # the causal mask: a key at most the row's own position
        k, v, pos, tok_ok = load_kv_tile(start, offs_n, hi, bt_row, k_head, v_head, num_pages, stride_bt_p, stride_k_p,
                                         stride_k_t, stride_v_p, stride_v_t, dmask, D, BLOCK_D, PAGE, BLOCK_N,
                                         PAGES_PER_TILE)
        k, v = kv_in(k, v, q)
        keep = tok_ok[None, :] & (pos[None, :] <= qpos[:, None])
        m, l, acc = online_softmax_step(q, k, v, keep, m, l, acc, s_scale, DOT_PRECISION)
    if KV_FP8:
        acc = acc * o_scale
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_rows = out_ptr + (t0 + tok) * stride_o_t + qh * stride_o_h
    tl.store(o_rows[:, None] + offs_d[None, :] * stride_o_d, out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dmask[None, :])


def group_pad(n_heads: int, n_kv_heads: int) -> int:
    """G_PAD: the query heads of one KV head, padded to a power of two."""
    return next_power_of_2(n_heads // n_kv_heads)


def work_items_bound(tokens: int, prompts: int, block_m: int) -> int:
    """The most work items ``prefill_work`` makes for ``prompts`` prompts of ``tokens`` in all: each
    prompt of L tokens takes ceil(L / block_m) <= L / block_m + 1 of them."""
    return cdiv(tokens, block_m) + prompts


def prefill_work(cu_seqlens: Sequence[int], block_m: int, capacity: int | None = None) -> list[int]:
    """The work table of a packed call, flattened: (prompt b, first token of a block of ``block_m``)
    for every block of every prompt, then (-1, 0) up to ``capacity`` items (None: no padding)."""
    out: list[int] = []
    for b in range(len(cu_seqlens) - 1):
        for q0 in range(0, cu_seqlens[b + 1] - cu_seqlens[b], block_m):
            out += (b, q0)
    if capacity is not None:
        if len(out) > 2 * capacity:
            raise ValueError(f"prefill_work: {len(out) // 2} work items exceed the capacity {capacity}")
        out += (-1, 0) * (capacity - len(out) // 2)
    return out


def prefill_kv_values(ctx: Sequence[int], layout: Sequence[int], cu: Sequence[int], block_m: int,
                      capacity: int | None = None) -> dict[str, list[int]]:
    """A packed prefill's attention metadata as host lists (what the runtime's ``StagedPrefill``
    holds as tensors: the inputs of ``varlen_prefill_attention`` beyond q, k, v and the pages).

    ctx       tokens each real request held before the call (the first len(ctx) requests)
    layout    every request's token count, real then padding requests (slot -1, if any)
    cu        layout's cumulative sums from 0 (the call's cu_seqlens)
    Returns positions (each real token's position, 0 for padding tokens), token_rows (each token's
    request), ctx (0 for padding requests) and work (``prefill_work(cu, block_m, capacity)``)."""
    real = sum(layout[:len(ctx)])
    return {"positions": [c + i for c, n in zip(ctx, layout) for i in range(n)] + [0] * (cu[-1] - real),
            "token_rows": [b for b, n in enumerate(layout) for _ in range(n)],
            "ctx": list(ctx) + [0] * (len(layout) - len(ctx)),
            "work": prefill_work(cu, block_m, capacity)}


def launch_paged_prefill_attention(q, k_pages, v_pages, block_table, slots, cu_seqlens, ctx_lens, work, out,
                                   scale: float, block_m: int, config, k_scale=None, v_scale=None) -> None:
    """q, out [T, Hq, Dh]; k_pages, v_pages [Np, PAGE, Hkv, Dh]; block_table [S, Pmax]; slots [B];
    cu_seqlens [B+1]; ctx_lens [B]; work [n, 2] (``prefill_work`` for ``block_m``); ``config`` the
    tile (rows, block_n, warps, stages) of ``configs.pick_prefill_tile``; k_scale, v_scale:
    one-element device tensors with float8 pages (else None)."""
    T, Hq, D = q.shape
    Np, PAGE, Hkv, _ = k_pages.shape
    G = Hq // Hkv
    block_n = min(config.block_n, max(16, 8 * PAGE))  # at most 8 page-id loads per trip
    upcast, precision = upcast_and_precision(q, k_pages, v_pages)
    fp8 = k_scale is not None
    lean(_paged_prefill_attention_kernel)[(work.shape[0], Hkv)](
        q, k_pages, v_pages, block_table, slots, cu_seqlens, ctx_lens, work, out,
        k_scale if fp8 else out, v_scale if fp8 else out,
        block_table.shape[0], Np, block_table.shape[1], slots.shape[0], scale * LOG2E,
        *q.stride(), *k_pages.stride(), *v_pages.stride(), *block_table.stride(), *out.stride(),
        G=G, G_PAD=next_power_of_2(G), D=D, BLOCK_D=max(16, next_power_of_2(D)), PAGE=PAGE,
        BLOCK_M=block_m, BLOCK_N=block_n, PAGES_PER_TILE=max(1, block_n // PAGE), UPCAST=upcast,
        KV_FP8=fp8, DOT_PRECISION=precision, num_warps=config.num_warps, num_stages=config.num_stages,
    )
