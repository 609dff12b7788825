"""The row-copy kernel: one row of every layer of a stacked pool, 64-bit layer offsets, and its launcher."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fastmamba.ops._common.host_math import cdiv
from fastmamba.ops._common.launch import lean, on_device

BLOCK = 4096  # elements per program: 16 KB of fp32


# the rows are not specialized (one compiled kernel and one lean-launch entry for every row); the
# strides are, so Triton sees 16-element alignment and vectorizes the copy
@triton.jit(do_not_specialize=["dst_row", "src_row"])
def _copy_rows_kernel(dst_ptr, src_ptr, n_elem, dst_row, src_row, dst_row_stride, src_row_stride,
                      dst_layer_stride, src_layer_stride, BLOCK: tl.constexpr):
    # program (block of the row, layer): dst[layer, dst_row, block] = src[layer, src_row, block]
    layer = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elem
    src = src_ptr + src_row.to(tl.int64) * src_row_stride + layer * src_layer_stride
    dst = dst_ptr + dst_row.to(tl.int64) * dst_row_stride + layer * dst_layer_stride
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def launch_copy_rows(d: torch.Tensor, dst_row: int, s: torch.Tensor, src_row: int) -> None:
    """``d[:, dst_row] = s[:, src_row]`` for one pool pair the kernel covers (same dtype, device, layer
    count and row shape; each row one contiguous run): one launch, none for an empty pool."""
    n_layer, n_elem = d.shape[0], math.prod(d.shape[2:])
    if n_layer == 0 or n_elem == 0:
        return
    with on_device(d):
        lean(_copy_rows_kernel)[(cdiv(n_elem, BLOCK), n_layer)](
            d, s, n_elem, dst_row, src_row, d.stride(1), s.stride(1), d.stride(0), s.stride(0), BLOCK=BLOCK)
