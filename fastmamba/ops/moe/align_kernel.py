"""The token-expert alignment of the grouped path (see ``kernel.py``'s docstring): per-expert
lists in one launch (``_align_expert_kernel``), or the BM-padded expert-sorted rows in four
(a memset, ``_count_kernel``, ``_starts_kernel``, ``_scatter_kernel``). Which one: ``align_layout``
(``kernel_common.py``)."""
from __future__ import annotations

import triton
import triton.language as tl

from fastmamba.ops._common.host_math import cdiv, next_power_of_2
from fastmamba.ops._common.launch import lean
from fastmamba.ops.moe.kernel_common import AlignLayout, _padded_starts


@triton.jit
def _pair_ids(ids_ptr, offs_p, P, E, K, stride_it, stride_ik):
    """The expert of each pair p = t*K + j in ``offs_p`` and whether it is a real pair with an id in [0, E)."""
    mp = offs_p < P
    e = tl.load(ids_ptr + (offs_p // K) * stride_it + (offs_p % K) * stride_ik, mask=mp, other=0).to(tl.int32)
    ok = mp & (e >= 0) & (e < E)
    return e, ok


@triton.jit(do_not_specialize=["P"])
def _count_kernel(ids_ptr, counts_ptr, P, E, K, stride_it, stride_ik,
                  BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    # one program per BLOCK_P pairs: a histogram of their experts, added to counts[E]
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    e, ok = _pair_ids(ids_ptr, offs_p, P, E, K, stride_it, stride_ik)
    hist = tl.histogram(e, BLOCK_E, mask=ok)
    offs_e = tl.arange(0, BLOCK_E)
    tl.atomic_add(counts_ptr + offs_e, hist, mask=(offs_e < E) & (hist > 0))


@triton.jit
def _starts_kernel(counts_ptr, cursor_ptr, E, BM: tl.constexpr, BLOCK_E: tl.constexpr):
    # one program: cursor[e] = the first row of expert e (exclusive cumsum of the BM-padded counts)
    offs_e, _, start, _ = _padded_starts(counts_ptr, E, BM, BLOCK_E)
    tl.store(cursor_ptr + offs_e, start, mask=offs_e < E)


@triton.jit(do_not_specialize=["P"])
def _scatter_kernel(ids_ptr, cursor_ptr, sorted_ptr, P, E, K, stride_it, stride_ik, BLOCK_P: tl.constexpr):
    # one program per BLOCK_P pairs: each pair takes the next row of its expert (an atomic cursor)
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    e, ok = _pair_ids(ids_ptr, offs_p, P, E, K, stride_it, stride_ik)
    row = tl.atomic_add(cursor_ptr + e, 1, mask=ok)
    tl.store(sorted_ptr + row, offs_p, mask=ok)


@triton.jit(do_not_specialize=["P", "stride_le"])
def _align_expert_kernel(ids_ptr, counts_ptr, lists_ptr, P, E, K, stride_it, stride_ik, stride_le,
                         BLOCK_P: tl.constexpr):
    # one program per expert, one launch, no atomics: the expert's pairs in pair order into its
    # list (lists[e, :count]) and its count; the GEMMs find each expert's padded rows from the counts
    me = tl.program_id(0)
    offs_j = tl.arange(0, BLOCK_P)
    base = lists_ptr + me.to(tl.int64) * stride_le
    seen = me * 0
    for p0 in range(0, P, BLOCK_P):
        offs_p = p0 + offs_j
        e, ok = _pair_ids(ids_ptr, offs_p, P, E, K, stride_it, stride_ik)
        mine = (ok & (e == me)).to(tl.int32)
        rank = tl.cumsum(mine, axis=0) - 1
        tl.store(base + seen + rank, offs_p, mask=mine > 0)
        seen += tl.sum(mine, axis=0)
    tl.store(counts_ptr + me, seen)


def launch_align(ids, counts, cursor, pairs, *, E: int, block_m: int, layout: AlignLayout) -> None:
    """ids [T, k]; counts, cursor [E] int32, any contents (written: counts per expert; cursor is
    scratch); pairs [layout.entries] int32 (written at the real pairs' entries only).

    Per-expert lists: ``_align_expert_kernel`` (an expert's pairs in pair order). Padded rows: zero
    the counts, ``_count_kernel``, ``_starts_kernel``, ``_scatter_kernel`` (atomics: the order inside
    an expert varies from run to run, which no output depends on)."""
    T, K = ids.shape
    P = T * K
    if layout.per_expert:
        lean(_align_expert_kernel)[(E,)](ids, counts, pairs, P, E, K, ids.stride(0), ids.stride(1), layout.stride,
                                          BLOCK_P=1024, num_warps=4)
        return
    block_e = max(16, next_power_of_2(E))
    counts.zero_()
    block_p = 256
    grid = (cdiv(P, block_p),)
    lean(_count_kernel)[grid](ids, counts, P, E, K, ids.stride(0), ids.stride(1),
                              BLOCK_P=block_p, BLOCK_E=block_e, num_warps=4)
    lean(_starts_kernel)[(1,)](counts, cursor, E, BM=block_m, BLOCK_E=block_e, num_warps=4)
    lean(_scatter_kernel)[grid](ids, cursor, pairs, P, E, K, ids.stride(0), ids.stride(1),
                                BLOCK_P=block_p, num_warps=4)
