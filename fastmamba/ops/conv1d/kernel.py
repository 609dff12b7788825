"""Triton kernel for the conv1d decode step, and its launcher.

The W-wide window lives in registers. A program (one request, one block of BLOCK_D channels)
holds the history window as a tuple of [BLOCK_D] fp32 vectors, one per history column:

    hist = (state columns h-XC .. h-1,  x[:, 0] .. x[:, L-1])      XC + L columns

where h is the history length (state_len, or num_accepted_tokens[b] + W - 2) and XC the number
of state columns the step needs (W-1 for the outputs; state_len - L more for the shift). Each
needed state column is loaded exactly once (none twice, and none that is neither used nor kept),
then:

* outputs: ``y[:, t] = sum_k w[:, k] * hist[XC - (W-1) + t + k]``, taps loaded once per program;
* new state: every surviving column is stored straight back at its shifted address (column c
  goes to state column ``c - (XC + L - state_len)``): the shift costs no register moves and no
  re-read. The circular buffer only writes the x columns.

Column positions, taps and the store shift are all static (the loops unroll); only the address
of the first state column depends on the request (num_accepted_tokens, cache_seqlens).
Each channel's columns are loaded and stored by the same thread, so the in-place shift needs no
barrier, and ``out`` may even alias ``x``.

Fast path (``_conv1d_update_vec4_kernel``): one token, plain shift mode, state_len 4 (the W
layout of mamba_ssm / causal_conv1d for W=4) with contiguous channel rows. A program's state block
is one contiguous run of BLOCK_D * 4 elements, loaded and stored as a flat vector with 16-byte
accesses; reshape + split turn it into the four columns inside each thread's registers (no data
movement) and join turns the shifted columns back. (A version for any state_len that picked the
columns out with tl.gather went through shared memory and ran 2x slower than the column kernel
on an H200.)

Row path (``rows_kernel.py``): the same single-token shift step for a 16-bit state of any other
state_len (vLLM's W-1 layout above all) with contiguous channel rows: each thread owns 8 channels,
whose state_len 16-byte vectors it splits into columns in registers. At bandwidth-bound sizes it
replaces the column kernel (H200, W=4, state_len 3, batch 256: 74% of copy at D=10240, was 57%).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fastmamba.ops._common.jit_math import silu
from fastmamba.ops._common.pdl import fits_one_wave, pdl_launch, pdl_requested
from fastmamba.ops.conv1d.configs import (
    pick_config, pick_rows_config, pick_vec4_config, use_rows_kernel, use_vec4_kernel,
)
from fastmamba.ops._common.slot_errors import report_bad_slot, slot_record
from fastmamba.ops.conv1d.rows_kernel import rows_update_plan
from fastmamba.ops._common.launch import lean, on_device
from fastmamba.ops._common.host_math import cdiv

MODE_SHIFT = tl.constexpr(0)  # state = last state_len inputs, shifted left by L
MODE_CIRCULAR = tl.constexpr(1)  # state is a circular buffer written at cache_seqlens[b] % state_len
MODE_ACCEPTED = tl.constexpr(2)  # history length h = num_accepted_tokens[b] + W - 2 (vLLM spec decode)


# Channel strides are never specialized (not even when 1): every [BLOCK_D] vector then gets the
# same layout, one channel per lane and BLOCK_D / (32 * num_warps) repeats per thread, so the
# contiguous loads (x, a channel-last state) and the strided ones (weight taps, a [S, D, SL]
# state) need no layout conversions, and every warp access spans 32 consecutive channels.
# Vectorizing the contiguous loads instead would put 4-8 channels on each lane and make the
# weight-tap loads (stride W) touch 4-8x more cache lines per instruction.
_CHANNEL_STRIDES = ["stride_x_d", "stride_state_d", "stride_weight_d", "stride_bias_d", "stride_out_d"]


def _mode(args) -> int:
    if args["cache_seqlens_ptr"] is not None:
        return MODE_CIRCULAR.value
    if args["num_accepted_ptr"] is not None:
        return MODE_ACCEPTED.value
    return MODE_SHIFT.value


@triton.heuristics(
    {
        "HAS_BIAS": lambda args: args["bias_ptr"] is not None,
        "HAS_INDICES": lambda args: args["state_indices_ptr"] is not None,
        "MODE": _mode,
    }
)
@triton.jit(do_not_specialize=_CHANNEL_STRIDES)
def _causal_conv1d_update_kernel(
    x_ptr,  # [B, D, L]
    state_ptr,  # [S, D, SL]  mutated in place
    weight_ptr,  # [D, W]
    bias_ptr,  # [D] or None
    state_indices_ptr,  # [B] int32/int64 or None
    cache_seqlens_ptr,  # [B] int or None
    num_accepted_ptr,  # [B] int or None
    out_ptr,  # [B, D, L]
    D,
    pad_slot_id,
    n_slots,
    stride_x_b, stride_x_d, stride_x_l,
    stride_state_s, stride_state_d, stride_state_l,
    stride_weight_d, stride_weight_w,
    stride_bias_d,
    stride_indices_b, stride_seqlens_b, stride_accepted_b,
    stride_out_b, stride_out_d, stride_out_l,
    W: tl.constexpr,  # conv width, 2..6
    SL: tl.constexpr,  # state_len >= W - 1
    L: tl.constexpr,  # tokens per request
    XC: tl.constexpr,  # history columns kept before x[:, 0] (see history_columns)
    BLOCK_D: tl.constexpr,
    SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_INDICES: tl.constexpr,
    MODE: tl.constexpr,
    USE_PDL: tl.constexpr,
    PDL_TRIGGER: tl.constexpr,
    err_ptr=None,  # slot-error record (REPORT_SLOTS: fastmamba.ops._common.slot_errors)
    REPORT_SLOTS: tl.constexpr = False,
):
    # one program per (block of BLOCK_D channels, request b)
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < D
    x_row = x_ptr + b * stride_x_b + d * stride_x_d
    out_row = out_ptr + b * stride_out_b + d * stride_out_d

    # weights and slot metadata first: under PDL they are read before the grid-dependency wait
    taps = ()
    for k in tl.static_range(W):
        w_k = tl.load(weight_ptr + d * stride_weight_d + k * stride_weight_w, mask=d_mask, other=0.0)
        taps = taps + (w_k.to(tl.float32),)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d * stride_bias_d, mask=d_mask, other=0.0).to(tl.float32)
    if HAS_INDICES:
        slot = tl.load(state_indices_ptr + b * stride_indices_b).to(tl.int64)
    else:
        slot = b
    state_row = state_ptr + slot * stride_state_s + d * stride_state_d
    live = True
    if HAS_INDICES:  # a slot outside [0, S) acts as the pad slot: nothing outside the pool is touched
        live = (slot != pad_slot_id) & (slot >= 0) & (slot < n_slots)
        if REPORT_SLOTS:
            if pid_d == 0:
                report_bad_slot(err_ptr, slot, pad_slot_id, n_slots, 1)
    if MODE == MODE_SHIFT:
        # the state columns the step needs sit at fixed addresses: under PDL they are read before
        # the wait, like the weights (a padding row reads nothing)
        shift_cols = ()
        for c in tl.static_range(XC):
            v = tl.load(state_row + (SL - XC + c) * stride_state_l, mask=d_mask & live, other=0.0)
            shift_cols = shift_cols + (v.to(tl.float32),)
    if USE_PDL:
        gdc_wait()
        if PDL_TRIGGER:
            gdc_launch_dependents()
    if HAS_INDICES:
        if (slot == pad_slot_id) | (slot < 0) | (slot >= n_slots):  # padding row: zero output, state untouched
            zero = tl.zeros([BLOCK_D], dtype=out_ptr.dtype.element_ty)
            for t in tl.static_range(L):
                tl.store(out_row + t * stride_out_l, zero, mask=d_mask)
            return

    # ---- load the history window, one [BLOCK_D] vector per column: XC state columns, then x -------
    # column c is history index LO + c, where LO = h - XC and h is the history length
    if MODE == MODE_CIRCULAR:
        start = tl.load(cache_seqlens_ptr + b * stride_seqlens_b).to(tl.int32)
        start = ((start % SL) + SL) % SL  # physical column of the oldest entry
    if MODE == MODE_ACCEPTED:
        h = tl.load(num_accepted_ptr + b * stride_accepted_b).to(tl.int32) + (W - 2)
    hist = ()
    for c in tl.static_range(XC):
        if MODE == MODE_CIRCULAR:
            col = (start + (SL - XC + c)) % SL
            v = tl.load(state_row + col * stride_state_l, mask=d_mask, other=0.0).to(tl.float32)
        elif MODE == MODE_ACCEPTED:
            col = h - XC + c  # history columns before the state's start read as 0
            v = tl.load(state_row + col * stride_state_l, mask=d_mask & (col >= 0) & (col < SL), other=0.0)
            v = v.to(tl.float32)
        else:
            v = shift_cols[c]
        hist = hist + (v,)
    for t in tl.static_range(L):
        hist = hist + (tl.load(x_row + t * stride_x_l, mask=d_mask, other=0.0).to(tl.float32),)

    # ---- outputs from registers: token t's window is columns XC-(W-1)+t .. XC+t -------------------
    ys = ()
    for t in tl.static_range(L):
        acc = taps[0] * hist[XC - (W - 1) + t]
        for k in tl.static_range(1, W):
            acc += taps[k] * hist[XC - (W - 1) + t + k]
        if HAS_BIAS:
            acc += bias
        if SILU:
            acc = silu(acc)
        ys = ys + (acc,)

    # no barrier needed before the stores: each channel's columns are loaded and stored by the
    # same thread, and programs own disjoint channels

    # ---- store: outputs, then the new state straight from the columns, at shifted addresses --------
    for t in tl.static_range(L):
        tl.store(out_row + t * stride_out_l, ys[t].to(out_ptr.dtype.element_ty), mask=d_mask)
    if MODE == MODE_CIRCULAR:
        # only the x columns change; with L > SL only the last SL tokens survive
        for t in tl.static_range(L):
            if t >= L - SL:
                col = (start + t) % SL
                new = hist[XC + t].to(state_ptr.dtype.element_ty)
                tl.store(state_row + col * stride_state_l, new, mask=d_mask)
    else:
        # new state = history[h + L - SL : h + L]: column c goes to state column c - (XC + L - SL)
        for c in tl.static_range(XC + L - SL, XC + L):
            dst = c - (XC + L - SL)
            new = hist[c].to(state_ptr.dtype.element_ty)
            tl.store(state_row + dst * stride_state_l, new, mask=d_mask)


@triton.jit
def _columns4(flat, BLOCK_D: tl.constexpr):
    """[BLOCK_D * 4] row-major (channel, column) values -> the four [BLOCK_D] columns, split
    inside each thread's registers (reshape + two splits move no data)."""
    even, odd = tl.split(tl.reshape(flat, [BLOCK_D, 2, 2]))
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return c0, c1, c2, c3


@triton.jit(do_not_specialize=["stride_x_d"])
def _conv1d_update_vec4_kernel(
    x_ptr,  # [B, D] (token axis dropped)
    state_ptr,  # [S, D, 4] with strides (stride_state_s, 4, 1)  mutated in place
    weight_ptr,  # [D, W]
    bias_ptr,  # [D] or None
    state_indices_ptr,  # [B] or None
    out_ptr,  # [B, D]
    D,
    pad_slot_id,
    n_slots,
    stride_x_b, stride_x_d,
    stride_state_s,
    stride_weight_d, stride_weight_w,
    stride_indices_b,
    stride_out_b, stride_out_d,
    W: tl.constexpr,  # 2..5 (state_len 4 >= W - 1)
    WEIGHT_FLAT: tl.constexpr,  # W == 4 and weight strides (4, 1)
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,  # D % BLOCK_D == 0: no channel mask, full 16-byte vectors
    SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_INDICES: tl.constexpr,
    USE_PDL: tl.constexpr,
    PDL_TRIGGER: tl.constexpr,
    err_ptr=None,  # slot-error record (REPORT_SLOTS: fastmamba.ops._common.slot_errors)
    REPORT_SLOTS: tl.constexpr = False,
):
    # one program per (block of BLOCK_D channels, request b); state_len is 4
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    d0 = pid_d * BLOCK_D
    e = tl.arange(0, BLOCK_D * 4)  # flat index into the block's state: channel e // 4, column e % 4
    if EVEN_D:
        e_mask = e < BLOCK_D * 4
    else:
        e_mask = e < (D - d0) * 4
    # the block's channel index with the columns' register layout: split the flat index like the state
    ch = _columns4(e // 4, BLOCK_D)[0]
    c_mask = d0 + ch < D

    if WEIGHT_FLAT:  # [D, 4] contiguous weights: the same 16-byte loads and register split
        w0, w1, w2, w3 = _columns4(tl.load(weight_ptr + d0 * 4 + e, mask=e_mask, other=0.0), BLOCK_D)
        taps = (w0.to(tl.float32), w1.to(tl.float32), w2.to(tl.float32), w3.to(tl.float32))
    else:
        taps = ()
        for k in tl.static_range(W):
            w_k = tl.load(weight_ptr + (d0 + ch) * stride_weight_d + k * stride_weight_w, mask=c_mask, other=0.0)
            taps = taps + (w_k.to(tl.float32),)
    if HAS_BIAS:
        acc = tl.load(bias_ptr + d0 + ch, mask=c_mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_INDICES:
        slot = tl.load(state_indices_ptr + b * stride_indices_b).to(tl.int64)
    else:
        slot = b
    block = state_ptr + slot * stride_state_s + d0 * 4
    valid = True
    if HAS_INDICES:  # a slot outside [0, S) acts as the pad slot
        valid = (slot != pad_slot_id) & (slot >= 0) & (slot < n_slots)
        if REPORT_SLOTS:
            if pid_d == 0:
                report_bad_slot(err_ptr, slot, pad_slot_id, n_slots, 1)
    # the block's whole state, read once with 16-byte loads (under PDL, before the wait: see pdl.py)
    old = tl.load(block + e, mask=e_mask & valid, other=0.0)
    if USE_PDL:
        gdc_wait()
        if PDL_TRIGGER:
            gdc_launch_dependents()
    out_row = out_ptr + b * stride_out_b + (d0 + ch) * stride_out_d
    if HAS_INDICES:
        if (slot == pad_slot_id) | (slot < 0) | (slot >= n_slots):
            tl.store(out_row, tl.zeros([BLOCK_D], dtype=out_ptr.dtype.element_ty), mask=c_mask)
            return
    x = tl.load(x_ptr + b * stride_x_b + (d0 + ch) * stride_x_d, mask=c_mask, other=0.0)

    # columns out of registers: [BLOCK_D * 4] -> [BLOCK_D, 2, 2] -> two splits
    c0, c1, c2, c3 = _columns4(old, BLOCK_D)
    cols = (c0, c1, c2, c3)
    # y = bias + sum_k w_k * window_k, window = state columns 5-W .. 3, then x
    for k in tl.static_range(W - 1):
        acc += taps[k] * cols[5 - W + k].to(tl.float32)
    acc += taps[W - 1] * x.to(tl.float32)
    if SILU:
        acc = silu(acc)
    tl.store(out_row, acc.to(out_ptr.dtype.element_ty), mask=c_mask)

    # shifted state (c1, c2, c3, x), joined back into the flat layout and stored with 16-byte stores
    new = tl.reshape(tl.join(tl.join(c1, c3), tl.join(c2, x.to(state_ptr.dtype.element_ty))), [BLOCK_D * 4])
    tl.store(block + e, new, mask=e_mask)


def history_columns(W: int, state_len: int, L: int, circular: bool) -> int:
    """XC: how many state columns the kernel loads, i.e. the window column of x[:, 0].

    Outputs need the W-1 columns before x; the shifted state needs the last state_len - L of
    them (every mode but the circular buffer, which only writes x columns).
    """
    return W - 1 if circular else max(W - 1, state_len - L)


def causal_conv1d_update_launch(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    conv_state_indices: torch.Tensor | None,
    num_accepted_tokens: torch.Tensor | None,
    out: torch.Tensor,
    silu: bool,
    pad_slot_id: int,
) -> None:
    """Launch the kernel on checked inputs; ``x`` and ``out`` are [B, D, L] views (any strides)."""
    plan = causal_conv1d_update_plan(x, conv_state, weight, bias, cache_seqlens, conv_state_indices,
                                     num_accepted_tokens, out, silu, pad_slot_id)
    launch_update_plan(plan, x, conv_state, weight, bias, cache_seqlens, conv_state_indices, num_accepted_tokens, out)


def launch_update_plan(plan, x, conv_state, weight, bias, cache_seqlens, conv_state_indices, num_accepted_tokens,
                       out) -> None:
    """Launch a ``causal_conv1d_update_plan`` plan on these tensors (x and out as [B, D] or [B, D, L]:
    views of one buffer share its address, and the plan holds the strides)."""
    if plan is None:
        return
    kernel, grid, generic, scalars, consts = plan
    with on_device(x):
        if generic:
            lean(kernel)[grid](x, conv_state, weight, bias, conv_state_indices, cache_seqlens, num_accepted_tokens, out,
                         *scalars, **consts)
        else:
            lean(kernel)[grid](x, conv_state, weight, bias, conv_state_indices, out, *scalars, **consts)


def causal_conv1d_update_plan(x, conv_state, weight, bias, cache_seqlens, conv_state_indices, num_accepted_tokens,
                              out, silu: bool, pad_slot_id: int, report_slots: bool = False) -> tuple | None:
    """(kernel, grid, generic argument order, scalar arguments, keyword arguments) of the launch on
    these [B, D, L] views, or None when there is nothing to do: everything but the tensors'
    addresses, so a plan serves every call with the same shapes, strides and dtypes. With
    ``report_slots`` the kernel records a bad slot index in the op's slot-error record on x's
    device (slot_errors.py; the record is the same tensor for every call, so the plan holds it)."""
    B, D, L = x.shape
    state_len = conv_state.shape[-1]
    W = weight.shape[1]
    if B == 0 or D == 0:
        return None
    vec4 = (
        L == 1 and cache_seqlens is None and num_accepted_tokens is None and state_len == 4
        and conv_state.stride(2) == 1 and conv_state.stride(1) == 4
        and (not x.is_cuda or use_vec4_kernel(D, B))  # the interpreter tests both kernels' paths
    )
    if vec4:
        cfg = pick_vec4_config(D, B, interpreter=not x.is_cuda)
        use_pdl, early = pdl_launch(x, cdiv(D, cfg.block_d) * B, cfg.num_warps)
        scalars = (
            D, pad_slot_id, conv_state.shape[0],
            x.stride(0), x.stride(1), conv_state.stride(0), *weight.stride(),
            conv_state_indices.stride(0) if conv_state_indices is not None else 0,
            out.stride(0), out.stride(1),
        )
        consts = dict(
            W=W, WEIGHT_FLAT=W == 4 and tuple(weight.stride()) == (4, 1),
            BLOCK_D=cfg.block_d, EVEN_D=D % cfg.block_d == 0, SILU=silu, HAS_BIAS=bias is not None,
            HAS_INDICES=conv_state_indices is not None, USE_PDL=use_pdl, PDL_TRIGGER=early,
            num_warps=cfg.num_warps, launch_pdl=use_pdl, **_report(x, report_slots),
        )
        return _conv1d_update_vec4_kernel, (cdiv(D, cfg.block_d), B), False, scalars, consts

    rows = (
        L == 1 and cache_seqlens is None and num_accepted_tokens is None and state_len != 4
        and conv_state.element_size() == 2 and conv_state.stride(2) == 1 and conv_state.stride(1) == state_len
        and tuple(weight.stride()) == (W, 1) and D % 8 == 0
        and (not x.is_cuda or use_rows_kernel(D, B))  # the interpreter tests this path where it applies
    )
    if rows:
        cfg = pick_rows_config(
            D, B, interpreter=not x.is_cuda,
            one_wave=(lambda c: fits_one_wave(x, cdiv(D, c.block_d) * B, c.num_warps)) if pdl_requested(x) else None,
        )
        use_pdl, early = pdl_launch(x, cdiv(D, cfg.block_d) * B, cfg.num_warps)
        return rows_update_plan(
            x[:, :, 0], conv_state, weight, bias, conv_state_indices, out[:, :, 0], silu=silu,
            pad_slot_id=pad_slot_id, block_d=cfg.block_d, num_warps=cfg.num_warps,
            use_pdl=use_pdl, pdl_trigger=early, **_report(x, report_slots),
        )

    xc = history_columns(W, state_len, L, cache_seqlens is not None)
    cfg = pick_config(D, B, xc + 2 * L + W, interpreter=not x.is_cuda)
    grid = (cdiv(D, cfg.block_d), B)
    use_pdl, early = pdl_launch(x, grid[0] * B, cfg.num_warps)

    def stride0(t: torch.Tensor | None) -> int:
        return t.stride(0) if t is not None else 0

    scalars = (
        D, pad_slot_id, conv_state.shape[0],
        *x.stride(), *conv_state.stride(), *weight.stride(), stride0(bias),
        stride0(conv_state_indices), stride0(cache_seqlens), stride0(num_accepted_tokens),
        *out.stride(),
    )
    consts = dict(
        W=W, SL=state_len, L=L, XC=xc,
        BLOCK_D=cfg.block_d, SILU=silu, USE_PDL=use_pdl, PDL_TRIGGER=early,
        num_warps=cfg.num_warps, launch_pdl=use_pdl, **_report(x, report_slots),
    )
    return _causal_conv1d_update_kernel, grid, True, scalars, consts


def _report(x: torch.Tensor, report_slots: bool) -> dict:
    """The keyword arguments that make an update kernel record bad slot indices (slot_errors.py)."""
    if not report_slots:
        return {}
    return dict(err_ptr=slot_record("causal_conv1d_update", x.device)[0], REPORT_SLOTS=True)

