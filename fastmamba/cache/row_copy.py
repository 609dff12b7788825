"""One row of every layer of a stacked state pool into a row of another: a prefix-cache restore or save.

The state pools are stacked ``[n_layer, rows, *row_shape]`` (``StateCache.conv_stack`` /
``ssm_stack``, ``PrefixCache``'s), so the states of one slot are ``pool[:, row]``: n_layer
contiguous rows, a layer's stride apart. ``torch``'s ``dst[:, a].copy_(src[:, b])`` does that copy,
but a pool of more than 2**31 elements (the SSM stack of mamba2-2.7b with 65 slots: 2.7e9) makes
its TensorIterator split the copy into kernels that each fit 32-bit indexing, ~75 µs of host time
per pool on an H200 host, on a prefix-cache hit's path to its first token. ``copy_rows`` is one
Triton launch per pool pair (64-bit layer offsets), a few µs of host time, at the copy bandwidth.

Reference: ``copy_rows_ref`` (the torch copy), which CPU tensors take without the interpreter and
any pair the kernel does not cover (different dtypes, rows that are not contiguous).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from fastmamba.ops._common.dispatch import use_triton
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


def copy_rows_ref(dst: Sequence[torch.Tensor], dst_row: int, src: Sequence[torch.Tensor], src_row: int) -> None:
    """``dst[k][:, dst_row] = src[k][:, src_row]`` for each pool pair k, with torch's copy."""
    for d, s in zip(dst, src):
        d[:, dst_row].copy_(s[:, src_row])


def rows_contiguous(t: torch.Tensor, lead: int = 2) -> bool:
    """Whether each row ``t[i_0, ..., i_{lead-1}]`` of a pool (a stacked pool's rows: ``lead`` 2) is
    one contiguous run of elements (the leading strides may be anything). From the shape and stride
    tuples: no views (a view costs microseconds, and this runs on a prefix-cache hit's path)."""
    expect = 1
    for n, st in zip(reversed(t.shape[lead:]), reversed(t.stride()[lead:])):
        if n != 1 and st != expect:
            return False
        expect *= n
    return True


def _kernel_covers(d: torch.Tensor, s: torch.Tensor) -> bool:
    """Same dtype and device, same layer count and row shape, rows contiguous inside both pools."""
    return (d.dtype == s.dtype and d.device == s.device and d.dim() >= 2 and d.shape[0] == s.shape[0]
            and d.shape[2:] == s.shape[2:] and rows_contiguous(d) and rows_contiguous(s))


def copy_rows(dst: Sequence[torch.Tensor], dst_row: int, src: Sequence[torch.Tensor], src_row: int) -> None:
    """``dst[k][:, dst_row] = src[k][:, src_row]`` for each stacked pool pair k ([n_layer, rows,
    *row_shape], same n_layer and row shape): all layers' states of one row, one launch per pair.
    Rows are checked (TypeError for a non-int, IndexError outside a pool's rows) before anything is copied."""
    if len(dst) != len(src):
        raise ValueError(f"copy_rows: {len(dst)} destination pools for {len(src)} source pools")
    for d, s in zip(dst, src):
        for name, t, r in (("dst_row", d, dst_row), ("src_row", s, src_row)):
            if not isinstance(r, int) or isinstance(r, bool):
                raise TypeError(f"copy_rows: {name} expected an int, got {type(r).__name__}")
            if not 0 <= r < t.shape[1]:
                raise IndexError(f"copy_rows: {name} {r} outside [0, {t.shape[1]}) of a pool of shape {tuple(t.shape)}")
    for d, s in zip(dst, src):
        if not (use_triton(d) and _kernel_covers(d, s)):
            copy_rows_ref([d], dst_row, [s], src_row)
            continue
        n_layer, n_elem = d.shape[0], math.prod(d.shape[2:])
        if n_layer == 0 or n_elem == 0:
            continue
        with on_device(d):
            lean(_copy_rows_kernel)[(cdiv(n_elem, BLOCK), n_layer)](
                d, s, n_elem, dst_row, src_row, d.stride(1), s.stride(1), d.stride(0), s.stride(0), BLOCK=BLOCK)
