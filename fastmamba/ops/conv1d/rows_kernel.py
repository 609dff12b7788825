"""Triton kernel for the conv1d decode step on a 16-bit state of any state_len, in 16-byte rows.

The column kernel (kernel.py) reads a [S, D, state_len] state one column at a time: with
state_len 3 (vLLM's W-1 layout) each warp load picks 2-byte values 6 bytes apart, three
instructions per 32 channels. Here a thread owns 8 consecutive channels, whose state is one
contiguous run of 8 * state_len 16-bit values: state_len 16-byte vectors. The vectors are split
into single values inside the thread's registers (reshape + split: no data movement), the values
are renamed into columns (value j belongs to channel j // state_len, column j % state_len), and the
shifted state is joined back into 16-byte vectors for the store. The weight rows of 8 channels
([D, W] contiguous: W vectors) are split the same way; x, bias and the outputs are one vector.

Conditions (the launcher checks them): one token, plain shift mode, 16-bit state with channel rows
contiguous (strides (., state_len, 1)), weight contiguous [D, W], D a multiple of 8 (any other
strides for x and out).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fastmamba.ops._common.jit_math import join8, silu, split8
from fastmamba.ops._common.slot_errors import report_bad_slot
from fastmamba.ops._common.host_math import cdiv


@triton.jit
def _conv1d_update_rows_kernel(
    x_ptr,  # [B, D] (token axis dropped)
    state_ptr,  # [S, D, SL] with strides (stride_state_s, SL, 1), 16-bit; mutated in place
    weight_ptr,  # [D, W] contiguous
    bias_ptr,  # [D] or None
    state_indices_ptr,  # [B] or None
    out_ptr,  # [B, D]
    D,  # a multiple of 8
    pad_slot_id,
    n_slots,
    stride_x_b, stride_x_d,
    stride_state_s,
    stride_indices_b,
    stride_out_b, stride_out_d,
    W: tl.constexpr,  # 2..6, W - 1 <= SL
    SL: tl.constexpr,  # state_len
    BLOCK_D: tl.constexpr,  # channels per program, a multiple of 8
    SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_INDICES: tl.constexpr,
    USE_PDL: tl.constexpr,
    PDL_TRIGGER: tl.constexpr,
    err_ptr=None,  # slot-error record (REPORT_SLOTS: fastmamba.ops._common.slot_errors)
    REPORT_SLOTS: tl.constexpr = False,
):
    # one program per (block of BLOCK_D channels, request b); row r of the block = channels
    # d0 + 8r .. d0 + 8r + 7
    R: tl.constexpr = BLOCK_D // 8  # rows of 8 channels
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    d0 = pid_d * BLOCK_D
    rows = tl.arange(0, R)[:, None]
    lane = tl.arange(0, 8)[None, :]
    rmask = (d0 + 8 * rows < D) & (lane < 8)  # [R, 8]: whole rows in or out (D % 8 == 0)

    # weights (W vectors per row: value j = tap j % W of channel j // W), bias, slot: before the wait
    wv = ()
    for v in tl.static_range(W):
        w_vec = tl.load(weight_ptr + (d0 + 8 * rows) * W + v * 8 + lane, mask=rmask, other=0.0)
        wv = wv + split8(w_vec.to(tl.float32))
    if HAS_BIAS:
        bias = split8(tl.load(bias_ptr + d0 + 8 * rows + lane, mask=rmask, other=0.0).to(tl.float32))
    if HAS_INDICES:
        slot = tl.load(state_indices_ptr + b * stride_indices_b).to(tl.int64)
        live = (slot != pad_slot_id) & (slot >= 0) & (slot < n_slots)  # outside [0, S): as the pad slot
        if REPORT_SLOTS:
            if tl.program_id(0) == 0:
                report_bad_slot(err_ptr, slot, pad_slot_id, n_slots, 1)
    else:
        slot = b
        live = True
    block = state_ptr + slot * stride_state_s + d0 * SL
    # the block's state (SL vectors per row: value j = column j % SL of channel j // SL), read
    # once with 16-byte loads; under PDL before the wait (the cache contract of pdl.py)
    sv = ()
    for v in tl.static_range(SL):
        sv = sv + split8(tl.load(block + rows * (8 * SL) + v * 8 + lane, mask=rmask & live, other=0.0))
    if USE_PDL:
        gdc_wait()
        if PDL_TRIGGER:
            gdc_launch_dependents()
    out_row = out_ptr + b * stride_out_b + (d0 + 8 * rows + lane) * stride_out_d
    if HAS_INDICES:
        if (slot == pad_slot_id) | (slot < 0) | (slot >= n_slots):  # padding row: zero output, state untouched
            tl.store(out_row, tl.zeros([R, 8], dtype=out_ptr.dtype.element_ty), mask=rmask)
            return
    xs = split8(tl.load(x_ptr + b * stride_x_b + (d0 + 8 * rows + lane) * stride_x_d, mask=rmask, other=0.0))

    # channel c's window: state columns SL-W+1 .. SL-1, then x; new state: columns 1 .. SL-1, then x
    ys = ()
    new = ()
    for c in tl.static_range(8):
        acc = wv[c * W + W - 1] * xs[c].to(tl.float32)
        for k in tl.static_range(W - 1):
            acc += wv[c * W + k] * sv[c * SL + SL - (W - 1) + k].to(tl.float32)
        if HAS_BIAS:
            acc += bias[c]
        if SILU:
            acc = silu(acc)
        ys = ys + (acc.to(out_ptr.dtype.element_ty),)
        for k in tl.static_range(1, SL):
            new = new + (sv[c * SL + k],)
        new = new + (xs[c].to(state_ptr.dtype.element_ty),)
    tl.store(out_row, join8(ys[0], ys[1], ys[2], ys[3], ys[4], ys[5], ys[6], ys[7]), mask=rmask)
    for v in tl.static_range(SL):
        vec = join8(new[8 * v], new[8 * v + 1], new[8 * v + 2], new[8 * v + 3],
                    new[8 * v + 4], new[8 * v + 5], new[8 * v + 6], new[8 * v + 7])
        tl.store(block + rows * (8 * SL) + v * 8 + lane, vec, mask=rmask)


def rows_update_plan(x, conv_state, weight, bias, conv_state_indices, out, *, silu: bool, pad_slot_id: int,
                     block_d: int, num_warps: int, use_pdl: bool, pdl_trigger: bool, **report) -> tuple:
    """The launch (kernel, grid, False, scalars, keyword arguments: see conv1d.kernel's
    causal_conv1d_update_plan) for x, out: [B, D] views (any strides); conv_state [S, D, SL] 16-bit
    with strides (., SL, 1); weight [D, W] contiguous; D % 8 == 0 (see the module docstring)."""
    B, D = x.shape
    SL, W = conv_state.shape[2], weight.shape[1]
    scalars = (
        D, pad_slot_id, conv_state.shape[0],
        x.stride(0), x.stride(1), conv_state.stride(0),
        conv_state_indices.stride(0) if conv_state_indices is not None else 0,
        out.stride(0), out.stride(1),
    )
    consts = dict(
        W=W, SL=SL, BLOCK_D=block_d, SILU=silu, HAS_BIAS=bias is not None,
        HAS_INDICES=conv_state_indices is not None, USE_PDL=use_pdl, PDL_TRIGGER=pdl_trigger,
        num_warps=num_warps, launch_pdl=use_pdl, **report,
    )
    return _conv1d_update_rows_kernel, (cdiv(D, block_d), B), False, scalars, consts
