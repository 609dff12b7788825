"""One row of every layer of a stacked state pool into a row of another: a prefix-cache restore or save.

The state pools are stacked ``[n_layer, rows, *row_shape]`` (``StateCache.conv_stack`` /
``ssm_stack``, ``PrefixCache``'s), so the states of one slot are ``pool[:, row]``: n_layer
contiguous rows, a layer's stride apart. ``torch``'s ``dst[:, a].copy_(src[:, b])`` does that copy,
but a pool of more than 2**31 elements (the SSM stack of mamba2-2.7b with 65 slots: 2.7e9) makes
its TensorIterator split the copy into kernels that each fit 32-bit indexing, ~75 µs of host time
per pool on an H200 host, on a prefix-cache hit's path to its first token. ``copy_rows`` is one
Triton launch per pool pair (64-bit layer offsets), a few µs of host time, at the copy bandwidth.

Reference: ``fastmamba.ops.row_copy.ref.copy_rows_ref`` (the torch copy), which CPU tensors take
without the interpreter and any pair the kernel does not cover (different dtypes, rows that are not
contiguous).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from fastmamba.ops._common.dispatch import use_triton
from fastmamba.ops.row_copy.kernel import launch_copy_rows
from fastmamba.ops.row_copy.ref import copy_rows_ref


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
    """``dst[k][:, dst_row] = src[k][:, src_row]`` for each stacked pool pair k: all layers' states of
    one row, one launch per pair.

    dst[k]   [n_layer, R_dst, *row_shape]  any dtype; row ``dst_row`` written in place, other rows untouched
    src[k]   [n_layer, R_src, *row_shape]  read; a dtype other than dst[k]'s is cast (torch's copy)
    dst_row, src_row  int in [0, R_dst) / [0, R_src) of every pool
    Rows are checked (TypeError for a non-int, IndexError outside a pool's rows; ValueError for pool
    lists of different lengths) before anything is copied.
    Reference: fastmamba.ops.row_copy.ref.copy_rows_ref
    """
    if len(dst) != len(src):
        raise ValueError(f"copy_rows: {len(dst)} destination pools for {len(src)} source pools")
    for d, s in zip(dst, src):
        for name, t, r in (("dst_row", d, dst_row), ("src_row", s, src_row)):
            if not isinstance(r, int) or isinstance(r, bool):
                raise TypeError(f"copy_rows: {name} expected an int, got {type(r).__name__}")
            if not 0 <= r < t.shape[1]:
                raise IndexError(f"copy_rows: {name} {r} outside [0, {t.shape[1]}) of a pool of shape {tuple(t.shape)}")
    for d, s in zip(dst, src):
        if use_triton(d) and _kernel_covers(d, s):
            launch_copy_rows(d, dst_row, s, src_row)
        else:
            copy_rows_ref([d], dst_row, [s], src_row)
