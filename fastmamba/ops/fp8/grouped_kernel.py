"""Triton kernels of the grouped W8A8 MoE (``fp8_moe_grouped``: more tokens than the pair GEMV of
``kernel.py``), with their launcher. The math is ``ref.fp8_moe_ref``'s; the checks are in ``api.py``;
the e4m3 conventions (rounding, ``max_num_imprecise_acc``) are ``kernel.py``'s module docstring.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastmamba.ops._common.launch import lean
from fastmamba.ops.fp8.kernel import _reciprocal, _round_e4m3, launch_quantize_per_token
from fastmamba.ops.fp8.ref import FP8_DTYPE as FP8_DTYPE_TORCH, FP8_MAX
# the alignment of ops/moe, its readers and its k-sum
from fastmamba.ops.moe.align_kernel import launch_align
from fastmamba.ops.moe.kernel import launch_sum
from fastmamba.ops.moe.kernel_common import align_layout, block_of_program, grouped_rows, load_pairs


# --- grouped W8A8 MoE (more tokens than the pair GEMV) --------------------------------------------
# The alignment is ops/moe's (launch_align: each expert's (token, expert) pairs, BM-padded row
# blocks found from the counts on the device), and so is the decoding of a program's block
# (block_of_program, load_pairs) and the fixed-order k-sum (launch_sum): one layout, one reader.
# Unlike ops/moe, the relu² rows are kept at the pair's row (h [P, F]), not in the sorted order, so
# the per-row quantisation between up and down runs over exactly P rows.
@triton.jit(do_not_specialize=["stride_se"])
def _moe_up_kernel(
    xq_ptr, sx_ptr, w_ptr, sw_ptr, h_ptr, hs_ptr, sorted_ptr, counts_ptr,
    E, Fdim, Mdim, K,
    stride_x_t, stride_sx_t, stride_w_e, stride_w_n, stride_w_k, stride_sw_e, stride_sw_n, stride_h_p, stride_se,
    QUANT_H: tl.constexpr, QMAX: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr, PER_EXPERT: tl.constexpr,
):
    # one program per (block of BM sorted rows = pairs of one expert e, block of BLOCK_N of F):
    # h[pair, n] = relu(sx[t] * sw[e, n] * (xq[t] . w_up[e, n]))², xq and w_up e4m3, the dot on tensor
    # cores with fp32 accumulation (products of two e4m3 values are exact), scales in the epilogue.
    # QUANT_H (a static down input scale hs): h is written as e4m3(clamp(h * (1 / hs))); else as fp32 for
    # the per-row quantisation kernel that follows.
    pid_m, pid_n, e, e_start, e_count, rows_used = block_of_program(counts_ptr, E, Fdim, BM, BLOCK_N, GROUP_M,
                                                                    BLOCK_E)
    if pid_m * BM >= rows_used:
        return
    offs_r = pid_m * BM + tl.arange(0, BM)
    real = (offs_r - e_start) < e_count
    pair = load_pairs(sorted_ptr, e, e_start, offs_r, real, stride_se, PER_EXPERT)
    tok = (pair // K).to(tl.int64)
    e64 = e.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # weight rows past F wrap around (read, never stored): the weight loads need no mask along N
    a_ptrs = xq_ptr + tok[:, None] * stride_x_t + offs_k[None, :]
    b_ptrs = w_ptr + e64 * stride_w_e + (offs_n % Fdim)[None, :] * stride_w_n + offs_k[:, None] * stride_w_k
    acc = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, Mdim, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=real[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            mk = (k0 + offs_k) < Mdim
            a = tl.load(a_ptrs, mask=real[:, None] & mk[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mk[:, None], other=0.0)
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)  # e4m3 x e4m3 -> fp32 (see above)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_w_k
    sx = tl.load(sx_ptr + tok * stride_sx_t, mask=real, other=0.0)
    sw = tl.load(sw_ptr + e64 * stride_sw_e + offs_n * stride_sw_n, mask=offs_n < Fdim, other=0.0)
    y = tl.maximum(acc * sx[:, None] * sw[None, :], 0.0)
    h = y * y
    mask = real[:, None] & (offs_n < Fdim)[None, :]
    out_ptrs = h_ptr + pair.to(tl.int64)[:, None] * stride_h_p + offs_n[None, :]
    if QUANT_H:
        hs_inv = _reciprocal(tl.load(hs_ptr))
        q = tl.minimum(h * hs_inv, QMAX)  # h >= 0
        tl.store(out_ptrs, _round_e4m3(q).to(tl.float8e4nv), mask=mask)
    else:
        tl.store(out_ptrs, h, mask=mask)


@triton.jit(do_not_specialize=["stride_se"])
def _moe_down_kernel(
    hq_ptr, sh_ptr, w_ptr, sw_ptr, tw_ptr, y_ptr, sorted_ptr, counts_ptr,
    E, Mdim, Fdim, K,
    stride_h_p, stride_sh_p, stride_w_e, stride_w_n, stride_w_k, stride_sw_e, stride_sw_n, stride_tw_t, stride_tw_k,
    stride_y_p, stride_se,
    BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr,
    EVEN_K: tl.constexpr, PER_EXPERT: tl.constexpr,
):
    # one program per (block of BM sorted rows of expert e, block of BLOCK_N of M):
    # y[pair, n] = tw[pair] * sh[pair] * sd[e, n] * (hq[pair] . w_down[e, n]), e4m3 dot, fp32 out,
    # written at the pair's row (the k-sum reads it in a fixed order)
    pid_m, pid_n, e, e_start, e_count, rows_used = block_of_program(counts_ptr, E, Mdim, BM, BLOCK_N, GROUP_M,
                                                                    BLOCK_E)
    if pid_m * BM >= rows_used:
        return
    offs_r = pid_m * BM + tl.arange(0, BM)
    real = (offs_r - e_start) < e_count
    pair = load_pairs(sorted_ptr, e, e_start, offs_r, real, stride_se, PER_EXPERT).to(tl.int64)
    e64 = e.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = hq_ptr + pair[:, None] * stride_h_p + offs_k[None, :]
    b_ptrs = w_ptr + e64 * stride_w_e + (offs_n % Mdim)[None, :] * stride_w_n + offs_k[:, None] * stride_w_k
    acc = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, Fdim, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=real[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            mk = (k0 + offs_k) < Fdim
            a = tl.load(a_ptrs, mask=real[:, None] & mk[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mk[:, None], other=0.0)
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_w_k
    sh = tl.load(sh_ptr + pair * stride_sh_p, mask=real, other=0.0)
    tw = tl.load(tw_ptr + (pair // K) * stride_tw_t + (pair % K) * stride_tw_k, mask=real, other=0.0).to(tl.float32)
    sw = tl.load(sw_ptr + e64 * stride_sw_e + offs_n * stride_sw_n, mask=offs_n < Mdim, other=0.0)
    y = acc * (sh * tw)[:, None] * sw[None, :]
    tl.store(y_ptr + pair[:, None] * stride_y_p + offs_n[None, :], y,
             mask=real[:, None] & (offs_n < Mdim)[None, :])


def launch_moe_grouped(xq: torch.Tensor, sx: torch.Tensor, w_up: torch.Tensor, su: torch.Tensor,
                       w_down: torch.Tensor, sd: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor,
                       hs: torch.Tensor | None, out: torch.Tensor, cfg) -> None:
    """The grouped W8A8 MoE after the input quantisation: alignment, up + relu², the per-row
    quantisation of h (unless ``hs``, the static down input scale, is given: then inside the up
    kernel), down x routing weight, the fixed-order k-sum into ``out``.

    xq [T, M] e4m3 (unit stride along M); sx [T] fp32 (stride 0: a static scale); w_up [E, F, M]
    and w_down [E, M, F] e4m3 (unit stride along the last dim); su [E, F] / sd [E, M] fp32 (stride 0
    along the last dim for per-tensor scales); tw [T, k] float and ids [T, k] int32/int64, any
    strides; hs None or one fp32 value; out [T, M] any strides (written); cfg a
    ``configs.MoeGroupedConfig``. Buffers are sized from (T, k, E, block_m) alone: no host read."""
    T, M = xq.shape
    E, F, _ = w_up.shape
    k = ids.shape[1]
    P = T * k
    dev = xq.device
    bm = cfg.block_m
    layout = align_layout(P, E, bm)
    ws = torch.empty(2 * E, dtype=torch.int32, device=dev)  # counts, cursors (launch_align writes them)
    counts, cursor = ws[:E], ws[E:]
    pairs = torch.empty(layout.entries, dtype=torch.int32, device=dev)
    launch_align(ids, counts, cursor, pairs, E=E, block_m=bm, layout=layout)
    n_blocks_m = grouped_rows(P, E, bm) // bm
    block_e = max(16, triton.next_power_of_2(E))
    hq = torch.empty(P, F, dtype=FP8_DTYPE_TORCH, device=dev)
    h = hq if hs is not None else torch.empty(P, F, dtype=torch.float32, device=dev)
    lean(_moe_up_kernel)[(n_blocks_m * triton.cdiv(F, cfg.block_n_up),)](
        xq, sx, w_up, su, h, hs, pairs, counts, E, F, M, k,
        xq.stride(0), sx.stride(0), w_up.stride(0), w_up.stride(1), w_up.stride(2), su.stride(0), su.stride(1),
        h.stride(0), layout.stride,
        QUANT_H=hs is not None, QMAX=FP8_MAX, BM=bm, BLOCK_N=cfg.block_n_up, BLOCK_K=cfg.block_k_up,
        GROUP_M=cfg.group_m, BLOCK_E=block_e, EVEN_K=M % cfg.block_k_up == 0, PER_EXPERT=layout.per_expert,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if hs is None:
        sh = torch.empty(P, dtype=torch.float32, device=dev)
        launch_quantize_per_token(h, hq, sh)  # rows of pairs with an id outside [0, E) are never read
    else:
        sh = hs.reshape(1).expand(P)
    y = torch.empty(P, M, dtype=torch.float32, device=dev)  # each pair's weighted contribution
    lean(_moe_down_kernel)[(n_blocks_m * triton.cdiv(M, cfg.block_n_down),)](
        hq, sh, w_down, sd, tw, y, pairs, counts, E, M, F, k,
        hq.stride(0), sh.stride(0), w_down.stride(0), w_down.stride(1), w_down.stride(2), sd.stride(0),
        sd.stride(1), tw.stride(0), tw.stride(1), y.stride(0), layout.stride,
        BM=bm, BLOCK_N=cfg.block_n_down, BLOCK_K=cfg.block_k_down, GROUP_M=cfg.group_m, BLOCK_E=block_e,
        EVEN_K=F % cfg.block_k_down == 0, PER_EXPERT=layout.per_expert,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    launch_sum(y, out, ids, E)
