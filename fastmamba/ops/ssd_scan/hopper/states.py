"""When and how the chunked scan's chunk states and state passing run as one Hopper kernel
(``states_kernel.py``) instead of the two Triton kernels.

It runs where the Hopper chunk-output kernel runs (``hopper.hopper_chunk_output_ok``: sm_90, 16-bit
activations, head dim 64, N 64 or 128, TMA-addressable rows, inside ``hopper_kernels()`` by default),
when B's rows are TMA-addressable too, ``chunk_out`` (the state after every chunk: the prefix cache's)
is None or contiguous, and the final states are not rounded stochastically. The two Triton kernels stay
the portable, interpreter-tested path and take every other call.
``FASTMAMBA_HOPPER_STATES=0`` keeps them on the Hopper path too (A/B timing).

Measured (H200, one CUDA graph of the captured launches, `.ab`-style, 2026-11-27): chunk states + state
passing, fp32 / bf16 chunk states, against the fused kernel (its S_in in x's dtype, S in fp32 registers):
2.7b shape L=2048 25.7 / 22.8 -> 17.6 us, L=8192 96.0 / 81.9 -> 59.9 us; Nemotron-H shape (128 heads,
8 groups) L=2048 41.5 / 34.2 -> 20.1 us, L=8192 153.7 / 121.9 -> 66.2 us.
"""
from __future__ import annotations

import functools

import torch

from fastmamba.ops._common.launch import env_switch, lean, register_descriptor_type
from fastmamba.ops._common.pdl import pdl_chained
from fastmamba.ops.ssd_scan.hopper.chunk_output import _desc, _rows2d, _tma_rows
from fastmamba.ops.ssd_scan.chunked.kernel_common import strides4

STAGES = 4  # (x, B) ring slots of 64 tokens (6 and 3 measured no better)
PRODUCER_REGS = 56
MAXNREG = 128  # two programs per SM (8 warps each: the producer's warpgroup pads to four)


@functools.cache
def _gluon():
    """The kernel's lean launcher and the host TensorDescriptor class, or None without Gluon."""
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        from fastmamba.ops.ssd_scan.hopper import states_kernel as hopper_states_kernel
    except ImportError:
        return None
    register_descriptor_type(TensorDescriptor)
    return lean(hopper_states_kernel.chunk_states_sm90_kernel), TensorDescriptor, gl


def _chunk_out_desc(TensorDescriptor, gl, chunk_out: torch.Tensor):
    """chunk_out [C, H, P, N] as [C * H * P, N] in [64, 64] boxes, unswizzled (an fp32 row of 64 is wider
    than the 128-byte swizzle)."""
    C, H, P, N = chunk_out.shape
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * chunk_out.element_size())
    return _desc(TensorDescriptor, gl, chunk_out.view(C * H * P, N), (64, 64), layout)


def _enabled() -> bool:
    """FASTMAMBA_HOPPER_STATES (default on), read at every call: the tests and A/B runs flip it."""
    return env_switch("FASTMAMBA_HOPPER_STATES", True)


def hopper_states_ok(x: torch.Tensor, B: torch.Tensor, *, chunk_out: torch.Tensor | None,
                     final_seed: torch.Tensor | None) -> bool:
    """Whether a call whose chunk output runs on the Hopper kernel takes this one for its states too
    (x [R, L, H, P], B [R, L, G, N]). Raises on a bad ``FASTMAMBA_HOPPER_STATES`` before anything runs."""
    if not _enabled():
        return False
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16) or x.shape[3] != 64:
        return False
    if final_seed is not None:
        return False
    if chunk_out is not None and not (chunk_out.is_contiguous() and chunk_out.data_ptr() % 16 == 0):
        return False
    if B.dtype != x.dtype or B.shape[3] % 64 or not _tma_rows(B):
        return False
    return _gluon() is not None


def chunk_states_sm90(x, B, states_in, dt_scratch, cs_scratch, table, cu, skip, init, init_idx, final, final_idx,
                      seg_final, chunk_out, *, chunk_size: int, block_seg: int) -> None:
    """S_in of every chunk (states_in [chunk slots, H, P, N], x's dtype), the state after every chunk
    (chunk_out [>= chunk slots, H, P, N] contiguous, or None) and the final states: x [R, L, H, P],
    B [R, L, G, N]; dt' / cs scratch [H, chunk slots, Q] fp32 and table [chunk slots, 4] int32 (the prep
    kernel's); cu [n_seg + 1]; skip [n_seg] int8 or None; init / final [slots, H, P, N] with init_idx /
    final_idx [n_seg] int32, seg_final [n_seg, H, P, N], each or None."""
    kernel, TensorDescriptor, gl = _gluon()
    R, L, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    n_seg = cu.shape[0] - 1
    n_slots = states_in.shape[0]
    descs = [
        _desc(TensorDescriptor, gl, _rows2d(x), (64, 64)),
        _desc(TensorDescriptor, gl, _rows2d(B), (64, 64)),
        _desc(TensorDescriptor, gl, states_in.view(n_slots * H * P, N), (64, 64)),
        None if chunk_out is None else _chunk_out_desc(TensorDescriptor, gl, chunk_out),
    ]
    programs = n_seg * H * (N // 64)
    use_pdl = pdl_chained(x, programs, 8)
    kernel[(programs,)](
        *descs, cu, skip, cs_scratch, dt_scratch, table, init, init_idx, final, final_idx, seg_final,
        n_seg, H, H // G, N, dt_scratch.shape[1], *strides4(init), *strides4(final), *strides4(seg_final),
        Q=chunk_size, BLOCK_SEG=block_seg, K_STAGES=STAGES, PRODUCER_REGS=PRODUCER_REGS,
        HAS_SKIP=skip is not None, HAS_INIT=init is not None, HAS_FINAL=final is not None,
        HAS_SEG_FINAL=seg_final is not None, HAS_CHUNK_OUT=chunk_out is not None, USE_PDL=use_pdl,
        launch_pdl=use_pdl, num_warps=4, maxnreg=MAXNREG,
    )
