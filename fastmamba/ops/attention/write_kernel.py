"""Triton kernel: T new tokens' K and V into their requests' pages, in one launch.

One program per token t: its request ``slots[token_rows[t]]`` (or ``slots[t]``), the page
``block_table[request, pos // PAGE]`` and the row ``pos % PAGE``; a pad request (slot outside
[0, S)), a position outside the block table or a page id outside [0, Np - 1) sends the token to the
scratch page ``Np - 1`` (what ``fastmamba.cache.kv_pages.KVPages`` never hands out), so nothing
lands outside the pools and no host read is needed (graph safe). The token's [Hkv, Dh] K and V
tiles are cast to the pools' dtype; float8 pools store K / k_scale and V / v_scale (IEEE division)
saturated at +-448 and rounded to the e4m3 grid in fp32 first (ops/fp8's ``_round_e4m3``), so the
bytes equal ``ref.quantize_kv_ref``'s on the GPU and in the interpreter alike.

This replaces a PyTorch index_put path of about twenty small kernels per attention layer (index
arithmetic, clamps, the gather of page ids, two index_puts); at decode sizes each was a launch of
its own inside the graphed step.
"""
from __future__ import annotations

import triton
import triton.language as tl

from fastmamba.ops._common.host_math import next_power_of_2
from fastmamba.ops._common.launch import lean
from fastmamba.ops.fp8.kernel import _round_e4m3
from fastmamba.ops.fp8.ref import FP8_MAX


@triton.jit
def _store_tile(x_ptr, stride_x_h, stride_x_d, out_ptr, stride_o_h, stride_o_d, scale_ptr, offs_h, offs_d, mask,
                FP8: tl.constexpr, QMAX: tl.constexpr):
    x = tl.load(x_ptr + offs_h[:, None] * stride_x_h + offs_d[None, :] * stride_x_d, mask=mask, other=0.0)
    dst = out_ptr + offs_h[:, None] * stride_o_h + offs_d[None, :] * stride_o_d
    if FP8:
        s = tl.load(scale_ptr).to(tl.float32)
        y = tl.div_rn(x.to(tl.float32), tl.zeros_like(x.to(tl.float32)) + s)
        y = tl.clamp(y, -QMAX, QMAX, propagate_nan=tl.PropagateNan.ALL)
        tl.store(dst, _round_e4m3(y).to(tl.float8e4nv), mask=mask)
    else:
        tl.store(dst, x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T", "B"])
def _paged_kv_write_kernel(k_ptr, v_ptr, kp_ptr, vp_ptr, bt_ptr, slots_ptr, pos_ptr, rows_ptr, ks_ptr, vs_ptr,
                           T, B, S, Pmax, Np, Hkv, D,
                           stride_k_t, stride_k_h, stride_k_d, stride_v_t, stride_v_h, stride_v_d,
                           stride_kp_p, stride_kp_r, stride_kp_h, stride_kp_d,
                           stride_vp_p, stride_vp_r, stride_vp_h, stride_vp_d,
                           stride_bt_s, stride_bt_p,
                           PAGE: tl.constexpr, HAS_ROWS: tl.constexpr, FP8: tl.constexpr, QMAX: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    if HAS_ROWS:
        r = tl.load(rows_ptr + t).to(tl.int64)
    else:
        r = t
    r_ok = (r >= 0) & (r < B)
    s = tl.load(slots_ptr + tl.minimum(tl.maximum(r, 0), B - 1)).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    col = tl.maximum(pos, 0) // PAGE
    ok = r_ok & (s >= 0) & (s < S) & (pos >= 0) & (col < Pmax)
    s_c = tl.minimum(tl.maximum(s, 0), S - 1)
    page = tl.load(bt_ptr + s_c * stride_bt_s + tl.minimum(col, Pmax - 1) * stride_bt_p).to(tl.int64)
    page = tl.where(ok & (page >= 0) & (page < Np - 1), page, Np - 1)
    row = tl.maximum(pos, 0) % PAGE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < Hkv) & (offs_d[None, :] < D)
    _store_tile(k_ptr + t * stride_k_t, stride_k_h, stride_k_d,
                kp_ptr + page * stride_kp_p + row * stride_kp_r, stride_kp_h, stride_kp_d,
                ks_ptr, offs_h, offs_d, mask, FP8, QMAX)
    _store_tile(v_ptr + t * stride_v_t, stride_v_h, stride_v_d,
                vp_ptr + page * stride_vp_p + row * stride_vp_r, stride_vp_h, stride_vp_d,
                vs_ptr, offs_h, offs_d, mask, FP8, QMAX)


def launch_paged_kv_write(k, v, k_pages, v_pages, block_table, slots, positions, token_rows, scales) -> None:
    """k, v [T, Hkv, Dh] (any strides); k_pages, v_pages [Np, PAGE, Hkv, Dh] (mutated); block_table
    [S, Pmax]; slots [B]; positions [T]; token_rows [T] or None (T == B); scales: (k_scale, v_scale)
    one-element device tensors for float8 pools, else None. The caller has checked shapes, dtypes and
    devices; no value is read on the host."""
    T, Hkv, D = k.shape
    if T == 0:
        return
    Np, PAGE = k_pages.shape[0], k_pages.shape[1]
    fp8 = scales is not None
    ks, vs = scales if fp8 else (k, v)  # (unused pointers without float8)
    block_d = next_power_of_2(D)
    lean(_paged_kv_write_kernel)[(T,)](
        k, v, k_pages, v_pages, block_table, slots, positions, token_rows if token_rows is not None else positions,
        ks, vs,
        T, slots.shape[0], block_table.shape[0], block_table.shape[1], Np, Hkv, D,
        *k.stride(), *v.stride(), *k_pages.stride(), *v_pages.stride(), *block_table.stride(),
        PAGE=PAGE, HAS_ROWS=token_rows is not None, FP8=fp8, QMAX=FP8_MAX,
        BLOCK_H=next_power_of_2(Hkv), BLOCK_D=block_d,
        num_warps=1 if Hkv * block_d <= 512 else 4,
    )
