"""The chunk-output stage of the SSD scan (``_chunk_scan_kernel``'s job) as a Hopper kernel in Gluon.

Same inputs, same output as the portable Triton kernel in ``kernel.py`` (its docstring has the math);
``chunk_output.py`` picks it on sm_90 for the shapes it covers. One work item = (head h, chunk c, block of
BM = 64 output rows starting at m0):

    y_t = exp(cs_t) C_t S_in^T + sum_{s <= t} (C_t . B_s) exp(cs_t - cs_s) dt'_s x_s  (+ D x_t) (* silu(z_t))

A persistent program walks the items head-major (the row blocks of one (chunk, head) side by side,
run by neighbouring programs); its row block turns with each of its items (``_item``), since a fixed
one would leave a quarter of the programs with four token blocks per item and another with one (that
imbalance cost 13-22% of this kernel). Each program is split in two partitions:
- producer (one warp): TMA loads into three rings, each slot guarded by a ready and an empty mbarrier:
  (C rows, entering state S) per item, z per item, one (C B^T tile, x tile) per token block k <= m0.
  Next to each slot it puts what the consumer needs of the chunk's cs / dt' windows (loaded one item
  ahead), so the consumer never waits on a global load: a block before m0 gets its column weights
  exp(r - cs_s) dt'_s ready-made, the diagonal block cs and dt'.
- consumer (one warpgroup): the matmuls on wgmma. C S^T and the blocks before m0 go first (the decay
  there is a rank-1 scaling: exp(cs_t - cs_s) = exp(cs_t - r) exp(r - cs_s), r = cs[m0 - 1], so the
  C B^T tiles carry exp(r - cs_s) dt'_s on their columns and the rows get exp(cs_t - r) after); the
  diagonal block gets its exact per-element causal decay (or, DIAG_SPLIT, the same rank-1 split about
  a = cs[m0] when cs falls less than 60 over the block, so both factors stay finite; bf16 only: e^60
  overflows fp16; with no causal mask, as C B^T's diagonal tiles are zero above the diagonal and the
  weights zero past the chunk's end). C B^T goes from shared memory straight into wgmma's A-operand
  registers, x is the B operand in shared memory.
  Full 64-row blocks leave through a TMA store; the last, partial block of a chunk through masked
  stores from registers.

Edges, as in the Triton kernel: chunks past the chunk count (the table's segment >= n_seg) and row
blocks past a chunk's end do nothing; a padding segment's rows are zeros; rows and columns past the
chunk's end are selected away, never multiplied in (the cs / dt' scratch holds garbage there).
Non-finite x: in the diagonal tile a non-finite x_s would reach rows t < s through a zero weight
(0 * NaN = NaN on the tensor cores). Cleaning the tile and marking the NaN columns cost this kernel 20%
(a reduction across warps per item; H200, L=8192: 212 vs 177 us), so instead the chunk-state kernel
before it flags any chunk whose state contribution is not finite (entry 3 of the chunk table's row 0,
zeroed by the prep kernel; ``kernel._chunk_state_kernel``'s FLAG_NONFINITE), and the Triton kernel,
launched right after this one with ONLY_IF_FLAGGED, redoes the whole stage when it is set and exits at
once otherwise. (This kernel flagged its own diagonal x tiles before: a row sum and a predicated store
per item.)
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

from fastmamba.ops.ssd_scan.chunked import kernel_common

BM = gl.constexpr(64)  # output rows per item = tokens per C B^T / x tile = the head dim P
HALF_N = gl.constexpr(64)  # C and S go in 64-column pieces (128-byte rows: one TMA box, 128-byte swizzle)
NORM_SPAN = gl.constexpr(kernel_common.NORM_SPAN.value)  # columns per partial sum of squares of the deferred norm


@gluon.jit
def _exp(x):
    """exp in fp32 through the approximate PTX exp2 (what the Triton kernels' FAST_MATH uses)."""
    return gl.inline_asm_elementwise("{ .reg .f32 e; mul.f32 e, $1, 0f3FB8AA3B; ex2.approx.ftz.f32 $0, e; }",
                                     "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _silu(x):
    """x * sigmoid(x) through the approximate PTX exp2 and reciprocal."""
    return gl.inline_asm_elementwise("{ .reg .f32 e, d, r; mul.f32 e, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 e, e; "
                                     "add.f32 d, e, 0f3F800000; rcp.approx.ftz.f32 r, d; mul.f32 $0, $1, r; }",
                                     "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _wait_for_kernel_before(USE_PDL: gl.constexpr):
    """Under programmatic dependent launch: wait until the kernel before has finished and its writes
    are visible (``griddepcontrol.wait``, as ``kernel_common._wait_for_kernel_before``). Each partition calls
    it before its first global read."""
    if USE_PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _item(item, wave, n_items, n_chunks, n_seg, table_ptr, skip_ptr, M_BLOCKS: gl.constexpr,
          HAS_SKIP: gl.constexpr):
    """Work item -> (row block, chunk, head, chunk's first flat token, rows of this block inside the
    chunk (<= 0: none), padding segment). ``wave``: the item's turn in its program's loop (item // the
    program count, a multiple of M_BLOCKS). The M_BLOCKS row blocks of a (chunk, head) are consecutive
    items, run side by side by neighbouring programs, and the row block turns with the wave: without
    it every program would get the same row block in each item (item % M_BLOCKS = its id's), so the
    programs of the last block, which walk M_BLOCKS token blocks per item to the first block's one,
    set the kernel's time. The division by the runtime chunk count goes through an fp32 reciprocal
    (exact for item < 2^22), not the ~50-instruction integer division."""
    mb = (item + wave) % M_BLOCKS
    q = item // M_BLOCKS
    h = ((q.to(gl.float32) + 0.5) * (1.0 / n_chunks.to(gl.float32))).to(gl.int32)
    c = q - h * n_chunks
    inside = item < n_items
    start = gl.load(table_ptr + c * 4, mask=inside, other=0)
    length = gl.load(table_ptr + c * 4 + 1, mask=inside, other=0)
    seg = gl.load(table_ptr + c * 4 + 2, mask=inside, other=n_seg)
    rows = gl.where(inside & (seg < n_seg), length - mb * BM, 0)
    pad = False
    if HAS_SKIP:
        pad = gl.load(skip_ptr + seg, mask=rows > 0, other=0) != 0
    return mb, c, h, start, rows, pad


@gluon.jit
def _producer(c_desc, s_desc, z_desc, cb_desc, x_desc, c_smem, s_smem, z_smem, cb_smem, x_smem,
              csm_smem, csp_smem, csk_smem, dtk_smem, split_smem,
              cs_ready, cs_empty, z_ready, z_empty, k_ready, k_empty, cs_ptr, dt_ptr, table_ptr, skip_ptr,
              n_items, n_chunks, n_seg, H, heads_per_group, G, q_pad,
              Q: gl.constexpr, N_PIECES: gl.constexpr, CS_STAGES: gl.constexpr, Z_STAGES: gl.constexpr,
              K_STAGES: gl.constexpr, HAS_Z: gl.constexpr, HAS_SKIP: gl.constexpr, DIAG_SPLIT: gl.constexpr,
              USE_PDL: gl.constexpr):
    M_BLOCKS: gl.constexpr = Q // BM
    # a chunk's cs and dt' as [M_BLOCKS, BM] tiles, loaded one item ahead (plain loads, shared stores:
    # the ready barriers count two arrivals, the TMA bytes' expect and these stores' arrive)
    blk: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [1, 1], [1, 0])
    win: gl.constexpr = gl.SliceLayout(0, blk)
    offs_w = gl.arange(0, M_BLOCKS, layout=gl.SliceLayout(1, blk))
    tile = offs_w[:, None] * BM + gl.arange(0, BM, layout=win)[None, :]
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    _wait_for_kernel_before(USE_PDL)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    mb, c, h, start, rows, pad = _item(pid, 0, n_items, n_chunks, n_seg, table_ptr, skip_ptr, M_BLOCKS, HAS_SKIP)
    work = (tile * 0 + rows > 0) & (not pad)
    nxt_cs = gl.load(cs_ptr + (h * n_chunks + c) * Q + tile, mask=work, other=0.0)
    nxt_dt = gl.load(dt_ptr + (h * n_chunks + c) * Q + tile, mask=work, other=0.0)
    i = 0
    k_i = 0
    wave = 0
    for item in range(pid, n_items, nprog):
        cs4 = nxt_cs
        dt4 = nxt_dt
        wave += 1
        mb2, c2, h2, start2, rows2, pad2 = _item(item + nprog, wave, n_items, n_chunks, n_seg, table_ptr, skip_ptr,
                                                 M_BLOCKS, HAS_SKIP)
        work2 = (tile * 0 + rows2 > 0) & (not pad2)
        nxt_cs = gl.load(cs_ptr + (h2 * n_chunks + c2) * Q + tile, mask=work2, other=0.0)
        nxt_dt = gl.load(dt_ptr + (h2 * n_chunks + c2) * Q + tile, mask=work2, other=0.0)
        if (rows > 0) and (not pad):
            g = h // heads_per_group
            tok = start + mb * BM
            s = i % CS_STAGES
            mbarrier.wait(cs_empty.index(s), ((i // CS_STAGES) & 1) ^ 1)
            mbarrier.expect(cs_ready.index(s), 2 * N_PIECES * BM * HALF_N * c_desc.dtype.primitive_bitwidth // 8)
            for piece in gl.static_range(N_PIECES):
                tma.async_copy_global_to_shared(c_desc, [tok, g * (N_PIECES * HALF_N) + piece * HALF_N],
                                                cs_ready.index(s), c_smem.index(N_PIECES * s + piece))
                tma.async_copy_global_to_shared(s_desc, [(c * H + h) * BM, piece * HALF_N], cs_ready.index(s),
                                                s_smem.index(N_PIECES * s + piece))
            # this block's cs, and r = cs[m0 - 1] (0 at m0 = 0) as a vector: the consumer reads it
            # without a cross-warp reduction
            csm_smem.index(s).store(gl.sum(gl.where(offs_w[:, None] == mb, cs4, 0.0), axis=0))
            last = (offs_w[:, None] == mb - 1) & (gl.arange(0, BM, layout=win)[None, :] == BM - 1)
            r = gl.sum(gl.sum(gl.where(last, cs4, 0.0), axis=1), axis=0)
            csp_smem.index(s).store(gl.zeros([BM], gl.float32, layout=win) + r)
            mbarrier.arrive(cs_ready.index(s))
            for kb in range(mb + 1):
                sk = k_i % K_STAGES
                mbarrier.wait(k_empty.index(sk), ((k_i // K_STAGES) & 1) ^ 1)
                mbarrier.expect(k_ready.index(sk), 2 * BM * BM * x_desc.dtype.primitive_bitwidth // 8)
                tma.async_copy_global_to_shared(cb_desc, [(c * G + g) * q_pad + mb * BM, kb * BM],
                                                k_ready.index(sk), cb_smem.index(sk))
                tma.async_copy_global_to_shared(x_desc, [start + kb * BM, h * BM], k_ready.index(sk),
                                                x_smem.index(sk))
                cs_kb = gl.sum(gl.where(offs_w[:, None] == kb, cs4, 0.0), axis=0)
                dt_kb = gl.sum(gl.where(offs_w[:, None] == kb, dt4, 0.0), axis=0)
                if kb < mb:  # a block before m0: its column weights exp(r - cs_s) dt'_s, ready to use
                    csk_smem.index(sk).store(_exp(r - cs_kb) * dt_kb)
                else:  # the diagonal block: cs and dt', or under the split a = cs[m0] (in every element),
                    # the column weights, and the split's flag, so the consumer reduces nothing
                    a, split = _diagonal_split(cs_kb, rows, DIAG_SPLIT)
                    if split:
                        csk_smem.index(sk).store(gl.zeros([BM], gl.float32, layout=win) + a)
                        dtk_smem.index(sk).store(gl.where(gl.arange(0, BM, layout=win) < rows,
                                                          _exp(a - cs_kb) * dt_kb, 0.0))
                    else:
                        csk_smem.index(sk).store(cs_kb)
                        dtk_smem.index(sk).store(dt_kb)
                    if DIAG_SPLIT:
                        split_smem.index(sk).store(gl.full([1], 1, gl.int32, layout=one) * split.to(gl.int32))
                mbarrier.arrive(k_ready.index(sk))
                k_i += 1
            if HAS_Z:
                sz = i % Z_STAGES
                mbarrier.wait(z_empty.index(sz), ((i // Z_STAGES) & 1) ^ 1)
                mbarrier.expect(z_ready.index(sz), BM * BM * z_desc.dtype.primitive_bitwidth // 8)
                tma.async_copy_global_to_shared(z_desc, [tok, h * BM], z_ready.index(sz), z_smem.index(sz))
            i += 1
        mb = mb2
        c = c2
        h = h2
        start = start2
        rows = rows2
        pad = pad2


@gluon.jit
def _diagonal_split(cs, rows, DIAG_SPLIT: gl.constexpr):
    """(a = cs[m0], whether the diagonal block takes the rank-1 split about a) from the block's cs window
    [BM] (any layout) and its valid columns (< rows): DIAG_SPLIT and cs falling less than 60 over the
    valid columns. The producer decides and hands the consumer a and the flag through shared memory
    (two warp reductions fewer per item in the consumer). Without DIAG_SPLIT: (0, False), and no
    reduction is traced."""
    a = 0.0
    split = False
    if DIAG_SPLIT:
        col = gl.arange(0, BM, layout=cs.type.layout)
        a = gl.sum(gl.where(col == 0, cs, 0.0), axis=0)
        split = a - gl.min(gl.where(col < rows, cs, a), axis=0) < 60.0
    return a, split


@gluon.jit
def _next_slot(slot, phase, STAGES: gl.constexpr):
    """The ring position after (slot, phase): a compare and a select, where slot = n % STAGES and
    phase = (n // STAGES) & 1 from a running count n cost a division by STAGES each."""
    wrap = slot == STAGES - 1
    return gl.where(wrap, 0, slot + 1), gl.where(wrap, phase ^ 1, phase)


@gluon.jit
def _scale_columns(t, w):
    """t [BM, BM] (16-bit) * w [BM] (fp32) on its columns, in fp32, rounded once back to t's dtype."""
    return (t.to(gl.float32) * w[None, :]).to(t.dtype)


@gluon.jit
def _row_sums(y, span_of_col, span: gl.constexpr):
    """The sum over one 16-column span of each row of y [BM, BM] (mma layout) -> [BM]."""
    return gl.sum(gl.where(span_of_col[None, :] == span, y, 0.0), axis=1)


@gluon.jit
def _store_rows(y, out_ptr, stride_o, tok, h, offs_m, offs_p, rows_left, nw_ptr, sq_ptr, stride_sq,
                HAS_NORM: gl.constexpr):
    """Masked stores of y [BM, BM] (fp32, mma layout) for the rows offs_m < rows_left, with the deferred
    norm's part first (``kernel_common._defer_norm``: sums of y^2 over each 16 columns, then y * norm_weight)."""
    keep = offs_m < rows_left
    flat = (tok + offs_m).to(gl.int64)
    if HAS_NORM:
        y = _defer_norm_sm90(y, nw_ptr, sq_ptr + flat * stride_sq, h, offs_p, keep)
    ptrs = out_ptr + flat[:, None] * stride_o + (h * BM + offs_p)[None, :]
    gl.store(ptrs, y.to(out_ptr.dtype.element_ty), mask=keep[:, None])


@gluon.jit
def _defer_norm_sm90(y, nw_ptr, sq_rows, h, offs_p, keep):
    """``kernel_common._defer_norm`` for one head's BM = P columns: sums of y^2 over each 16 columns of row r go to
    sq_rows[r] + h * P / 16 + j (rows with keep), and y * norm_weight[h * P + p] comes back."""
    y2 = y * y
    span_of_col = offs_p // NORM_SPAN
    base = sq_rows + h * (BM // NORM_SPAN)
    for j in gl.static_range(BM // NORM_SPAN):
        gl.store(base + j, _row_sums(y2, span_of_col, j), mask=keep)
    w = gl.load(nw_ptr + h * BM + offs_p).to(gl.float32)
    return y * w[None, :]


@gluon.jit
def _consumer(o_desc, c_smem, s_smem, z_smem, cb_smem, x_smem, o_smem, csm_smem, csp_smem, csk_smem, dtk_smem,
              split_smem, cs_ready, cs_empty, z_ready, z_empty, k_ready, k_empty,
              table_ptr, skip_ptr, D_ptr, out_ptr, nw_ptr, sq_ptr,
              n_items, n_chunks, n_seg, stride_o, stride_D_h, stride_D_p, stride_sq,
              Q: gl.constexpr, N_PIECES: gl.constexpr, CS_STAGES: gl.constexpr, Z_STAGES: gl.constexpr,
              K_STAGES: gl.constexpr, HAS_Z: gl.constexpr, HAS_D: gl.constexpr, D_PER_P: gl.constexpr,
              HAS_SKIP: gl.constexpr, HAS_NORM: gl.constexpr, DIAG_SPLIT: gl.constexpr, USE_PDL: gl.constexpr):
    M_BLOCKS: gl.constexpr = Q // BM
    dtype: gl.constexpr = x_smem.dtype
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    a_rows: gl.constexpr = gl.SliceLayout(1, a_op)
    a_cols: gl.constexpr = gl.SliceLayout(0, a_op)
    one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # one value, every thread
    offs_m = gl.arange(0, BM, layout=rows_l)  # row within the block
    offs_p = gl.arange(0, BM, layout=cols_l)
    _wait_for_kernel_before(USE_PDL)
    if USE_PDL:  # the next kernel (the Triton fallback, which exits at once unless flagged) may launch
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    i = 0
    sk = 0  # the (C B^T, x) ring's next slot and its phase, advanced by one per token block
    k_phase = 0
    # each item's table entry is loaded one item ahead (two dependent global loads off the critical path)
    nxt = _item(pid, 0, n_items, n_chunks, n_seg, table_ptr, skip_ptr, M_BLOCKS, HAS_SKIP)
    wave = 0
    for item in range(pid, n_items, nprog):
        mb, c, h, start, rows_left, pad = nxt
        wave += 1
        nxt = _item(item + nprog, wave, n_items, n_chunks, n_seg, table_ptr, skip_ptr, M_BLOCKS, HAS_SKIP)
        m0 = mb * BM
        tok = start + m0
        work = rows_left > 0
        if HAS_SKIP:
            if work and pad:  # a padding segment: zeros, no state read
                _store_rows(gl.zeros([BM, BM], gl.float32, layout=mma), out_ptr, stride_o, tok, h, offs_m, offs_p,
                            rows_left, nw_ptr, sq_ptr, stride_sq, HAS_NORM)
            work = work and not pad
        if work:
            if HAS_D:  # D [H, P]: a vector per head; D [H]: one scalar (not 16 loads of one address)
                if D_PER_P:
                    d = gl.load(D_ptr + h * stride_D_h + offs_p * stride_D_p).to(gl.float32)[None, :]
                else:
                    d = gl.load(D_ptr + h * stride_D_h).to(gl.float32)
            s = i % CS_STAGES
            mbarrier.wait(cs_ready.index(s), (i // CS_STAGES) & 1)
            cs_m = csm_smem.index(s).load(rows_l)
            r_rows = csp_smem.index(s).load(rows_l)  # r = cs[m0 - 1], the same in every element
            # acc_s = C_m S^T (S stored [P, N]: its transposed view is wgmma's B operand)
            acc_s = gl.zeros([BM, BM], gl.float32, layout=mma)
            for piece in gl.static_range(N_PIECES):
                acc_s = warpgroup_mma(c_smem.index(N_PIECES * s + piece),
                                      s_smem.index(N_PIECES * s + piece).permute((1, 0)), acc_s,
                                      use_acc=piece > 0, is_async=True)
            # acc_o = the token blocks before m0, exp(r - cs_s) dt'_s (the producer's column weights) on
            # C B^T's columns, applied in the A-operand layout (no layout conversion through shared memory)
            acc_o = gl.zeros([BM, BM], gl.float32, layout=mma)
            for kb in range(mb):
                mbarrier.wait(k_ready.index(sk), k_phase)
                a = _scale_columns(cb_smem.index(sk).load(a_op), csk_smem.index(sk).load(a_cols))
                acc_o = warpgroup_mma(a, x_smem.index(sk), acc_o, is_async=True)
                acc_o = warpgroup_mma_wait(0, deps=(acc_o,))  # acc_s's matmuls, issued before, are done too
                mbarrier.arrive(k_empty.index(sk))
                sk, k_phase = _next_slot(sk, k_phase, K_STAGES)
            # the diagonal block: columns past the chunk's end are selected away
            mbarrier.wait(k_ready.index(sk), k_phase)
            dt_k = dtk_smem.index(sk).load(a_cols)  # under the split: the producer's column weights
            col_k = gl.arange(0, BM, layout=a_cols)
            cb16 = cb_smem.index(sk).load(a_op)
            split = False
            if DIAG_SPLIT:  # the producer's decision (_diagonal_split)
                split = gl.max(split_smem.index(sk).load(one), axis=0) != 0
            a0 = csk_smem.index(sk).load(rows_l)  # under the split: a = cs[m0] in every element
            if split:  # no causal mask: C B^T is zero above its diagonal (kernel._chunk_cb_tile) and
                # the weights are zero past the chunk's end
                a = _scale_columns(cb16, dt_k)
            else:
                cs_k = csk_smem.index(sk).load(a_cols)
                causal = (gl.arange(0, BM, layout=a_rows)[:, None] >= col_k[None, :]) & (col_k < rows_left)[None, :]
                cb = cb16.to(gl.float32)
                cs_ma = csm_smem.index(s).load(a_rows)
                decay = _exp(gl.where(causal, cs_ma[:, None] - cs_k[None, :], float("-inf")))
                a = gl.where(causal, cb * decay * dt_k[None, :], 0.0).to(dtype)
            if HAS_D:
                x_m = x_smem.index(sk).load(mma).to(gl.float32)
            acc_s, acc_o = warpgroup_mma_wait(0, deps=(acc_s, acc_o))
            mbarrier.arrive(cs_empty.index(s))
            if split:
                acc = acc_s * _exp(a0)[:, None] + acc_o * _exp(a0 - r_rows)[:, None]
            else:
                acc = acc_s * _exp(cs_m)[:, None] + acc_o * _exp(cs_m - r_rows)[:, None]
            acc = warpgroup_mma(a, x_smem.index(sk), acc, is_async=True)
            if HAS_Z:
                sz = i % Z_STAGES
                mbarrier.wait(z_ready.index(sz), (i // Z_STAGES) & 1)
                gate = _silu(z_smem.index(sz).load(mma).to(gl.float32))
            acc = warpgroup_mma_wait(0, deps=(acc,))
            if HAS_Z:
                mbarrier.arrive(z_empty.index(sz))
            mbarrier.arrive(k_empty.index(sk))
            sk, k_phase = _next_slot(sk, k_phase, K_STAGES)
            if split:
                acc = acc * _exp(cs_m - a0)[:, None]
            if HAS_D:
                acc = acc + x_m * d
            if HAS_Z:
                acc = acc * gate
            if rows_left >= BM:
                if HAS_NORM:
                    acc = _defer_norm_sm90(acc, nw_ptr, sq_ptr + (tok + offs_m).to(gl.int64) * stride_sq, h,
                                           offs_p, offs_m < BM)
                tma.store_wait(0)  # the previous item's store has left o_smem
                o_smem.store(acc.to(dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(o_desc, [tok, h * BM], o_smem)
            else:  # the chunk's last, partial block: rows past its end belong to the next chunk
                _store_rows(acc, out_ptr, stride_o, tok, h, offs_m, offs_p, rows_left, nw_ptr, sq_ptr, stride_sq,
                            HAS_NORM)
            i += 1
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["n_items", "n_chunks", "n_seg"])
def chunk_output_sm90_kernel(
    c_desc, s_desc, z_desc, cb_desc, x_desc, o_desc,
    table_ptr, skip_ptr, cs_ptr, dt_ptr, D_ptr, out_ptr, nw_ptr, sq_ptr,
    n_items, n_chunks, n_seg, H, heads_per_group, G, q_pad, stride_o, stride_D_h, stride_D_p, stride_sq,
    Q: gl.constexpr, N_PIECES: gl.constexpr, CS_STAGES: gl.constexpr, Z_STAGES: gl.constexpr,
    K_STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr, HAS_Z: gl.constexpr, HAS_D: gl.constexpr,
    D_PER_P: gl.constexpr, HAS_SKIP: gl.constexpr, HAS_NORM: gl.constexpr, DIAG_SPLIT: gl.constexpr,
    USE_PDL: gl.constexpr = False,
):
    """Descriptors (2-d views, BM x 64 boxes): C [tokens, G * N], S (states_in) [chunks * H * P, N],
    z / x / out [tokens, H * P], C B^T [chunks * G * q_pad, q_pad]; tokens are flat (row * row_len + t).
    table [chunks, 4] int32 (first flat token, length, segment); skip [n_seg] int8 or None;
    cs / dt [H, chunks, Q] fp32; D [H] or [H, P] through its strides; norm_weight [H * P];
    norm_sumsq [tokens, H * P / 16] fp32 with row stride stride_sq."""
    dtype: gl.constexpr = x_desc.dtype
    c_smem = gl.allocate_shared_memory(dtype, [N_PIECES * CS_STAGES, BM, HALF_N], c_desc.layout)
    s_smem = gl.allocate_shared_memory(dtype, [N_PIECES * CS_STAGES, BM, HALF_N], s_desc.layout)
    cb_smem = gl.allocate_shared_memory(dtype, [K_STAGES, BM, BM], cb_desc.layout)
    x_smem = gl.allocate_shared_memory(dtype, [K_STAGES, BM, BM], x_desc.layout)
    o_smem = gl.allocate_shared_memory(dtype, [BM, BM], o_desc.layout)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    csm_smem = gl.allocate_shared_memory(gl.float32, [CS_STAGES, BM], flat)
    csp_smem = gl.allocate_shared_memory(gl.float32, [CS_STAGES, BM], flat)
    csk_smem = gl.allocate_shared_memory(gl.float32, [K_STAGES, BM], flat)
    dtk_smem = gl.allocate_shared_memory(gl.float32, [K_STAGES, BM], flat)
    split_smem = gl.allocate_shared_memory(gl.int32, [K_STAGES, 1], flat)  # the diagonal's split flag
    cs_ready = gl.allocate_shared_memory(gl.int64, [CS_STAGES, 1], mbarrier.MBarrierLayout())
    cs_empty = gl.allocate_shared_memory(gl.int64, [CS_STAGES, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    if HAS_Z:
        z_smem = gl.allocate_shared_memory(dtype, [Z_STAGES, BM, BM], z_desc.layout)
        z_ready = gl.allocate_shared_memory(gl.int64, [Z_STAGES, 1], mbarrier.MBarrierLayout())
        z_empty = gl.allocate_shared_memory(gl.int64, [Z_STAGES, 1], mbarrier.MBarrierLayout())
    else:  # placeholders the partitions never touch
        z_smem = x_smem
        z_ready = k_ready
        z_empty = k_empty
    for j in gl.static_range(CS_STAGES):
        mbarrier.init(cs_ready.index(j), count=2)
        mbarrier.init(cs_empty.index(j), count=1)
    if HAS_Z:
        for j in gl.static_range(Z_STAGES):
            mbarrier.init(z_ready.index(j), count=1)
            mbarrier.init(z_empty.index(j), count=1)
    for j in gl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(j), count=2)
        mbarrier.init(k_empty.index(j), count=1)
    fence_async_shared()
    gl.warp_specialize(
        [
            (_consumer, (o_desc, c_smem, s_smem, z_smem, cb_smem, x_smem, o_smem, csm_smem, csp_smem, csk_smem,
                         dtk_smem, split_smem, cs_ready, cs_empty, z_ready, z_empty, k_ready, k_empty,
                         table_ptr, skip_ptr, D_ptr, out_ptr, nw_ptr, sq_ptr,
                         n_items, n_chunks, n_seg, stride_o, stride_D_h, stride_D_p, stride_sq,
                         Q, N_PIECES, CS_STAGES, Z_STAGES, K_STAGES, HAS_Z, HAS_D, D_PER_P, HAS_SKIP, HAS_NORM,
                         DIAG_SPLIT, USE_PDL)),
            (_producer, (c_desc, s_desc, z_desc, cb_desc, x_desc, c_smem, s_smem, z_smem, cb_smem, x_smem,
                         csm_smem, csp_smem, csk_smem, dtk_smem, split_smem, cs_ready, cs_empty, z_ready, z_empty,
                         k_ready, k_empty, cs_ptr, dt_ptr, table_ptr, skip_ptr, n_items, n_chunks, n_seg, H,
                         heads_per_group, G, q_pad, Q, N_PIECES, CS_STAGES, Z_STAGES, K_STAGES, HAS_Z, HAS_SKIP,
                         DIAG_SPLIT, USE_PDL)),
        ],
        [1],
        [PRODUCER_REGS],
    )
