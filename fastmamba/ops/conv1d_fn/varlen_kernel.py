"""The varlen conv's Triton kernel (``_conv1d_varlen_kernel``: the rows kernel of ``kernel.py``
over packed sequences, history from a state-cache slot that it then overwrites) and its launcher.
The module docstring of ``kernel.py`` has the math, the PDL rules and who writes the state."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fastmamba.ops._common.jit_math import SILU_PTX
from fastmamba.ops._common.pdl import pdl_launch
from fastmamba.ops._common.plans import PlanCache
from fastmamba.ops.conv1d_fn import configs
from fastmamba.ops.conv1d_fn.configs import pick_rows_config
from fastmamba.ops.conv1d_fn.kernel import _align_hint, _check_block_l, _load_taps, _silu_mode
from fastmamba.ops._common.launch import lean, on_device
from fastmamba.ops._common.host_math import cdiv


@triton.heuristics(
    {
        "HAS_BIAS": lambda args: args["bias_ptr"] is not None,
        "HAS_INDICES": lambda args: args["indices_ptr"] is not None,
        "HAS_INIT_FLAGS": lambda args: args["has_init_ptr"] is not None,
    }
)
@triton.jit(do_not_specialize=["T", "S", "B", "search_steps", "pad_slot_id"])
def _conv1d_varlen_kernel(
    x_ptr,  # [T, D]
    weight_ptr,  # [D, W]
    bias_ptr,  # [D] or None
    state_ptr,  # [S, D, SL]; the sequences' slots are mutated in place
    cu_ptr,  # [B+1] int32/int64
    indices_ptr,  # [B] int32/int64 or None
    has_init_ptr,  # [B] bool/int or None
    out_ptr,  # [T, D]; written
    D, T, S, B, search_steps, pad_slot_id,
    stride_x_t, stride_x_d,
    stride_weight_d, stride_weight_w,
    stride_bias_d,
    stride_state_s, stride_state_d, stride_state_l,
    stride_cu, stride_indices_b, stride_has_init_b,
    stride_out_t, stride_out_d,
    W: tl.constexpr,  # conv width, 2..6
    SL: tl.constexpr,  # state_len >= W-1
    BLOCK_L: tl.constexpr,  # >= W-1
    BLOCK_D: tl.constexpr,
    ALIGN: tl.constexpr,  # D and the x / out token strides are multiples of ALIGN (vector hint)
    SILU: tl.constexpr,  # 0: none, 1: silu, 2: silu with the approximate PTX exp2 / reciprocal (GPU)
    HAS_BIAS: tl.constexpr,
    HAS_INDICES: tl.constexpr,
    HAS_INIT_FLAGS: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch: wait for the kernel before (sm_90+)
    PDL_TRIGGER: tl.constexpr = False,  # ... and let the next kernel launch right after the wait
):
    # one program per (block of BLOCK_D channels, tile of BLOCK_L tokens of one sequence); sequence
    # b owns programs g_b .. g_b + max(1, cdiv(len_b, BLOCK_L)) - 1 with g_b = cu_seqlens[b] // BLOCK_L + b,
    # so there are T // BLOCK_L + B of them and a few idle ones
    if ALIGN > 1:  # see _ALIGN_NOTE
        D = D // ALIGN * ALIGN
        stride_x_t = stride_x_t // ALIGN * ALIGN
        stride_out_t = stride_out_t // ALIGN * ALIGN
    pid = tl.program_id(0)
    n_d = tl.cdiv(D, BLOCK_D)
    pid_d = pid % n_d
    p = pid // n_d

    if USE_PDL:  # cu_seqlens, x and the cache may come from the kernel before: see fastmamba.ops._common.pdl
        gdc_wait()
        if PDL_TRIGGER:
            gdc_launch_dependents()
    # ---- which sequence: the largest b with g_b <= p (binary search, g is increasing) -------------
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + B
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        g = tl.load(cu_ptr + mid * stride_cu).to(tl.int32) // BLOCK_L + mid
        take = g <= p
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid)
    b = lo.to(tl.int64)
    # clamped into [0, T]: unchecked cu_seqlens (trusted_inputs, graph capture, torch.compile) never
    # make a program read or write outside x and out; checked ones are unchanged by the clamp
    start = tl.minimum(tl.maximum(tl.load(cu_ptr + b * stride_cu).to(tl.int64), 0), T)
    end = tl.minimum(tl.maximum(tl.load(cu_ptr + (b + 1) * stride_cu).to(tl.int64), start), T)
    n = (end - start).to(tl.int32)
    j = p - ((start // BLOCK_L).to(tl.int32) + lo)  # tile within the sequence (< 0 only for bad cu_seqlens)
    if (j < 0) | ((j > 0) & (j * BLOCK_L >= n)):
        return  # idle program (tile 0 always runs: it writes the state even for an empty sequence)
    l0 = j * BLOCK_L  # first token of the tile, within the sequence

    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < D
    # token r of the sequence: x_rows + r * stride_x_t
    x_rows = x_ptr + start * stride_x_t + d * stride_x_d
    out_rows = out_ptr + start * stride_out_t + d * stride_out_d
    if HAS_INDICES:
        slot = tl.load(indices_ptr + b * stride_indices_b).to(tl.int64)
        # padding, and any slot outside [0, S) (unchecked indices): zero outputs, no state read or written
        if (slot == pad_slot_id) | (slot < 0) | (slot >= S):
            zero = tl.zeros([BLOCK_D], dtype=out_ptr.dtype.element_ty)
            for t in tl.static_range(BLOCK_L):
                tl.store(out_rows + (l0 + t) * stride_out_t, zero, mask=d_mask & (l0 + t < n))
            return
    else:
        slot = b
    state_rows = state_ptr + slot * stride_state_s + d * stride_state_d
    if HAS_INIT_FLAGS:
        has_init = tl.load(has_init_ptr + b * stride_has_init_b) != 0

    taps = _load_taps(weight_ptr, d, d_mask, stride_weight_d, stride_weight_w, W)
    if HAS_BIAS:
        acc0 = tl.load(bias_ptr + d * stride_bias_d, mask=d_mask, other=0.0).to(tl.float32)
    else:
        acc0 = tl.zeros([BLOCK_D], dtype=tl.float32)

    # ---- window rows l0-(W-1) .. l0+BLOCK_L-1; before the sequence: state columns SL+r, or zeros ---
    win = ()
    for i in tl.static_range(W - 1 + BLOCK_L):
        r = l0 - (W - 1) + i
        if i < W - 1:
            v = tl.load(x_rows + r * stride_x_t, mask=d_mask & (r >= 0), other=0.0).to(tl.float32)
            if HAS_INIT_FLAGS:
                v0 = tl.load(state_rows + (SL + r) * stride_state_l, mask=d_mask & (r < 0) & has_init, other=0.0)
                v = tl.where(r >= 0, v, v0.to(tl.float32))
        else:
            v = tl.load(x_rows + r * stride_x_t, mask=d_mask & (r < n), other=0.0)
        win = win + (v,)

    for t in tl.static_range(BLOCK_L):
        acc = acc0
        for k in tl.static_range(W):
            acc += taps[k] * win[t + k].to(tl.float32)
        # silu inlined (a jit call per row costs milliseconds in the interpreter); 2: approximate PTX
        if SILU == 2:
            acc = tl.inline_asm_elementwise(SILU_PTX, "=f,f", [acc], dtype=tl.float32, is_pure=True, pack=1)
        elif SILU == 1:
            acc = acc / (1.0 + tl.exp(-acc))
        y = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_rows + (l0 + t) * stride_out_t, y, mask=d_mask & (l0 + t < n))

    # ---- new state = last SL columns of [history (SL) | x_seq], by the first tile's program --------
    if j == 0:
        news = ()
        for c in tl.static_range(SL):
            e = n + c  # column of [history | x_seq]
            new = tl.load(x_rows + (e - SL) * stride_x_t, mask=d_mask & (e >= SL), other=0.0)
            new = new.to(tl.float32)
            if HAS_INIT_FLAGS:  # a sequence shorter than SL keeps part of the old state
                old = tl.load(state_rows + e * stride_state_l, mask=d_mask & (e < SL) & has_init, other=0.0)
                new = tl.where(e >= SL, new, old.to(tl.float32))
            news = news + (new,)
        tl.debug_barrier()  # every old-state read (halo, kept columns) before the first write
        for c in tl.static_range(SL):
            tl.store(state_rows + c * stride_state_l, news[c].to(state_ptr.dtype.element_ty), mask=d_mask)


# Launch plans, as kernel.py's _fn_plans: computed once per (sizes, strides, dtype, flags) key.
_varlen_plans = PlanCache("causal_conv1d_varlen launch", 4096, when_full="clear")


def _varlen_plan(x: torch.Tensor, B: int, W: int, xs: tuple, os_: tuple, silu: bool) -> tuple:
    """(cfg, align, grid, SILU) for causal_conv1d_varlen on x's sizes and strides."""
    T, D = x.shape
    cfg = pick_rows_config(D, T, x.element_size(), interpreter=not x.is_cuda, varlen=True)
    _check_block_l(cfg.block_l, W)
    sized = [(D, True), (xs[0], T > 1), (os_[0], T > 1)]
    align = _align_hint(16 // x.element_size(), [v for v, used in sized if used])
    grid = (cdiv(D, cfg.block_d) * (T // cfg.block_l + B),)
    return cfg, align, grid, _silu_mode(silu, x)


def causal_conv1d_varlen_launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cache_indices: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    out: torch.Tensor,
    silu: bool,
    pad_slot_id: int,
) -> None:
    """Launch on checked inputs: x, out [T, D]; conv_states [S, D, state_len]; any strides. Reads
    no index value on the host (the grid comes from T and B)."""
    T, D = x.shape
    B = cu_seqlens.shape[0] - 1
    W = weight.shape[1]
    S, _, state_len = conv_states.shape
    if B == 0 or D == 0:
        return
    xs, os_ = x.stride(), out.stride()
    key = (T, D, B, xs, os_, x.dtype, W, silu, x.is_cuda, configs._forced.value)
    plan = _varlen_plans.get(key)
    if plan is None:
        plan = _varlen_plans.remember(key, _varlen_plan(x, B, W, xs, os_, silu))
    cfg, align, grid, silu_mode = plan
    use_pdl, early = pdl_launch(x, grid[0], cfg.num_warps)

    def stride0(t: torch.Tensor | None) -> int:
        return t.stride(0) if t is not None else 0

    with on_device(x):
        lean(_conv1d_varlen_kernel)[grid](
            x, weight, bias, conv_states, cu_seqlens, cache_indices, has_initial_state, out,
            D, T, S, B, (B - 1).bit_length(), pad_slot_id,
            *xs, *weight.stride(), stride0(bias), *conv_states.stride(),
            stride0(cu_seqlens), stride0(cache_indices), stride0(has_initial_state), *os_,
            W=W, SL=state_len, BLOCK_L=cfg.block_l, BLOCK_D=cfg.block_d, ALIGN=align, SILU=silu_mode,
            USE_PDL=use_pdl, PDL_TRIGGER=early, num_warps=cfg.num_warps, launch_pdl=use_pdl,
        )
