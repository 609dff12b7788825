"""The snapshot-copy kernel (SSM rows from the scan's chunk states, conv states gathered from the
prefill's conv inputs, in one launch) and its launcher."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fastmamba.ops._common.host_math import cdiv, next_power_of_2
from fastmamba.ops._common.launch import lean, on_device
from fastmamba.ops._common.pdl import TRIGGER_EARLY, pdl_active

BLOCK = 4096  # SSM elements per program: 16 KB of fp32
BLOCK_E = 256  # conv channels per program
NUM_WARPS = 4


@triton.jit
def _snapshot_copy_kernel(conv_ptr, ssm_ptr, rows_ptr, xbc_ptr, tok_ptr, cs_ptr, crow_ptr,
                          E, W, HPN, n_ssm_blocks,
                          stride_conv_r, stride_conv_e, stride_conv_w, stride_ssm_r, stride_xbc_t, stride_xbc_e,
                          stride_tok_i, stride_tok_j, stride_cs_c,
                          BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_W: tl.constexpr,
                          USE_PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr):
    # program (snapshot, block): blocks below n_ssm_blocks copy BLOCK elements of the SSM row, the
    # rest gather BLOCK_E conv channels over all W columns
    if USE_PDL:  # the chunk states come from the scan just before
        gdc_wait()
        if PDL_TRIGGER:
            gdc_launch_dependents()
    i = tl.program_id(0)
    b = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    if b < n_ssm_blocks:  # a block of the SSM state, (H, P, N) flat
        crow = tl.load(crow_ptr + i).to(tl.int64)
        offs = b * BLOCK + tl.arange(0, BLOCK)
        inside = offs < HPN
        state = tl.load(cs_ptr + crow * stride_cs_c + offs, mask=inside)
        tl.store(ssm_ptr + row * stride_ssm_r + offs, state.to(ssm_ptr.dtype.element_ty), mask=inside)
    else:  # a block of conv channels, all W columns
        e = (b - n_ssm_blocks) * BLOCK_E + tl.arange(0, BLOCK_E)
        j = tl.arange(0, BLOCK_W)
        mj = j < W
        tok = tl.load(tok_ptr + i * stride_tok_i + j * stride_tok_j, mask=mj, other=0).to(tl.int64)
        tile = (e < E)[:, None] & mj[None, :]
        inputs = tl.load(xbc_ptr + tok[None, :] * stride_xbc_t + e[:, None] * stride_xbc_e, mask=tile)
        tl.store(conv_ptr + row * stride_conv_r + e[:, None] * stride_conv_e + j[None, :] * stride_conv_w,
                 inputs.to(conv_ptr.dtype.element_ty), mask=tile)


def launch_copy_snapshots(conv: torch.Tensor, ssm: torch.Tensor, rows: torch.Tensor, xbc: torch.Tensor,
                          conv_tokens: torch.Tensor, chunk_states: torch.Tensor, chunk_rows: torch.Tensor) -> None:
    """One launch for ``rows.shape[0] > 0`` snapshots whose SSM rows and chunk states are contiguous
    over (H, P, N); under PDL (a graphed prefill) it waits for the scan first."""
    n = rows.shape[0]
    E, W = conv.shape[1], conv.shape[2]
    HPN = math.prod(ssm.shape[1:])
    n_ssm = cdiv(HPN, BLOCK)
    grid = (n, n_ssm + cdiv(E, BLOCK_E))
    use_pdl = pdl_active(xbc, n * grid[1], NUM_WARPS)
    with on_device(xbc):
        lean(_snapshot_copy_kernel)[grid](
            conv, ssm, rows, xbc, conv_tokens, chunk_states, chunk_rows, E, W, HPN, n_ssm,
            *conv.stride(), ssm.stride(0), *xbc.stride(), *conv_tokens.stride(), chunk_states.stride(0),
            BLOCK=BLOCK, BLOCK_E=BLOCK_E, BLOCK_W=max(2, next_power_of_2(W)),
            USE_PDL=use_pdl, PDL_TRIGGER=TRIGGER_EARLY, num_warps=NUM_WARPS, launch_pdl=use_pdl,
        )
