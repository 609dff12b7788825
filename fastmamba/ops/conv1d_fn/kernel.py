"""Triton kernels for the prefill depthwise causal conv, and their launchers.

For one row (request b, or one packed sequence) the conv reads an *extended input*: W-1 columns of
history (initial states, a cache slot, or zeros) followed by the tokens, and

    y[:, t] = act(bias + sum_k weight[:, k] * ext[:, t + k])          t = 0 .. L-1

Every kernel loads each input element once from DRAM and builds the W shifted operands in
registers; a tile's W-1 history columns come from the tile before it (an L2 hit) or from the
history tensor. Accumulation is fp32. Three kernels:

* ``_conv1d_fwd_rows_kernel`` (channel-last x, i.e. the [B, L, D] memory of Mamba-2's in_proj):
  a program owns BLOCK_L tokens x BLOCK_D channels. Every token row is one [BLOCK_D] vector with
  the same register layout, 16-byte loads along D (8 bf16 channels per thread), so the window is
  a tuple of W-1+BLOCK_L row vectors and the shift is tuple indexing: no data moves between
  threads. The rows are a static loop, so all loads are independent and issued up front.
* ``_conv1d_fwd_cols_kernel`` (channel-first x; any other strides use it too, unvectorized): a
  program owns BLOCK_D channels x BLOCK_L tokens, loaded as an [NC, BLOCK_D, V] tile of V-token
  chunks (one 16-byte vector per thread; consecutive lanes take consecutive chunks of a channel).
  Each chunk's W-1 history tokens are the tail of the chunk before it, which another thread
  holds: that chunk is loaded a second time, as an aligned vector (an L1 or L2 hit). reshape +
  split turn the two chunks into 2V [NC, BLOCK_D] tensors inside each thread's registers, the
  outputs are sums of those, and join rebuilds the chunk for one 16-byte store.
* ``_conv1d_varlen_kernel`` (``varlen_kernel.py``, with its launcher): the rows kernel over
  packed sequences (x [T, D]), history from a state-cache slot, which it then overwrites with the
  last state_len inputs.

Under programmatic dependent launch (opt-in, sm_90+; ``fastmamba.ops._common.pdl``) every program
waits for the kernel before it ahead of its first read of x, the states, seq_idx or cu_seqlens
(the rows kernel reads its weights and bias first). The rows kernel lets the next kernel launch
right after its wait on grids of any size (``pdl_launch_early``); the others do so only on grids of
one wave, else as their programs exit (``pdl_launch``).

Who writes the final / new state: the program owning the *first* token tile of a row (per block of
channels). It is the only program that reads the old history (the others' halos lie inside x, as
BLOCK_L >= W-1), so reading the newest inputs straight from x and writing the state there
cannot race with another program's read, whatever the schedule. A barrier separates its reads
from its writes, because a channel may be read and written by different threads when the
history's layout differs from x's. This also makes ``final_states_out`` = ``initial_states``
(in place) safe.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fastmamba.ops._common.dispatch import inline_asm_ok
from fastmamba.ops._common.jit_math import SILU_PTX, split8
from fastmamba.ops._common.pdl import pdl_launch, pdl_launch_early
from fastmamba.ops._common.plans import PlanCache
from fastmamba.ops.conv1d_fn import configs
from fastmamba.ops.conv1d_fn.configs import pick_cols_config, pick_rows_config, vector_width
from fastmamba.ops._common.launch import lean, on_device
from fastmamba.ops._common.host_math import cdiv


@triton.jit
def _load_taps(weight_ptr, d, d_mask, stride_weight_d, stride_weight_w, W: tl.constexpr):
    """The W taps of channels d as a tuple of fp32 tensors shaped like d."""
    taps = ()
    for k in tl.static_range(W):
        w_k = tl.load(weight_ptr + d * stride_weight_d + k * stride_weight_w, mask=d_mask, other=0.0)
        taps = taps + (w_k.to(tl.float32),)
    return taps


@triton.jit
def _dense_final_states(
    x_ptr, init_ptr, seq_idx_ptr, final_ptr, b, d, d_mask, L,
    stride_x_b, stride_x_d, stride_x_l,
    stride_seq_b, stride_seq_l,
    stride_init_b, stride_init_d, stride_init_w,
    stride_final_b, stride_final_d, stride_final_w,
    W: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ_IDX: tl.constexpr,
):
    """final[b, d, i] = ext[d, L + i] for i < W-1 (ext = [initial states | x[b]]), zeroed where
    that column's sequence id differs from seq_idx[b, L-1] or that id is padding (< 0). All reads, a barrier, then the
    writes (final may be the initial-states tensor itself)."""
    x_row = x_ptr + b * stride_x_b + d * stride_x_d
    if HAS_SEQ_IDX:
        seq_row = seq_idx_ptr + b * stride_seq_b
        last = tl.load(seq_row + (L - 1) * stride_seq_l)
    vals = ()
    for i in tl.static_range(W - 1):
        r = L - (W - 1) + i  # x column; when negative, initial-state column W-1+r = L+i
        v = tl.load(x_row + r * stride_x_l, mask=d_mask & (r >= 0), other=0.0).to(tl.float32)
        if HAS_INIT:
            init_row = init_ptr + b * stride_init_b + d * stride_init_d
            v0 = tl.load(init_row + (L + i) * stride_init_w, mask=d_mask & (r < 0), other=0.0)
            v = tl.where(r >= 0, v, v0.to(tl.float32))
        if HAS_SEQ_IDX:  # a padding last token (id < 0) leaves zeros
            sid = tl.load(seq_row + tl.maximum(r, 0) * stride_seq_l)  # history columns: seq_idx[b, 0]
            v = tl.where((sid == last) & (last >= 0), v, 0.0)
        vals = vals + (v,)
    if HAS_INIT:
        tl.debug_barrier()
    final_row = final_ptr + b * stride_final_b + d * stride_final_d
    for i in tl.static_range(W - 1):
        tl.store(final_row + i * stride_final_w, vals[i].to(final_ptr.dtype.element_ty), mask=d_mask)


# _ALIGN_NOTE: ALIGN > 1 is the launcher's promise that D (or L) and the x / out strides named in
# the kernel are multiples of ALIGN elements. ``v // ALIGN * ALIGN`` leaves such a value unchanged
# and tells the compiler its divisibility, so row addresses and channel masks are known to be
# 16-byte granular and loads / stores become vectors even where the value is not a multiple of 16
# (which Triton detects by itself), e.g. mamba2-130m's in_proj row stride 3352. A tl.multiple_of
# on the argument itself would be dropped by the compiler.

_DENSE_HEURISTICS = {
    "HAS_BIAS": lambda args: args["bias_ptr"] is not None,
    "HAS_SEQ_IDX": lambda args: args["seq_idx_ptr"] is not None,
    "HAS_INIT": lambda args: args["init_ptr"] is not None,
    "HAS_FINAL": lambda args: args["final_ptr"] is not None,
}


@triton.heuristics(_DENSE_HEURISTICS)
@triton.jit(do_not_specialize=["L"])
def _conv1d_fwd_rows_kernel(
    x_ptr,  # [B, D, L]  channel-last: stride_x_d == 1
    weight_ptr,  # [D, W]
    bias_ptr,  # [D] or None
    seq_idx_ptr,  # [B, L] int32/int64 or None
    init_ptr,  # [B, D, W-1] or None
    final_ptr,  # [B, D, W-1] or None; written
    out_ptr,  # [B, D, L]; written
    D, L,
    stride_x_b, stride_x_d, stride_x_l,
    stride_weight_d, stride_weight_w,
    stride_bias_d,
    stride_seq_b, stride_seq_l,
    stride_init_b, stride_init_d, stride_init_w,
    stride_final_b, stride_final_d, stride_final_w,
    stride_out_b, stride_out_d, stride_out_l,
    W: tl.constexpr,  # conv width, 2..6
    BLOCK_L: tl.constexpr,  # >= W-1
    BLOCK_D: tl.constexpr,
    ALIGN: tl.constexpr,  # D and the x / out row strides are multiples of ALIGN (vector hint)
    SILU: tl.constexpr,  # 0: none, 1: silu, 2: silu with the approximate PTX exp2 / reciprocal (GPU)
    HAS_BIAS: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
    HAS_INIT: tl.constexpr,
    HAS_FINAL: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch: wait for the kernel before (sm_90+)
    PDL_TRIGGER: tl.constexpr = False,  # ... and let the next kernel launch right after the wait
):
    # one program per (block of BLOCK_D channels, block of BLOCK_L tokens, request b)
    if ALIGN > 1:  # see _ALIGN_NOTE
        D = D // ALIGN * ALIGN
        stride_x_b = stride_x_b // ALIGN * ALIGN
        stride_x_l = stride_x_l // ALIGN * ALIGN
        stride_out_b = stride_out_b // ALIGN * ALIGN
        stride_out_l = stride_out_l // ALIGN * ALIGN
    pid = tl.program_id(0)
    n_d = tl.cdiv(D, BLOCK_D)
    pid_d = pid % n_d
    pid_l = pid // n_d
    b = tl.program_id(1).to(tl.int64)
    t0 = pid_l.to(tl.int64) * BLOCK_L
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < D
    x_rows = x_ptr + b * stride_x_b + d * stride_x_d

    taps = _load_taps(weight_ptr, d, d_mask, stride_weight_d, stride_weight_w, W)
    if HAS_BIAS:
        acc0 = tl.load(bias_ptr + d * stride_bias_d, mask=d_mask, other=0.0).to(tl.float32)
    else:
        acc0 = tl.zeros([BLOCK_D], dtype=tl.float32)

    if USE_PDL:  # x, the states and seq_idx may come from the kernel before: see fastmamba.ops._common.pdl
        gdc_wait()
        if PDL_TRIGGER:
            gdc_launch_dependents()
    # ---- the window: rows t0-(W-1) .. t0+BLOCK_L-1, each loaded once (halo rows: L2 hits) --------
    win = ()
    for j in tl.static_range(W - 1 + BLOCK_L):
        r = t0 - (W - 1) + j
        if j < W - 1:  # halo: x, or initial-state column W-1+r before the row's start
            v = tl.load(x_rows + r * stride_x_l, mask=d_mask & (r >= 0), other=0.0).to(tl.float32)
            if HAS_INIT:
                init_rows = init_ptr + b * stride_init_b + d * stride_init_d
                v0 = tl.load(init_rows + (W - 1 + r) * stride_init_w, mask=d_mask & (r < 0), other=0.0)
                v = tl.where(r >= 0, v, v0.to(tl.float32))
        else:  # converted to fp32 where used
            v = tl.load(x_rows + r * stride_x_l, mask=d_mask & (r < L), other=0.0)
        win = win + (v,)
    if HAS_SEQ_IDX:  # one scalar id per window row; history columns carry seq_idx[b, 0]
        seq_row = seq_idx_ptr + b * stride_seq_b
        sids = ()
        for j in tl.static_range(W - 1 + BLOCK_L):
            r = tl.minimum(tl.maximum(t0 - (W - 1) + j, 0), L - 1)
            sids = sids + (tl.load(seq_row + r * stride_seq_l),)

    # ---- outputs: row t's window is win[t .. t+W-1] ----------------------------------------------
    out_rows = out_ptr + b * stride_out_b + d * stride_out_d
    for t in tl.static_range(BLOCK_L):
        acc = acc0
        for k in tl.static_range(W):
            term = taps[k] * win[t + k].to(tl.float32)
            if HAS_SEQ_IDX:
                if k < W - 1:  # the token itself always counts
                    term = tl.where(sids[t + k] == sids[t + W - 1], term, 0.0)
            acc += term
        # silu inlined (a jit call per row costs milliseconds in the interpreter); 2: approximate PTX
        if SILU == 2:
            acc = tl.inline_asm_elementwise(SILU_PTX, "=f,f", [acc], dtype=tl.float32, is_pure=True, pack=1)
        elif SILU == 1:
            acc = acc / (1.0 + tl.exp(-acc))
        if HAS_SEQ_IDX:  # padding token (id < 0): zero output (its window holds only padding)
            acc = tl.where(sids[t + W - 1] >= 0, acc, 0.0)
        y = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_rows + (t0 + t) * stride_out_l, y, mask=d_mask & (t0 + t < L))

    if HAS_FINAL:
        if pid_l == 0:  # the only program that reads initial_states: see the module docstring
            _dense_final_states(
                x_ptr, init_ptr, seq_idx_ptr, final_ptr, b, d, d_mask, L,
                stride_x_b, stride_x_d, stride_x_l, stride_seq_b, stride_seq_l,
                stride_init_b, stride_init_d, stride_init_w, stride_final_b, stride_final_d, stride_final_w,
                W, HAS_INIT, HAS_SEQ_IDX,
            )


@triton.jit
def _split4(t, S0: tl.constexpr, S1: tl.constexpr):
    """[S0, S1, 4] -> the 4 [S0, S1] tensors t[:, :, v], split inside each thread's registers."""
    even, odd = tl.split(tl.reshape(t, [S0, S1, 2, 2]))  # v = 2i + j: split takes j
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return c0, c1, c2, c3


@triton.jit
def _split_chunks(t, S0: tl.constexpr, S1: tl.constexpr, V: tl.constexpr):
    if V == 4:
        cols = _split4(t, S0, S1)
    else:
        cols = split8(t)
    return cols


@triton.jit
def _join_chunks(c, V: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr):
    """Inverse of _split_chunks: a tuple of V [S0, S1] tensors -> [S0, S1, V]."""
    if V == 4:
        t = tl.join(tl.join(c[0], c[2]), tl.join(c[1], c[3]))
    else:
        t = tl.join(
            tl.join(tl.join(c[0], c[4]), tl.join(c[2], c[6])),
            tl.join(tl.join(c[1], c[5]), tl.join(c[3], c[7])),
        )
    return tl.reshape(t, [S0, S1, V])


@triton.heuristics(_DENSE_HEURISTICS)
@triton.jit(do_not_specialize=["L"])
def _conv1d_fwd_cols_kernel(
    x_ptr,  # [B, D, L]  channel-first (stride_x_l == 1) for the vector path; any strides work
    weight_ptr,  # [D, W]
    bias_ptr,  # [D] or None
    seq_idx_ptr,  # [B, L] int32/int64 or None
    init_ptr,  # [B, D, W-1] or None
    final_ptr,  # [B, D, W-1] or None; written
    out_ptr,  # [B, D, L]; written
    D, L,
    stride_x_b, stride_x_d, stride_x_l,
    stride_weight_d, stride_weight_w,
    stride_bias_d,
    stride_seq_b, stride_seq_l,
    stride_init_b, stride_init_d, stride_init_w,
    stride_final_b, stride_final_d, stride_final_w,
    stride_out_b, stride_out_d, stride_out_l,
    W: tl.constexpr,  # conv width, 2..6
    V: tl.constexpr,  # tokens per chunk, 4 or 8, >= W-1
    BLOCK_L: tl.constexpr,  # multiple of V
    BLOCK_D: tl.constexpr,
    ALIGN: tl.constexpr,  # L and the x / out channel and batch strides are multiples of ALIGN
    SILU: tl.constexpr,  # 0: none, 1: silu, 2: silu with the approximate PTX exp2 / reciprocal (GPU)
    HAS_BIAS: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
    HAS_INIT: tl.constexpr,
    HAS_FINAL: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch: wait for the kernel before (sm_90+)
    PDL_TRIGGER: tl.constexpr = False,  # ... and let the next kernel launch right after the wait
):
    # one program per (block of BLOCK_L tokens, block of BLOCK_D channels, request b)
    # Tiles are [NC, BLOCK_D, V]: chunk first, so that a warp's lanes take consecutive chunks of one
    # channel (512 contiguous bytes for bf16) and the V tokens of a chunk sit in one thread.
    NC: tl.constexpr = BLOCK_L // V
    if ALIGN > 1:  # see _ALIGN_NOTE
        L = L // ALIGN * ALIGN
        stride_x_b = stride_x_b // ALIGN * ALIGN
        stride_x_d = stride_x_d // ALIGN * ALIGN
        stride_out_b = stride_out_b // ALIGN * ALIGN
        stride_out_d = stride_out_d // ALIGN * ALIGN
    pid = tl.program_id(0)
    n_l = tl.cdiv(L, BLOCK_L)
    pid_l = pid % n_l
    pid_d = pid // n_l
    b = tl.program_id(1).to(tl.int64)
    t0 = pid_l * BLOCK_L
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d2 = d[None, :]  # [1, BLOCK_D]
    d3 = d[None, :, None]  # [1, BLOCK_D, 1]
    dm3 = d3 < D
    c0 = t0 + tl.arange(0, NC)[:, None, None] * V  # [NC, 1, 1] first token of each chunk
    tok = c0 + tl.arange(0, V)[None, None, :]  # [NC, 1, V]
    ptok = tok - V  # the chunk before: its last W-1 tokens are this chunk's history
    in_cur = tok < L
    in_prev = (ptok >= 0) & (ptok < L)

    if USE_PDL:  # x, the states and seq_idx may come from the kernel before: see fastmamba.ops._common.pdl
        gdc_wait()
        if PDL_TRIGGER:
            gdc_launch_dependents()
    x_rows = x_ptr + b * stride_x_b + d3 * stride_x_d
    cur = tl.load(x_rows + tok * stride_x_l, mask=dm3 & in_cur, other=0.0).to(tl.float32)
    prev = tl.load(x_rows + ptok * stride_x_l, mask=dm3 & in_prev, other=0.0).to(tl.float32)
    if HAS_INIT:
        if pid_l == 0:  # tokens -(W-1) .. -1 are initial-state columns 0 .. W-2
            init_rows = init_ptr + b * stride_init_b + d3 * stride_init_d
            pre_mask = dm3 & (ptok < 0) & (ptok >= 1 - W)
            pre = tl.load(init_rows + (ptok + (W - 1)) * stride_init_w, mask=pre_mask, other=0.0)
            prev = tl.where(ptok >= 0, prev, pre.to(tl.float32))
    xs = _split_chunks(cur, NC, BLOCK_D, V)
    ps = _split_chunks(prev, NC, BLOCK_D, V)
    if HAS_SEQ_IDX:  # [NC, 1] per token position; history columns carry seq_idx[b, 0]
        seq_row = seq_idx_ptr + b * stride_seq_b
        first = tl.load(seq_row)
        s_cur = tl.load(seq_row + tok * stride_seq_l, mask=in_cur, other=0)
        s_prev = tl.load(seq_row + ptok * stride_seq_l, mask=in_prev, other=0)
        s_prev = tl.where(ptok >= 0, s_prev, first)
        ss = _split_chunks(s_cur, NC, 1, V)
        sp = _split_chunks(s_prev, NC, 1, V)

    taps = _load_taps(weight_ptr, d2, d2 < D, stride_weight_d, stride_weight_w, W)  # [1, BLOCK_D] each
    if HAS_BIAS:
        acc0 = tl.load(bias_ptr + d2 * stride_bias_d, mask=d2 < D, other=0.0).to(tl.float32)
    else:
        acc0 = tl.zeros([1, BLOCK_D], dtype=tl.float32)

    # ---- outputs: token v of a chunk reads chunk tokens v-(W-1) .. v; negative ones from prev -------
    ys = ()
    for v in tl.static_range(V):
        acc = tl.zeros([NC, BLOCK_D], dtype=tl.float32) + acc0
        for k in tl.static_range(W):
            # source token v-(W-1)+k of this chunk; negative: token V+that of the chunk before
            if v - (W - 1) + k >= 0:
                term = taps[k] * xs[v - (W - 1) + k]
                if HAS_SEQ_IDX:
                    term = tl.where(ss[v - (W - 1) + k] == ss[v], term, 0.0)
            else:
                term = taps[k] * ps[V + v - (W - 1) + k]
                if HAS_SEQ_IDX:
                    term = tl.where(sp[V + v - (W - 1) + k] == ss[v], term, 0.0)
            acc += term
        # silu inlined (a jit call per row costs milliseconds in the interpreter); 2: approximate PTX
        if SILU == 2:
            acc = tl.inline_asm_elementwise(SILU_PTX, "=f,f", [acc], dtype=tl.float32, is_pure=True, pack=1)
        elif SILU == 1:
            acc = acc / (1.0 + tl.exp(-acc))
        if HAS_SEQ_IDX:  # padding token (id < 0): zero output (its window holds only padding)
            acc = tl.where(ss[v] >= 0, acc, 0.0)
        ys = ys + (acc.to(out_ptr.dtype.element_ty),)
    y = _join_chunks(ys, V, NC, BLOCK_D)
    out_rows = out_ptr + b * stride_out_b + d3 * stride_out_d
    tl.store(out_rows + tok * stride_out_l, y, mask=dm3 & in_cur)

    if HAS_FINAL:
        if pid_l == 0:  # the only program that reads initial_states: see the module docstring
            _dense_final_states(
                x_ptr, init_ptr, seq_idx_ptr, final_ptr, b, d, d < D, L,
                stride_x_b, stride_x_d, stride_x_l, stride_seq_b, stride_seq_l,
                stride_init_b, stride_init_d, stride_init_w, stride_final_b, stride_final_d, stride_final_w,
                W, HAS_INIT, HAS_SEQ_IDX,
            )


def _align_hint(limit: int, values: list[int]) -> int:
    """The largest power of two <= limit dividing every value (the ALIGN constexpr)."""
    g = 0
    for v in values:
        g = math.gcd(g, int(v))
    if g == 0:
        return limit
    a = 1
    while a < limit and g % (2 * a) == 0:
        a *= 2
    return a


def is_channel_last(x: torch.Tensor) -> bool:
    """x [B, D, L] is the [B, L, D] memory transposed (a column slice of a wider buffer too)."""
    _, s_d, s_l = x.stride()
    return s_d == 1 and (s_l != 1 or x.shape[2] == 1)


def _silu_mode(silu: bool, x: torch.Tensor) -> int:
    """The kernels' SILU constexpr: 0 none, 1 silu (the interpreter runs no inline assembly), 2 silu
    on the approximate PTX exp2 and reciprocal (GPU: ~6 instructions per output instead of ~15,
    relative error ~1e-7, far below the bf16 / fp16 rounding of the output)."""
    return 0 if not silu else (2 if inline_asm_ok(x) else 1)


# Launchers. ALIGN (see _ALIGN_NOTE) is computed from the sizes and strides the kernel multiplies;
# a stride of a dimension of size 1 is left out: it is only ever multiplied by index 0 (other
# indices are masked), so the kernel may round it.


# Launch plans: the config pick, ALIGN and the grid depend only on sizes, strides, dtype and flags,
# so they are computed once per such key and reused (host time per call; see issue 19 item 0). The
# tuning hook (configs.forced_config) is part of the key; PDL is decided per call (a flag read).
_fn_plans = PlanCache("causal_conv1d_fn launch", 4096, when_full="clear")


def _fn_plan(x: torch.Tensor, W: int, xs: tuple, os_: tuple, silu: bool) -> tuple:
    """(channel_last, cfg, V, align, grid, SILU) for causal_conv1d_fn on x's sizes and strides."""
    B, D, L = x.shape
    interpreter = not x.is_cuda
    if is_channel_last(x):
        cfg = pick_rows_config(D, B * L, x.element_size(), interpreter=interpreter)
        _check_block_l(cfg.block_l, W)
        sized = [(D, True), (xs[0], B > 1), (xs[2], L > 1), (os_[0], B > 1), (os_[2], L > 1)]
        align = _align_hint(16 // x.element_size(), [v for v, used in sized if used])
        grid = (cdiv(D, cfg.block_d) * cdiv(L, cfg.block_l), B)
        return True, cfg, 0, align, grid, _silu_mode(silu, x)
    V = vector_width(x.element_size(), W)
    cfg = pick_cols_config(D, L, B, V, interpreter=interpreter)
    if cfg.block_l % V:
        raise ValueError(f"causal_conv1d_fn: BLOCK_L={cfg.block_l} must be a multiple of {V} tokens here")
    sized = [(L, True), (xs[0], B > 1), (xs[1], D > 1), (os_[0], B > 1), (os_[1], D > 1)]
    align = _align_hint(V, [v for v, used in sized if used]) if xs[2] == 1 else 1
    grid = (cdiv(L, cfg.block_l) * cdiv(D, cfg.block_d), B)
    return False, cfg, V, align, grid, _silu_mode(silu, x)


def causal_conv1d_fn_launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
    initial_states: torch.Tensor | None,
    final_states: torch.Tensor | None,
    out: torch.Tensor,
    silu: bool,
) -> None:
    """Launch on checked inputs: x, out [B, D, L]; states [B, D, W-1]; any strides."""
    B, D, L = x.shape
    W = weight.shape[1]
    if B == 0 or D == 0:
        return
    xs, os_ = x.stride(), out.stride()
    key = (B, D, L, xs, os_, x.dtype, W, silu, x.is_cuda, configs._forced.value)
    plan = _fn_plans.get(key)
    if plan is None:
        plan = _fn_plans.remember(key, _fn_plan(x, W, xs, os_, silu))
    channel_last, cfg, V, align, grid, silu_mode = plan

    def strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
        return t.stride() if t is not None else (0,) * n

    args = (
        x, weight, bias, seq_idx, initial_states, final_states, out, D, L,
        *xs, *weight.stride(), *strides(bias, 1), *strides(seq_idx, 2),
        *strides(initial_states, 3), *strides(final_states, 3), *os_,
    )
    if channel_last:
        use_pdl, early = pdl_launch_early(x)
        with on_device(x):
            lean(_conv1d_fwd_rows_kernel)[grid](
                *args, W=W, BLOCK_L=cfg.block_l, BLOCK_D=cfg.block_d, ALIGN=align, SILU=silu_mode,
                USE_PDL=use_pdl, PDL_TRIGGER=early, num_warps=cfg.num_warps, launch_pdl=use_pdl,
            )
        return
    use_pdl, early = pdl_launch(x, grid[0] * B, cfg.num_warps)
    with on_device(x):
        lean(_conv1d_fwd_cols_kernel)[grid](
            *args, W=W, V=V, BLOCK_L=cfg.block_l, BLOCK_D=cfg.block_d, ALIGN=align, SILU=silu_mode,
            USE_PDL=use_pdl, PDL_TRIGGER=early, num_warps=cfg.num_warps, launch_pdl=use_pdl,
        )


def _check_block_l(block_l: int, W: int) -> None:
    # a tile's halo must lie inside the tile before it, or only the first tile reads the history
    if block_l < W - 1:
        raise ValueError(f"BLOCK_L={block_l} must be >= W-1 = {W - 1}")
