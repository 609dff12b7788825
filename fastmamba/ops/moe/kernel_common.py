"""What the MoE kernels share: the @triton.jit pieces (each expert's padded rows, a grouped GEMM
program's block and pairs, the fixed-order k-sum of one token) and the alignment's layout rules.

``block_of_program`` and ``load_pairs`` are public: ops/fp8's grouped GEMMs read the same
alignment with them. The kernels: ``kernel.py`` (the grouped GEMMs, the k-sum and the module
docstring with the whole plan), ``align_kernel.py``, ``gemv_kernel.py``, ``router_kernel.py``.
"""
from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from fastmamba.ops._common.host_math import cdiv


@triton.jit
def _padded_starts(counts_ptr, E, BM: tl.constexpr, BLOCK_E: tl.constexpr):
    """Per expert (a [BLOCK_E] vector): its token count, and the start and end of its rows in the
    sorted order, each expert's rows padded to a multiple of BM."""
    offs_e = tl.arange(0, BLOCK_E)
    c = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0)
    padded = (c + BM - 1) // BM * BM
    end = tl.cumsum(padded, axis=0)
    return offs_e, c, end - padded, end


@triton.jit
def block_of_program(counts_ptr, E, n_cols, BM: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                     BLOCK_E: tl.constexpr):
    """The (row block, column block) this program owns, in groups of GROUP_M row blocks (weight
    tiles reused from L2 by the blocks of one expert), its expert, the first row of that expert,
    its count of real rows, and the number of rows in use (a block at or past it has nothing to do)."""
    pid = tl.program_id(0)
    n_blocks_n = tl.cdiv(n_cols, BLOCK_N)
    n_blocks_m = tl.num_programs(0) // n_blocks_n
    in_group = GROUP_M * n_blocks_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(n_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    offs_e, c, start, end = _padded_starts(counts_ptr, E, BM, BLOCK_E)
    row0 = pid_m * BM
    # expert of this block: the number of experts whose padded rows end at or before row0
    e = tl.sum(((end <= row0) & (offs_e < E)).to(tl.int32), axis=0)
    e_start = tl.sum(tl.where(offs_e == e, start, 0), axis=0)
    e_count = tl.sum(tl.where(offs_e == e, c, 0), axis=0)
    return pid_m, pid_n, e, e_start, e_count, tl.max(end, axis=0)


@triton.jit
def load_pairs(pairs_ptr, e, e_start, offs_r, real, stride_se, PER_EXPERT: tl.constexpr):
    """The pair of each row (0 where not real): from expert e's list, or from the padded rows."""
    if PER_EXPERT:
        return tl.load(pairs_ptr + e.to(tl.int64) * stride_se + (offs_r - e_start), mask=real, other=0)
    return tl.load(pairs_ptr + offs_r, mask=real, other=0)


@triton.jit
def _sum_pairs(y_ptr, ids_ptr, t, offs_n, mn, E, stride_yp, stride_it, stride_ik,
               K: tl.constexpr, N_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, CG: tl.constexpr):
    """sum_j y[t*(K+N_SHARED) + j, offs_n] in fp32, j in order: the K routed pairs whose id lies in
    [0, E) (another pair's row adds nothing), then the N_SHARED shared slices. CG: read through L2
    (rows other programs of the running kernel wrote)."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(K + N_SHARED):
        row = y_ptr + (t * (K + N_SHARED) + j) * stride_yp + offs_n
        m = mn
        if j < K:
            e = tl.load(ids_ptr + t * stride_it + j * stride_ik)
            m = mn & (e >= 0) & (e < E)
        if CG:
            acc += tl.load(row, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        else:
            acc += tl.load(row, mask=m, other=0.0).to(tl.float32)
    return acc


ALIGN_LISTS_MAX = 1 << 22  # E * P int32 entries (16 MiB): up to here per-expert lists in one launch ...
ALIGN_LISTS_MAX_PAIRS = 8192  # ... and up to 8 sequential chunks of 1024 pairs per program


class AlignLayout(NamedTuple):
    """Where the alignment puts each expert's pairs: per-expert lists [E, P] (``stride`` = P; one
    launch) or rows of the BM-padded expert-sorted order (``stride`` = 0; four launches)."""

    per_expert: bool
    entries: int  # int32 entries of the pair buffer
    stride: int


def align_layout(P: int, E: int, block_m: int, lists_max: int | None = None) -> AlignLayout:
    """Per-expert lists while E * P <= ``ALIGN_LISTS_MAX`` and P <= ``ALIGN_LISTS_MAX_PAIRS`` (Nano:
    T <= 1365; Super: T <= 186), else padded rows. ``lists_max`` replaces the first bound alone."""
    if P <= ALIGN_LISTS_MAX_PAIRS and E * P <= (ALIGN_LISTS_MAX if lists_max is None else lists_max):
        return AlignLayout(True, E * P, P)
    return AlignLayout(False, grouped_rows(P, E, block_m), 0)


def grouped_rows(P: int, E: int, block_m: int) -> int:
    """Rows of the sorted, BM-padded order in the worst case: every expert that gets a pair pads
    its rows up to a multiple of BM (at most min(E, P) experts pad, each by at most BM - 1)."""
    rows = P + min(E, P) * (block_m - 1)
    return cdiv(rows, block_m) * block_m
