"""Experiment (issue 19 item 5; the production kernel grown from it is ops/ssd_scan/hopper_kernel.py):
the SSD scan's chunk-output stage as a Hopper kernel in Gluon,
with TMA loads run ahead by a producer warp, against our Triton `_chunk_scan_kernel` on the same
inputs (development aid; dense inputs, one group of B/C, L a multiple of the chunk).

    python scripts/dev_chunk_output_gluon.py [--lengths 2048,8192] [--configs 2,4,2,1 ...]
    python scripts/dev_chunk_output_gluon.py --compile-only     # sm_90 compile, no GPU needed

Design. One work item = (head h, chunk c, block of 64 output rows m0): y = exp(cs_m) C_m S_c
+ sum_k (CB[m, k] exp(cs_m - cs_k) dt_k) x_k + D x_m, times silu(z_m). A persistent program
walks items h-major (the 4 row blocks of one (chunk, head) side by side). Partitions:
- producer (1 warp): TMA loads into three rings, each slot guarded by a ready and an empty
  mbarrier: (C_m, S_c) per item, z_m per item, and one (CB tile, x tile) per token block k <= m0;
- consumer (4 warps, one warpgroup): the matmuls on wgmma, A operands (CB with its decay weights)
  from registers, B operands (x, S^T) from shared memory; the output goes out through TMA (or
  straight from registers, STORE_TMA=0, which frees a shared tile for a third program per SM).
MODE=1 keeps the pipeline and drops the math: the stage's data path alone.

Result (H200, 2026-11-27, one job; docs/experiments.md): shipped kernel 61.5 / 223.8 us at L=2048 / 8192;
this kernel (2 programs per SM, cap 128 registers, rings 1,1,3, output through TMA) 44.2 / 168.2 us, and
43.2 / 165.2 us with the diagonal's decay split (DIAG_SPLIT): 1.36-1.42x. Both match an fp32 reference
of the stage as closely as the shipped kernel does (max |diff| / max |ref| 3.7-4.5e-3, the bf16 output's
rounding). The data path alone (MODE=1, an earlier version) took 112 us at 8192. Storing the output
straight from registers (STORE_TMA=0) was slower (190 us), and with DIAG_SPLIT its output changed from
run to run (a race, not understood: perhaps a reduction's scratch aliasing a ring buffer the producer
partition still fills).
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

BM = gl.constexpr(64)  # output rows per item = tokens per k tile
HALF_N = gl.constexpr(64)  # C and S go in two 64-column halves (128-byte rows: one TMA box, 128B swizzle)


@gluon.jit
def _exp(x):
    """exp in fp32 through the approximate PTX exp2 (2 instructions; what the shipped kernels use)."""
    return gl.inline_asm_elementwise("{ .reg .f32 e; mul.f32 e, $1, 0f3FB8AA3B; ex2.approx.ftz.f32 $0, e; }",
                                     "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _silu(x):
    return gl.inline_asm_elementwise("{ .reg .f32 e, d, r; mul.f32 e, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 e, e; "
                                     "add.f32 d, e, 0f3F800000; rcp.approx.ftz.f32 r, d; mul.f32 $0, $1, r; }",
                                     "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _coords(item, n_chunks, M_BLOCKS: gl.constexpr):
    """(row block, chunk, head) of an item. The division by the runtime chunk count goes through an
    fp32 reciprocal (exact for item < 2^22: floor((q + 0.5) / n) is never within rounding of an
    integer), not the ~50-instruction integer division."""
    mb = item % M_BLOCKS
    q = item // M_BLOCKS
    h = ((q.to(gl.float32) + 0.5) * (1.0 / n_chunks.to(gl.float32))).to(gl.int32)
    c = q - h * n_chunks
    return mb, c, h


@gluon.jit
def _producer(c_desc, s_desc, z_desc, cb_desc, x_desc, c_smem, s_smem, z_smem, cb_smem, x_smem,
              csm_smem, csp_smem, csk_smem, dtk_smem,
              cs_ready, cs_empty, z_ready, z_empty, k_ready, k_empty, cs_ptr, dt_ptr,
              n_items, n_chunks, H, P, heads_per_group, G, q_pad,
              Q: gl.constexpr, CS_STAGES: gl.constexpr, Z_STAGES: gl.constexpr, K_STAGES: gl.constexpr,
              Z_DIRECT: gl.constexpr):
    # the decay vectors (cs, dt: [H, chunks, Q] fp32) go through plain loads and shared stores; the
    # ready barriers count 2 arrivals: the TMA bytes' expect, then these stores' arrive
    M_BLOCKS: gl.constexpr = Q // BM
    # a chunk's cs and dt as [M_BLOCKS, BM] tiles; the next item's are loaded one item ahead
    blk: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [1, 1], [1, 0])
    win: gl.constexpr = gl.SliceLayout(0, blk)
    offs_w = gl.arange(0, M_BLOCKS, layout=gl.SliceLayout(1, blk))
    tile = offs_w[:, None] * BM + gl.arange(0, BM, layout=win)[None, :]
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    mb, c, h = _coords(pid, n_chunks, M_BLOCKS)
    nxt_cs = gl.load(cs_ptr + (h * n_chunks + c) * Q + tile, mask=tile * 0 + pid < n_items, other=0.0)
    nxt_dt = gl.load(dt_ptr + (h * n_chunks + c) * Q + tile, mask=tile * 0 + pid < n_items, other=0.0)
    i = 0
    k_i = 0
    for item in range(pid, n_items, nprog):
        mb, c, h = _coords(item, n_chunks, M_BLOCKS)
        g = h // heads_per_group
        tok = c * Q + mb * BM
        cs4 = nxt_cs
        dt4 = nxt_dt
        mb2, c2, h2 = _coords(item + nprog, n_chunks, M_BLOCKS)
        more = tile * 0 + item + nprog < n_items
        nxt_cs = gl.load(cs_ptr + (h2 * n_chunks + c2) * Q + tile, mask=more, other=0.0)
        nxt_dt = gl.load(dt_ptr + (h2 * n_chunks + c2) * Q + tile, mask=more, other=0.0)
        s = i % CS_STAGES
        mbarrier.wait(cs_empty.index(s), ((i // CS_STAGES) & 1) ^ 1)
        mbarrier.expect(cs_ready.index(s), 4 * BM * HALF_N * 2)
        for half in gl.static_range(2):
            tma.async_copy_global_to_shared(c_desc, [tok, g * (2 * HALF_N) + half * HALF_N], cs_ready.index(s),
                                            c_smem.index(2 * s + half))
            tma.async_copy_global_to_shared(s_desc, [(c * H + h) * P, half * HALF_N], cs_ready.index(s),
                                            s_smem.index(2 * s + half))
        # this block's cs, and the window before it (its minimum is r = cs[m0 - 1]: cs falls along the chunk)
        csm_smem.index(s).store(gl.sum(gl.where(offs_w[:, None] == mb, cs4, 0.0), axis=0))
        # r = cs[m0 - 1] (0 at m0 = 0) as a vector: the consumer reads it without a cross-warp reduction
        last = (offs_w[:, None] == mb - 1) & (gl.arange(0, BM, layout=win)[None, :] == BM - 1)
        r = gl.sum(gl.sum(gl.where(last, cs4, 0.0), axis=1), axis=0)
        csp_smem.index(s).store(gl.zeros([BM], gl.float32, layout=win) + r)
        mbarrier.arrive(cs_ready.index(s))
        for kb in range(mb + 1):
            sk = k_i % K_STAGES
            mbarrier.wait(k_empty.index(sk), ((k_i // K_STAGES) & 1) ^ 1)
            mbarrier.expect(k_ready.index(sk), 2 * BM * BM * 2)
            tma.async_copy_global_to_shared(cb_desc, [(c * G + g) * q_pad + mb * BM, kb * BM], k_ready.index(sk),
                                            cb_smem.index(sk))
            tma.async_copy_global_to_shared(x_desc, [c * Q + kb * BM, h * P], k_ready.index(sk), x_smem.index(sk))
            csk_smem.index(sk).store(gl.sum(gl.where(offs_w[:, None] == kb, cs4, 0.0), axis=0))
            dtk_smem.index(sk).store(gl.sum(gl.where(offs_w[:, None] == kb, dt4, 0.0), axis=0))
            mbarrier.arrive(k_ready.index(sk))
            k_i += 1
        if not Z_DIRECT:
            sz = i % Z_STAGES
            mbarrier.wait(z_empty.index(sz), ((i // Z_STAGES) & 1) ^ 1)
            mbarrier.expect(z_ready.index(sz), BM * BM * 2)
            tma.async_copy_global_to_shared(z_desc, [tok, h * P], z_ready.index(sz), z_smem.index(sz))
        i += 1


@gluon.jit
def _consumer(o_desc, c_smem, s_smem, z_smem, cb_smem, x_smem, o_smem, csm_smem, csp_smem, csk_smem, dtk_smem,
              cs_ready, cs_empty, z_ready, z_empty, k_ready, k_empty,
              cs_ptr, dt_ptr, D_ptr, out_ptr, stride_o, z_ptr, n_items, n_chunks, P,
              Q: gl.constexpr, CS_STAGES: gl.constexpr, Z_STAGES: gl.constexpr, K_STAGES: gl.constexpr,
              MODE: gl.constexpr, STORE_TMA: gl.constexpr, Z_DIRECT: gl.constexpr, DIAG_SPLIT: gl.constexpr):
    M_BLOCKS: gl.constexpr = Q // BM
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows: gl.constexpr = gl.SliceLayout(1, mma)
    cols: gl.constexpr = gl.SliceLayout(0, mma)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    i = 0
    k_i = 0
    for item in range(pid, n_items, nprog):
        mb, c, h = _coords(item, n_chunks, M_BLOCKS)
        m0 = mb * BM
        offs_m = m0 + gl.arange(0, BM, layout=rows)
        offs_kc = gl.arange(0, BM, layout=cols)
        if MODE == 1:  # data movement only: every slot waited for and released, o_smem stored as is
            s = i % CS_STAGES
            mbarrier.wait(cs_ready.index(s), (i // CS_STAGES) & 1)
            mbarrier.arrive(cs_empty.index(s))
            for kb in range(mb + 1):
                sk = k_i % K_STAGES
                mbarrier.wait(k_ready.index(sk), (k_i // K_STAGES) & 1)
                mbarrier.arrive(k_empty.index(sk))
                k_i += 1
            sz = i % Z_STAGES
            mbarrier.wait(z_ready.index(sz), (i // Z_STAGES) & 1)
            mbarrier.arrive(z_empty.index(sz))
            tma.store_wait(0)
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [c * Q + m0, h * P], o_smem)
        elif MODE == 3:  # the matmuls and their operand loads only, no elementwise math
            s = i % CS_STAGES
            mbarrier.wait(cs_ready.index(s), (i // CS_STAGES) & 1)
            acc = gl.zeros([BM, BM], gl.float32, layout=mma)
            acc = warpgroup_mma(c_smem.index(2 * s), s_smem.index(2 * s).permute((1, 0)), acc, use_acc=False,
                                is_async=True)
            acc = warpgroup_mma(c_smem.index(2 * s + 1), s_smem.index(2 * s + 1).permute((1, 0)), acc,
                                is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(cs_empty.index(s))
            for kb in range(mb + 1):
                sk = k_i % K_STAGES
                mbarrier.wait(k_ready.index(sk), (k_i // K_STAGES) & 1)
                acc = warpgroup_mma(cb_smem.index(sk).load(a_op), x_smem.index(sk), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(k_empty.index(sk))
                k_i += 1
            sz = i % Z_STAGES
            mbarrier.wait(z_ready.index(sz), (i // Z_STAGES) & 1)
            mbarrier.arrive(z_empty.index(sz))
            o_rows = (c * Q + offs_m).to(gl.int64) * stride_o
            gl.store(out_ptr + o_rows[:, None] + (h * BM + offs_kc)[None, :], acc.to(gl.bfloat16))
        else:
            d = gl.load(D_ptr + h)
            if Z_DIRECT:  # z from global memory, issued now, used at the end (same row stride as out)
                z_rows = (c * Q + offs_m).to(gl.int64) * stride_o
                zv = gl.load(z_ptr + z_rows[:, None] + (h * BM + offs_kc)[None, :]).to(gl.float32)
            s = i % CS_STAGES
            mbarrier.wait(cs_ready.index(s), (i // CS_STAGES) & 1)
            cs_m = csm_smem.index(s).load(rows)
            r_rows = csp_smem.index(s).load(rows)  # r = cs[m0 - 1], the same in every element
            # three independent parts, their matmuls in flight while the next is prepared:
            # acc_s = C_m S^T (the entering state; S stored [P, N], so its transposed view is wgmma's B),
            # acc_o = the token blocks before m0 with exp(r - cs_s) dt_s on CB's columns,
            # then y = exp(cs_m) acc_s + exp(cs_m - r) acc_o + the diagonal block (exact decay per element)
            acc_s = gl.zeros([BM, BM], gl.float32, layout=mma)
            acc_s = warpgroup_mma(c_smem.index(2 * s), s_smem.index(2 * s).permute((1, 0)), acc_s, use_acc=False,
                                  is_async=True)
            acc_s = warpgroup_mma(c_smem.index(2 * s + 1), s_smem.index(2 * s + 1).permute((1, 0)), acc_s,
                                  is_async=True)
            acc_o = gl.zeros([BM, BM], gl.float32, layout=mma)
            # CB tiles go from shared memory straight into wgmma's A-operand layout; their weights
            # are computed in that layout (no layout conversion through shared memory)
            a_rows: gl.constexpr = gl.SliceLayout(1, a_op)
            a_cols: gl.constexpr = gl.SliceLayout(0, a_op)
            r_cols = csp_smem.index(s).load(a_cols)
            for kb in range(mb):
                sk = k_i % K_STAGES
                mbarrier.wait(k_ready.index(sk), (k_i // K_STAGES) & 1)
                w = _exp(r_cols - csk_smem.index(sk).load(a_cols)) * dtk_smem.index(sk).load(a_cols)
                a = (cb_smem.index(sk).load(a_op).to(gl.float32) * w[None, :]).to(gl.bfloat16)
                acc_o = warpgroup_mma(a, x_smem.index(sk), acc_o, is_async=True)
                acc_o = warpgroup_mma_wait(0, deps=(acc_o,))  # acc_s's matmul, issued before, is done too
                mbarrier.arrive(k_empty.index(sk))
                k_i += 1
            sk = k_i % K_STAGES
            mbarrier.wait(k_ready.index(sk), (k_i // K_STAGES) & 1)
            cs_k = csk_smem.index(sk).load(a_cols)
            dt_k = dtk_smem.index(sk).load(a_cols)
            causal = gl.arange(0, BM, layout=a_rows)[:, None] >= gl.arange(0, BM, layout=a_cols)[None, :]
            cb = cb_smem.index(sk).load(a_op).to(gl.float32)
            # DIAG_SPLIT: when cs falls by less than 60 over the block, the diagonal's decay splits too,
            # exp(cs_t - cs_s) = exp(cs_t - a) exp(a - cs_s) with a = cs[m0] (both factors finite): one
            # exp per column instead of one per element, and the row scaling moves after the matmul
            a0 = gl.max(cs_k, axis=0)  # cs[m0]: cs falls along the chunk (one warp's columns)
            split = DIAG_SPLIT and (a0 - gl.min(cs_k, axis=0) < 60.0)
            if split:
                a = gl.where(causal, cb * (_exp(a0 - cs_k) * dt_k)[None, :], 0.0).to(gl.bfloat16)
            else:
                cs_ma = csm_smem.index(s).load(a_rows)
                decay = _exp(gl.where(causal, cs_ma[:, None] - cs_k[None, :], float("-inf")))
                a = gl.where(causal, cb * decay * dt_k[None, :], 0.0).to(gl.bfloat16)
            acc_s, acc_o = warpgroup_mma_wait(0, deps=(acc_s, acc_o))
            mbarrier.arrive(cs_empty.index(s))
            if split:
                acc = acc_s * _exp(gl.zeros([BM], gl.float32, layout=rows) + a0)[:, None] \
                    + acc_o * _exp(a0 - r_rows)[:, None]
            else:
                acc = acc_s * _exp(cs_m)[:, None] + acc_o * _exp(cs_m - r_rows)[:, None]
            acc = warpgroup_mma(a, x_smem.index(sk), acc, is_async=True)
            x_m = x_smem.index(sk).load(mma).to(gl.float32)  # the D term's x: the diagonal block's own tile
            if not Z_DIRECT:
                sz = i % Z_STAGES
                mbarrier.wait(z_ready.index(sz), (i // Z_STAGES) & 1)
                zv = z_smem.index(sz).load(mma).to(gl.float32)
            gate = (x_m * d, _silu(zv))
            acc = warpgroup_mma_wait(0, deps=(acc,))
            if not Z_DIRECT:
                mbarrier.arrive(z_empty.index(sz))  # both releases after one wait (one partition barrier)
            mbarrier.arrive(k_empty.index(sk))
            k_i += 1
            if split:
                acc = acc * _exp(cs_m - a0)[:, None]
            acc = (acc + gate[0]) * gate[1]
            if STORE_TMA:
                tma.store_wait(0)  # the previous item's store has left o_smem
                o_smem.store(acc.to(gl.bfloat16))
                fence_async_shared()
                tma.async_copy_shared_to_global(o_desc, [c * Q + m0, h * P], o_smem)
            else:  # straight from registers (no shared tile: one program more per SM)
                o_rows = (c * Q + offs_m).to(gl.int64) * stride_o
                gl.store(out_ptr + o_rows[:, None] + (h * BM + offs_kc)[None, :], acc.to(gl.bfloat16))
        i += 1
    tma.store_wait(0)


@gluon.jit
def chunk_output_kernel(c_desc, s_desc, z_desc, cb_desc, x_desc, o_desc, cs_ptr, dt_ptr, D_ptr, out_ptr, stride_o,
                        z_ptr, n_items, n_chunks, H, P, heads_per_group, G, q_pad,
                        Q: gl.constexpr, CS_STAGES: gl.constexpr, Z_STAGES: gl.constexpr,
                        K_STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr, MODE: gl.constexpr = 0,
                        STORE_TMA: gl.constexpr = True, Z_DIRECT: gl.constexpr = False,
                        DIAG_SPLIT: gl.constexpr = False):
    c_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * CS_STAGES, BM, HALF_N], c_desc.layout)
    s_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * CS_STAGES, BM, HALF_N], s_desc.layout)
    cb_smem = gl.allocate_shared_memory(gl.bfloat16, [K_STAGES, BM, BM], cb_desc.layout)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [K_STAGES, BM, BM], x_desc.layout)
    if STORE_TMA:
        o_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, BM], o_desc.layout)
    else:  # no output tile: a placeholder the consumer never touches
        o_smem = x_smem
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    csm_smem = gl.allocate_shared_memory(gl.float32, [CS_STAGES, BM], flat)
    csp_smem = gl.allocate_shared_memory(gl.float32, [CS_STAGES, BM], flat)
    csk_smem = gl.allocate_shared_memory(gl.float32, [K_STAGES, BM], flat)
    dtk_smem = gl.allocate_shared_memory(gl.float32, [K_STAGES, BM], flat)
    cs_ready = gl.allocate_shared_memory(gl.int64, [CS_STAGES, 1], mbarrier.MBarrierLayout())
    cs_empty = gl.allocate_shared_memory(gl.int64, [CS_STAGES, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    if Z_DIRECT:  # placeholders the partitions never touch
        z_smem = x_smem
        z_ready = k_ready
        z_empty = k_empty
    else:
        z_smem = gl.allocate_shared_memory(gl.bfloat16, [Z_STAGES, BM, BM], z_desc.layout)
        z_ready = gl.allocate_shared_memory(gl.int64, [Z_STAGES, 1], mbarrier.MBarrierLayout())
        z_empty = gl.allocate_shared_memory(gl.int64, [Z_STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(CS_STAGES):
        mbarrier.init(cs_ready.index(j), count=2)
        mbarrier.init(cs_empty.index(j), count=1)
    if not Z_DIRECT:
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
                         dtk_smem, cs_ready, cs_empty, z_ready, z_empty, k_ready, k_empty,
                         cs_ptr, dt_ptr, D_ptr, out_ptr, stride_o, z_ptr, n_items, n_chunks, P, Q, CS_STAGES,
                         Z_STAGES, K_STAGES, MODE, STORE_TMA, Z_DIRECT, DIAG_SPLIT)),
            (_producer, (c_desc, s_desc, z_desc, cb_desc, x_desc, c_smem, s_smem, z_smem, cb_smem, x_smem,
                         csm_smem, csp_smem, csk_smem, dtk_smem, cs_ready, cs_empty, z_ready, z_empty, k_ready,
                         k_empty, cs_ptr, dt_ptr, n_items, n_chunks, H, P, heads_per_group, G, q_pad, Q, CS_STAGES,
                         Z_STAGES, K_STAGES,
                         Z_DIRECT)),
        ],
        [1],
        [PRODUCER_REGS],
    )


def _desc(t2d: torch.Tensor, block: list[int]):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    block = [int(getattr(v, "value", v)) for v in block]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return TensorDescriptor(t2d, list(t2d.shape), list(t2d.stride()), block, layout)


def chunk_output(x, z, out, cb, C, D, states_in, dt_s, cs_s, *, chunk_size, stages=(2, 2, 4), ctas_per_sm=1,
                 producer_regs=80, maxnreg=0, mode=0, store_tma=True, diag_split=False):
    """x, z, out [1, T, H, P] bf16 (contiguous); cb [n_chunks, G, q_pad, q_pad] bf16; C [1, T, G, N] bf16;
    D [H] fp32; states_in [n_chunks, H, P, N] bf16; dt_s, cs_s [H, n_chunks, Q] fp32."""
    _, T, H, P = x.shape
    G, N = C.shape[2], C.shape[3]
    n_chunks, q_pad = cb.shape[0], cb.shape[-1]
    bm, half_n = int(BM.value), int(HALF_N.value)
    assert P == bm and N == 2 * half_n and T % chunk_size == 0 and chunk_size % bm == 0
    descs = (
        _desc(C.view(T, G * N), [bm, half_n]),
        _desc(states_in.view(n_chunks * H * P, N), [bm, half_n]),
        _desc(z.view(T, H * P), [bm, bm]),
        _desc(cb.view(n_chunks * G * q_pad, q_pad), [bm, bm]),
        _desc(x.view(T, H * P), [bm, bm]),
        _desc(out.view(T, H * P), [bm, bm]),
    )
    n_items = H * n_chunks * (chunk_size // bm)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = (min(n_items, sms * ctas_per_sm),)
    cs_stages, z_stages, k_stages = stages
    z_direct = z_stages == 0  # z read by the consumer from global memory, no z ring
    assert not z_direct or z.stride() == out.stride()
    return chunk_output_kernel[grid](*descs, cs_s, dt_s, D, out, out.stride(1), z, n_items, n_chunks, H, P, H // G, G,
                                     q_pad,
                              Q=chunk_size, CS_STAGES=cs_stages, Z_STAGES=max(z_stages, 1), K_STAGES=k_stages,
                              PRODUCER_REGS=producer_regs, MODE=mode, STORE_TMA=store_tma, Z_DIRECT=z_direct,
                                     DIAG_SPLIT=diag_split,
                                     num_warps=4, **({"maxnreg": maxnreg} if maxnreg else {}))


def compile_only() -> None:
    """Compile for sm_90 without a GPU (Triton's compiler and ptxas): shared memory and registers."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    b = int(BM.value)
    layout = gl.NVMMASharedLayout.get_default_for([b, b], gl.bfloat16)
    desc_ty = f"tensordesc<bf16[{b}, {b}],{layout}>"
    sig = {n: desc_ty for n in ("c_desc", "s_desc", "z_desc", "cb_desc", "x_desc", "o_desc")}
    sig.update(cs_ptr="*fp32", dt_ptr="*fp32", D_ptr="*fp32", out_ptr="*bf16", stride_o="i32", z_ptr="*bf16",
               n_items="i32", n_chunks="i32", H="i32", P="i32",
               heads_per_group="i32", G="i32", q_pad="i32")
    for stages in ((2, 2, 4), (1, 1, 3), (1, 1, 2)):
        consts = dict(Q=256, CS_STAGES=stages[0], Z_STAGES=stages[1], K_STAGES=stages[2], PRODUCER_REGS=48,
                      MODE=0, STORE_TMA=stages[2] == 4, Z_DIRECT=stages[2] == 2, DIAG_SPLIT=stages[2] == 3)
        src = GluonASTSource(chunk_output_kernel, {**sig, **{k: "constexpr" for k in consts}}, consts)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        print(f"stages {stages} (store through TMA {consts['STORE_TMA']}, z direct {consts['Z_DIRECT']}): "
              f"shared {k.metadata.shared} B")


def _capture_chunk_scan(L: int, H=80, P=64, G=1, N=128):
    """Run our scan once and keep the chunk-scan kernel's launch (its intermediates included)."""
    from fastmamba.ops.ssd_scan import launch as launch_mod
    from fastmamba.ops.ssd_scan import mamba_chunk_scan_combined
    from fastmamba.ops.ssd_scan.kernel import _chunk_scan_kernel

    captured = {}
    real_lean = launch_mod.lean

    def spy(kernel):
        launcher = real_lean(kernel)
        if kernel is not _chunk_scan_kernel:
            return launcher

        class _Grid:
            def __getitem__(self, grid):
                def call(*args, **kwargs):
                    captured.update(grid=grid, args=args, kwargs=kwargs, launcher=launcher)
                    return launcher[grid](*args, **kwargs)
                return call
        return _Grid()

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, generator=g)
    x = r(1, L, H, P).bfloat16()
    dt = r(1, L, H) * 0.5
    A = -(torch.rand(H, device=dev) + 0.5)
    B = (r(1, L, G, N) * 0.5).bfloat16()
    C = (r(1, L, G, N) * 0.5).bfloat16()
    D = r(H)
    z = r(1, L, H, P).bfloat16()
    bias = r(H) * 0.3
    def scan():
        return mamba_chunk_scan_combined(x, dt, A, B, C, 256, D=D, z=z, dt_bias=bias, dt_softplus=True)

    launch_mod.lean = spy
    try:
        scan()
    finally:
        launch_mod.lean = real_lean
    return captured, scan


def _reference(x, z, cb, C, D, states_in, dt_s, cs_s, Q: int) -> torch.Tensor:
    """The stage in fp32 from the same intermediates (dense, one group): [T, H, P]."""
    _, T, H, P = x.shape
    nc = T // Q
    xs = x[0].float().view(nc, Q, H, P).permute(0, 2, 1, 3)  # [nc, H, Q, P]
    zs = z[0].float().view(nc, Q, H, P).permute(0, 2, 1, 3)
    Cc = C[0, :, 0].float().view(nc, 1, Q, -1)  # [nc, 1, Q, N]
    S = states_in[:nc].float()  # [nc, H, P, N]
    cs = cs_s[:, :nc].permute(1, 0, 2)  # [nc, H, Q]
    dt = dt_s[:, :nc].permute(1, 0, 2)
    CB = cb[:nc, 0, :Q, :Q].float().unsqueeze(1)  # [nc, 1, Q, Q]
    causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp((cs[..., :, None] - cs[..., None, :]).masked_fill(~causal, float("-inf")))
    # CB's tiles above the diagonal were never written (the scan's buffer is torch.empty): select them away
    weights = torch.where(causal, CB * decay * dt[..., None, :], 0.0)
    y = torch.exp(cs)[..., None] * (Cc @ S.transpose(-1, -2)) + weights @ xs
    y = (y + D.float()[None, :, None, None] * xs) * torch.nn.functional.silu(zs)
    return y.permute(0, 2, 1, 3).reshape(T, H, P)


def _graph_time(fn, reps=20, runs=15) -> float:
    """Median µs per call of ``fn`` replayed in a CUDA graph of ``reps`` calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    return statistics.median(times)


def _lengths(text: str) -> list[int]:
    """--lengths: comma-separated sequence lengths, each a positive multiple of the 256-token chunk."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or any(v < 256 or v % 256 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive multiples of 256 (the chunk), got {text!r}")
    return values


def _config(text: str) -> str:
    """--configs entry: 4 to 9 comma-separated non-negative ints (ring stages >= 1 except Z_STAGES)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not 4 <= len(values) <= 9 or min(values) < 0 or values[0] < 1 or values[2] < 1 or values[3] < 1:
        raise argparse.ArgumentTypeError(
            f"expected CS_STAGES,Z_STAGES,K_STAGES,CTAS_PER_SM[,...] with CS_STAGES, K_STAGES, CTAS_PER_SM >= 1 "
            f"and nothing negative, got {text!r}")
    return text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=_lengths, default=[2048, 8192])
    ap.add_argument("--configs", nargs="*", type=_config,
                    default=["1,1,3,2,128,0,56,1,1", "1,1,3,2,128,0,56,1,0", "1,1,3,2,128,0,56,0,0"],
                    help="CS_STAGES,Z_STAGES,K_STAGES,CTAS_PER_SM"
                         "[,MAXNREG[,MODE[,PRODUCER_REGS[,STORE_TMA[,DIAG_SPLIT]]]]] "
                         "(MODE 1: no math; 3: only the matmuls; Z_STAGES 0: z from global memory)")
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    if args.compile_only:
        compile_only()
        return
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        ap.error("timing needs a Hopper GPU (sm_90: TMA and wgmma); --compile-only runs without one")
    copy_src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    copy_us = _graph_time(lambda: copy_dst.copy_(copy_src), reps=5, runs=7)
    copy_bw = 2 * copy_src.numel() / copy_us / 1e3  # GB/s
    print(f"device copy: {copy_bw:.0f} GB/s ({torch.cuda.get_device_name()})")
    print("| L | kernel | config | µs | bytes | % of copy | max rel diff vs ours |")
    print("|---|---|---|---:|---:|---:|---:|")
    for L in args.lengths:
        cap, scan = _capture_chunk_scan(L)
        whole = _graph_time(scan)
        a = cap["args"]
        x, z, out, cb, C, D, states_in, dt_s, cs_s = a[0], a[1], a[2], a[3], a[4], a[5], a[8], a[9], a[10]
        ours = lambda: cap["launcher"][cap["grid"]](*a, **cap["kwargs"])
        ours()
        torch.cuda.synchronize()
        ref = out.clone()
        exact = _reference(x, z, cb, C, D, states_in, dt_s, cs_s, 256)
        scale = exact.abs().max()
        print(f"<!-- L={L}: shipped kernel vs the fp32 reference: max |diff| / max |ref| "
              f"{((ref[0].float() - exact).abs().max() / scale).item():.2e} -->")
        G = C.shape[2]
        n_chunks = cb.shape[0]
        nbytes = (3 * x.numel() + states_in.numel() + C.numel()) * 2 + n_chunks * G * 256 * 256 * 2 * 0.625
        t = shipped = _graph_time(ours)
        print(f"<!-- L={L}: the whole shipped scan (mamba_chunk_scan_combined, 5 kernels) {whole:.1f} us -->")
        print(f"| {L} | triton `_chunk_scan_kernel` | shipped | {t:.1f} | {nbytes / 1e6:.0f} MB | "
              f"{100 * nbytes / t / 1e3 / copy_bw:.0f}% | - |")
        for cfg in args.configs:
            cs_st, z_st, k_st, ctas, maxnreg, mode, pregs, st, split = (
                [int(v) for v in cfg.split(",")] + [0, 0, 80, 1, 0])[:9]
            got = torch.full_like(out, float("nan"))
            fn = lambda: chunk_output(x, z, got, cb, C, D, states_in, dt_s, cs_s, chunk_size=256,
                                      stages=(cs_st, z_st, k_st), ctas_per_sm=ctas, maxnreg=maxnreg, mode=mode,
                                      producer_regs=pregs, store_tma=bool(st), diag_split=bool(split))
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - an experiment: report and go on
                print(f"| {L} | gluon | {cfg} | failed: {type(e).__name__}: {str(e)[:200]} |")
                continue
            try:
                meta = fn()
                print(f"<!-- {cfg}: {meta.n_regs} registers, {meta.n_spills} spills, shared {meta.metadata.shared} -->")
            except Exception:  # noqa: BLE001
                pass
            err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            print(f"<!-- {cfg} vs the fp32 reference: {((got[0].float() - exact).abs().max() / scale).item():.2e} -->")
            t = _graph_time(fn)
            print(f"<!-- {cfg}: the whole scan with this stage, projected: {whole - shipped + t:.1f} us -->")
            print(f"| {L} | gluon TMA + wgmma | {cfg} | {t:.1f} | {nbytes / 1e6:.0f} MB | "
                  f"{100 * nbytes / t / 1e3 / copy_bw:.0f}% | {err:.2e} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
