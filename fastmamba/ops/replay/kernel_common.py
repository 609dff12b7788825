"""What the replay kernels share: the @triton.jit pieces (a slot's history, the split bf16 dots,
the history replay, the state store) and the launchers' block-size, precision and TMA-view rules.

The kernels themselves: ``kernel.py`` (precompute + main, the one-kernel path and the module
docstring with the math), ``out_kernel.py`` and ``checkpoint_kernel.py`` (the split path),
``commit_kernel.py`` (commit, flush, reset of the per-slot counters).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastmamba.ops._common.dispatch import interpreter_enabled
from fastmamba.ops._common.jit_math import stochastic_round
from fastmamba.ops._common.host_math import next_power_of_2


@triton.jit
def _slot_history(buf_idx_ptr, hist_ptr, accepted_ptr, slot, capacity):
    """A slot's history: its read buffer (int64, 0 or 1: any other value reads as 1, so a corrupt
    buf_idx never addresses outside the double buffers) and k = hist_len + prev_accepted, clamped
    to [0, capacity] (the tokens to replay)."""
    k = tl.load(hist_ptr + slot).to(tl.int32) + tl.load(accepted_ptr + slot).to(tl.int32)
    rbuf = tl.where(tl.load(buf_idx_ptr + slot) != 0, 1, 0).to(tl.int64)
    return rbuf, tl.minimum(tl.maximum(k, 0), capacity)


@triton.jit
def _dot_split(a, b, acc, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + a @ b. SPLIT: ``a`` is fp32 and ``b`` holds exact bf16 values (bf16 activations); a
    is split into bf16 hi + lo parts and multiplied on bf16 tensor cores twice: ~16 mantissa bits
    of a (TF32 keeps 10), so the outputs round to the same bf16 values as an fp32 computation
    nearly always, and with half the operand registers of fp32/TF32 operands. Else one dot at
    DOT_PRECISION on fp32 operands."""
    if SPLIT:
        hi = a.to(tl.bfloat16)
        lo = (a - hi.to(tl.float32)).to(tl.bfloat16)
        bb = b.to(tl.bfloat16)
        acc = tl.dot(hi, bb, acc)
        acc = tl.dot(lo, bb, acc)
    else:
        acc = tl.dot(a, b.to(tl.float32), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _dot_split_rhs(a, b, acc, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + a @ b with the roles of ``_dot_split`` swapped: ``a`` exact bf16, ``b`` fp32 split."""
    if SPLIT:
        hi = b.to(tl.bfloat16)
        lo = (b - hi.to(tl.float32)).to(tl.bfloat16)
        aa = a.to(tl.bfloat16)
        acc = tl.dot(aa, hi, acc)
        acc = tl.dot(aa, lo, acc)
    else:
        acc = tl.dot(a.to(tl.float32), b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _history_weights(cum_row, dt_row, offs_c, mc, cum_last, stride_ocs_t, stride_odt_t):
    """The replay weights exp(cA_{k-1} - cA_c) dt'_c of history positions offs_c (0 where not mc)."""
    cum_old = tl.load(cum_row + offs_c * stride_ocs_t, mask=mc, other=0.0)
    dt_old = tl.load(dt_row + offs_c * stride_odt_t, mask=mc, other=0.0)
    return tl.where(mc, tl.exp(cum_last - cum_old) * dt_old, 0.0)


@triton.jit
def _replay_history(
    s, k, cum_last, cum_row, dt_row, x_row, B_hist, offs_p, mp, offs_n, mn,
    stride_ocs_t, stride_odt_t, stride_ox_t, stride_ox_p, stride_oB_t, stride_oB_n,
    BLOCK_H: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """s [BLOCK_P, BLOCK_N] (the stored state tile times exp(cA_{k-1})) plus the k history tokens,
    BLOCK_H per tl.dot:  s + (x_old * exp(cA_{k-1} - cA_c) dt'_c)^T @ B_old."""
    for c0 in range(0, k, BLOCK_H):
        offs_c = c0 + tl.arange(0, BLOCK_H)
        mc = offs_c < k
        w_old = _history_weights(cum_row, dt_row, offs_c, mc, cum_last, stride_ocs_t, stride_odt_t)
        x_old = tl.load(x_row + offs_p[:, None] * stride_ox_p + offs_c[None, :] * stride_ox_t,
                        mask=mp[:, None] & mc[None, :], other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_H]
        B_old = tl.load(B_hist + offs_c[:, None] * stride_oB_t + offs_n[None, :] * stride_oB_n,
                        mask=mc[:, None] & mn[None, :], other=0.0)  # [BLOCK_H, BLOCK_N]
        s = _dot_split(x_old * w_old[None, :], B_old, s, SPLIT, DOT_PRECISION)
    return s


@triton.jit
def _store_state(s, ptrs, mask, slot, h, nheads, offs_p, offs_n, seed_ptr,
                 P: tl.constexpr, N: tl.constexpr, STOCHASTIC_ROUND: tl.constexpr):
    """Store the fp32 tile s in the state's dtype: rounded to nearest, or stochastically with one
    random number per element, distinct across slots, heads and positions."""
    if STOCHASTIC_ROUND:
        elem = ((slot * nheads + h) * P + offs_p[:, None]) * N + offs_n[None, :]
        s_out = stochastic_round(s, tl.rand(tl.load(seed_ptr), elem.to(tl.int32)), ptrs.dtype.element_ty)
    else:
        s_out = s.to(ptrs.dtype.element_ty)
    tl.store(ptrs, s_out, mask=mask)


HISTORY_CHUNK = 16  # history tokens per replay tl.dot (its K dimension)
# On the GPU the output kernel takes a 16-bit state's C.S on 16-bit tensor cores, and the precompute
# kernel's C B^T and C B_hist^T are 16-bit dots on 16-bit operands (NATIVE16 there); the interpreter
# runs them as TF32 / fp32 dots. Measured against TF32 everywhere: docs/experiments.md (dev_replay_variants).


def dot_dim(n: int) -> int:
    """A block size for a dimension of n that tl.dot takes: a power of two, at least 16."""
    return max(16, next_power_of_2(n))


def _interpreting() -> bool:
    """The Triton CPU interpreter computes bf16 tl.dot wrongly (Triton 3.6): there the split bf16
    dots are replaced by the TF32 path on fp32 operands (the GPU tests cover the split)."""
    return interpreter_enabled()


def _dot_precision(dtype: torch.dtype, fp32: str) -> str:
    """16-bit activations: TF32 on fp32 operands (the 16-bit inputs are exact in TF32; the dt and
    decay weights keep 10 mantissa bits instead of 7). fp32 activations: ``fp32`` -- "ieee" where
    the FMA lowering is cheap (the precompute's small C B^T), "tf32x3" in the main kernel, whose
    "ieee" FMA dots spill at every tile size on sm_90 while tf32x3 is near-fp32 on tensor cores."""
    return fp32 if dtype == torch.float32 else "tf32"


def _tma_views_ok(tensors, x, N: int, block_p: int, rows: int) -> bool:
    """What both TMA kernels need: a CUDA device with TMA (sm_90+, not the interpreter), contiguous
    ``tensors`` at 16-byte-aligned addresses (their 2-d descriptor views), N a power of two, the head
    dim P of x a multiple of the P tile, and ``rows`` (the tallest view) within TMA's int32 coordinates."""
    if _interpreting() or not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors):
        return False
    return N == next_power_of_2(N) and x.shape[3] % block_p == 0 and rows < 2**31


def _view_desc(t, cols: int, block: list[int]):
    """A TMA descriptor over the contiguous t seen as a 2-d [numel / cols, cols] tensor, in blocks
    of ``block`` [rows, columns]: the TMA kernels' view of every tiled operand."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t.view(-1, cols), block)
