"""The chunked scan's chunk states and state passing as ONE Hopper kernel in Gluon (the job of
``kernel._chunk_state_kernel`` + ``kernel._state_passing_kernel``); ``states.py`` launches it.

One program per (segment, head h, block of 64 state columns): it walks its segment's chunks in order
with the running state S [P = 64, 64 columns] fp32 in the consumer warpgroup's registers (the wgmma
accumulator layout). Per chunk c (first flat token t0, length len_c, cs = its cumulative log-decay):

    S_in(c) = S                                      -> states_in, x's dtype (the chunk-output stage reads it)
    S_loc   = sum_{s < len_c} exp(cs_last - cs_s) dt'_s x_s^T B_s     (cs_last = cs[len_c - 1])
    S       = exp(cs_last) S + S_loc

S_loc goes 64 tokens at a time through wgmma: A = the x tile [64 tokens, P] transposed on its way from
shared memory into registers, times the tokens' weights; B = the B tile [64 tokens, 64 columns] in
shared memory. So no per-chunk state makes a round trip through HBM (the two Triton kernels write S_loc
in the state dtype and read it back), and the walk carries only S.

Partitions:
- producer (one warp): TMA loads of the (x, B) tiles into a ring of K_STAGES slots, each guarded by a
  ready and an empty mbarrier; next to each slot it stores the block's weights exp(cs_last - cs_s) dt'_s
  (zero past the chunk's end), from the chunk's cs / dt' windows, loaded one chunk ahead.
- consumer (one warpgroup): the matmuls, the fold, and S_in through shared memory and a TMA store issued
  at the chunk's start, so that it leaves while the chunk's blocks run. (Stored from registers, S_in cost
  this kernel 40% of its time: 2-byte scattered stores stalled the walk; H200, 2.7b shape, L=8192: 86 vs
  60 us.)
With ``chunk_out`` (prefix caching), S after every chunk goes out by a second TMA store (an unswizzled
[64, 64] tile of chunk_out's dtype), issued after the chunk's fold; each store waits only for the one
of its kind before it.
At the end: the final state (to its pool slot) and the segment's final state, and, when S is not
finite, the non-finite flag that the Hopper chunk-output kernel's Triton fallback reads (entry 3 of the
chunk table's row 0, as ``kernel._chunk_state_kernel``'s FLAG_NONFINITE: a non-finite x_s of a live
chunk makes S non-finite from its chunk on).

Edges: tokens past a chunk's end (the next segment's, or past the tensor: TMA fills those with zeros)
get weight 0 and, in a chunk's last, partial block, are selected away in x and zeroed in the B tile, so
that a non-finite value there cannot reach this segment (0 * NaN = NaN on the tensor cores). A padding
segment (skip) and a zero-length one walk nothing and store nothing.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fastmamba.ops.ssd_scan.hopper.chunk_output_kernel import _exp, _wait_for_kernel_before

BK = gl.constexpr(64)  # tokens per ring slot
P = gl.constexpr(64)  # the head dim
BN = gl.constexpr(64)  # state columns per program


@gluon.jit
def _chunk(k, seg_lo, seg_len, Q: gl.constexpr):
    """Chunk k of a segment -> (its first flat token, its length)."""
    return seg_lo + k * Q, gl.minimum(seg_len - k * Q, Q)


@gluon.jit
def _producer(x_desc, b_desc, x_smem, b_smem, w_smem, ready, empty, cs_ptr, dt_ptr,
              first, count, seg_lo, seg_len, h, g, nb, n_chunk_slots, N,
              Q: gl.constexpr, K_STAGES: gl.constexpr):
    M_BLOCKS: gl.constexpr = Q // BK
    blk: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [1, 1], [1, 0])
    win: gl.constexpr = gl.SliceLayout(0, blk)
    offs_w = gl.arange(0, M_BLOCKS, layout=gl.SliceLayout(1, blk))
    tile = offs_w[:, None] * BK + gl.arange(0, BK, layout=win)[None, :]  # token within the chunk
    _, length = _chunk(0, seg_lo, seg_len, Q)
    live = (tile * 0 + count) > 0
    nxt_cs = gl.load(cs_ptr + (h * n_chunk_slots + first) * Q + tile, mask=live & (tile < length), other=0.0)
    nxt_dt = gl.load(dt_ptr + (h * n_chunk_slots + first) * Q + tile, mask=live & (tile < length), other=0.0)
    k_i = 0
    for k in range(count):
        start, length = _chunk(k, seg_lo, seg_len, Q)
        cs4 = nxt_cs
        dt4 = nxt_dt
        _, length2 = _chunk(k + 1, seg_lo, seg_len, Q)
        more = (tile * 0 + k + 1 < count) & (tile < length2)
        nxt_cs = gl.load(cs_ptr + (h * n_chunk_slots + first + k + 1) * Q + tile, mask=more, other=0.0)
        nxt_dt = gl.load(dt_ptr + (h * n_chunk_slots + first + k + 1) * Q + tile, mask=more, other=0.0)
        cs_last = gl.sum(gl.sum(gl.where(tile == length - 1, cs4, 0.0), axis=1), axis=0)
        w4 = gl.where(tile < length, _exp(cs_last - cs4) * dt4, 0.0)
        for kb in range(gl.cdiv(length, BK)):
            s = k_i % K_STAGES
            mbarrier.wait(empty.index(s), ((k_i // K_STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), 2 * BK * BN * x_desc.dtype.primitive_bitwidth // 8)
            tma.async_copy_global_to_shared(x_desc, [start + kb * BK, h * P], ready.index(s), x_smem.index(s))
            tma.async_copy_global_to_shared(b_desc, [start + kb * BK, g * N + nb * BN], ready.index(s),
                                            b_smem.index(s))
            w_smem.index(s).store(gl.sum(gl.where(offs_w[:, None] == kb, w4, 0.0), axis=0))
            mbarrier.arrive(ready.index(s))
            k_i += 1


@gluon.jit
def _consumer(si_desc, co_desc, x_smem, b_smem, w_smem, si_smem, co_smem, ready, empty, cs_ptr, table_ptr,
              init_ptr, init_idx_ptr, final_ptr, final_idx_ptr, seg_final_ptr,
              seg, first, count, seg_lo, seg_len, h, nb, H, n_chunk_slots,
              stride_init_s, stride_init_h, stride_init_p, stride_init_n,
              stride_final_s, stride_final_h, stride_final_p, stride_final_n,
              stride_sf_s, stride_sf_h, stride_sf_p, stride_sf_n,
              Q: gl.constexpr, K_STAGES: gl.constexpr, HAS_INIT: gl.constexpr, HAS_FINAL: gl.constexpr,
              HAS_SEG_FINAL: gl.constexpr, HAS_CHUNK_OUT: gl.constexpr):
    dtype: gl.constexpr = x_smem.dtype
    # stores in flight allowed when a tile's buffer is reused: the other kind's store may still run
    OTHERS: gl.constexpr = 1 if HAS_CHUNK_OUT else 0
    live = seg_len >= 0  # a padding segment (seg_len -1) reads and stores no state
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    a_cols: gl.constexpr = gl.SliceLayout(0, a_op)
    b_blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # a B tile in registers
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    offs_p = gl.arange(0, P, layout=rows_l)
    offs_n = nb * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    S = gl.zeros([P, BN], gl.float32, layout=mma)
    if HAS_INIT:
        slot = gl.load(init_idx_ptr + seg)
        if live and slot >= 0:
            src = init_ptr + slot.to(gl.int64) * stride_init_s + h * stride_init_h
            S = gl.load(src + offs_p[:, None] * stride_init_p + offs_n[None, :] * stride_init_n).to(gl.float32)
    _, length = _chunk(0, seg_lo, seg_len, Q)
    nxt_last = gl.load(cs_ptr + (h * n_chunk_slots + first) * Q + length - 1, mask=count > 0, other=0.0)
    k_i = 0
    for k in range(count):
        start, length = _chunk(k, seg_lo, seg_len, Q)
        decay = _exp(gl.zeros([P], gl.float32, layout=rows_l) + nxt_last)
        _, length2 = _chunk(k + 1, seg_lo, seg_len, Q)
        nxt_last = gl.load(cs_ptr + (h * n_chunk_slots + first + k + 1) * Q + length2 - 1, mask=k + 1 < count,
                           other=0.0)
        # S_in of this chunk leaves through a TMA store while its blocks run
        tma.store_wait(OTHERS)
        si_smem.store(S.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(si_desc, [((first + k) * H + h) * P, nb * BN], si_smem)
        acc = gl.zeros([P, BN], gl.float32, layout=mma)
        for kb in range(gl.cdiv(length, BK)):
            s = k_i % K_STAGES
            mbarrier.wait(ready.index(s), (k_i // K_STAGES) & 1)
            w = w_smem.index(s).load(a_cols)
            xt = x_smem.index(s).permute((1, 0)).load(a_op).to(gl.float32)  # [P, BK tokens]
            rest = length - kb * BK
            if rest < BK:  # the chunk's last, partial block: what lies past its end is not multiplied in
                a = gl.where((gl.arange(0, BK, layout=a_cols) < rest)[None, :], xt * w[None, :], 0.0).to(dtype)
                b = b_smem.index(s).load(b_blk)
                b_rows = gl.arange(0, BK, layout=gl.SliceLayout(1, b_blk))
                b_smem.index(s).store(gl.where((b_rows < rest)[:, None], b, gl.zeros_like(b)))
                fence_async_shared()
            else:
                a = (xt * w[None, :]).to(dtype)
            acc = warpgroup_mma(a, b_smem.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index(s))
            k_i += 1
        S = S * decay[:, None] + acc
        if HAS_CHUNK_OUT:  # the state after the chunk
            tma.store_wait(OTHERS)
            co_smem.store(S.to(co_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(co_desc, [((first + k) * H + h) * P, nb * BN], co_smem)
    tile_p = offs_p[:, None]
    tile_n = offs_n[None, :]
    if HAS_FINAL:
        slot = gl.load(final_idx_ptr + seg)
        if live and (slot >= 0) and (count > 0):
            dst = final_ptr + slot.to(gl.int64) * stride_final_s + h * stride_final_h
            gl.store(dst + tile_p * stride_final_p + tile_n * stride_final_n, S.to(final_ptr.dtype.element_ty))
    if HAS_SEG_FINAL:
        if live:
            dst = seg_final_ptr + seg.to(gl.int64) * stride_sf_s + h * stride_sf_h
            gl.store(dst + tile_p * stride_sf_p + tile_n * stride_sf_n, S.to(seg_final_ptr.dtype.element_ty))
    if count > 0:
        if (gl.abs(gl.sum(gl.sum(S, axis=1), axis=0)) < float("inf")) == 0:  # NaN fails the test too
            gl.store(table_ptr + 3, 1)
    tma.store_wait(0)


@gluon.jit
def _segment(cu_ptr, n_seg, seg, Q: gl.constexpr, BLOCK_SEG: gl.constexpr):
    """Segment ``seg`` -> (index of its first chunk, its chunk count, first flat token, length), as
    ``kernel_common._locate_segment`` (chunks are numbered segment after segment)."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, BLOCK_SEG, layout=lay)
    inside = offs < n_seg
    lo = gl.load(cu_ptr + offs, mask=inside, other=0).to(gl.int32)
    hi = gl.load(cu_ptr + offs + 1, mask=inside, other=0).to(gl.int32)
    n_chunks = (hi - lo + Q - 1) // Q
    first = gl.sum(gl.where(offs < seg, n_chunks, 0), axis=0)
    count = gl.sum(gl.where(offs == seg, n_chunks, 0), axis=0)
    seg_lo = gl.sum(gl.where(offs == seg, lo, 0), axis=0)
    seg_len = gl.sum(gl.where(offs == seg, hi - lo, 0), axis=0)
    return first, count, seg_lo, seg_len


@gluon.jit(do_not_specialize=["n_seg"])
def chunk_states_sm90_kernel(
    x_desc, b_desc, si_desc, co_desc,
    cu_ptr, skip_ptr, cs_ptr, dt_ptr, table_ptr,
    init_ptr, init_idx_ptr, final_ptr, final_idx_ptr, seg_final_ptr,
    n_seg, H, heads_per_group, N, n_chunk_slots,
    stride_init_s, stride_init_h, stride_init_p, stride_init_n,
    stride_final_s, stride_final_h, stride_final_p, stride_final_n,
    stride_sf_s, stride_sf_h, stride_sf_p, stride_sf_n,
    Q: gl.constexpr, BLOCK_SEG: gl.constexpr, K_STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    HAS_SKIP: gl.constexpr, HAS_INIT: gl.constexpr, HAS_FINAL: gl.constexpr, HAS_SEG_FINAL: gl.constexpr,
    HAS_CHUNK_OUT: gl.constexpr = False, USE_PDL: gl.constexpr = False,
):
    """Descriptors (2-d views, 64 x 64 boxes): x [tokens, H * P], B [tokens, G * N], states_in
    [chunk slots * H * P, N] (x's dtype), chunk_out [chunk slots * H * P, N] or None (unswizzled);
    tokens are flat (row * row_len + t). cu [n_seg + 1] flat token offsets; skip [n_seg] int8 or None;
    cs / dt' [H, chunk slots, Q] fp32 (the prep kernel's scratch);
    table [chunk slots, 4] int32 (entry 3 of row 0: the non-finite flag); init / final [slots, H, P, N]
    with init_idx / final_idx [n_seg] int32 (-1: none), seg_final [n_seg, H, P, N], each or None.
    Grid: n_seg * H * N / 64 programs, the column block fastest."""
    _wait_for_kernel_before(USE_PDL)  # the prep kernel's scratch (and the op's slot rows) come first
    pid = gl.program_id(0)
    n_nb = N // BN
    nb = pid % n_nb
    h = (pid // n_nb) % H
    seg = pid // (n_nb * H)
    first, count, seg_lo, seg_len = _segment(cu_ptr, n_seg, seg, Q, BLOCK_SEG)
    if HAS_SKIP:  # a padding segment: nothing read, nothing stored
        if gl.load(skip_ptr + seg) != 0:
            count = 0
            seg_len = -1
    dtype: gl.constexpr = x_desc.dtype
    x_smem = gl.allocate_shared_memory(dtype, [K_STAGES, BK, P], x_desc.layout)
    b_smem = gl.allocate_shared_memory(dtype, [K_STAGES, BK, BN], b_desc.layout)
    si_smem = gl.allocate_shared_memory(dtype, [P, BN], si_desc.layout)
    if HAS_CHUNK_OUT:
        co_smem = gl.allocate_shared_memory(co_desc.dtype, [P, BN], co_desc.layout)
    else:
        co_smem = si_smem  # unused
    w_smem = gl.allocate_shared_memory(gl.float32, [K_STAGES, BK], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(K_STAGES):
        mbarrier.init(ready.index(j), count=2)
        mbarrier.init(empty.index(j), count=1)
    fence_async_shared()
    gl.warp_specialize(
        [
            (_consumer, (si_desc, co_desc, x_smem, b_smem, w_smem, si_smem, co_smem, ready, empty, cs_ptr,
                         table_ptr,
                         init_ptr, init_idx_ptr, final_ptr, final_idx_ptr, seg_final_ptr,
                         seg, first, count, seg_lo, seg_len, h, nb, H, n_chunk_slots,
                         stride_init_s, stride_init_h, stride_init_p, stride_init_n,
                         stride_final_s, stride_final_h, stride_final_p, stride_final_n,
                         stride_sf_s, stride_sf_h, stride_sf_p, stride_sf_n,
                         Q, K_STAGES, HAS_INIT, HAS_FINAL, HAS_SEG_FINAL, HAS_CHUNK_OUT)),
            (_producer, (x_desc, b_desc, x_smem, b_smem, w_smem, ready, empty, cs_ptr, dt_ptr,
                         first, count, seg_lo, seg_len, h, h // heads_per_group, nb, n_chunk_slots, N,
                         Q, K_STAGES)),
        ],
        [1],
        [PRODUCER_REGS],
    )

