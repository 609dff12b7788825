"""The scan's plan on the host: how many chunks a call cuts its sequences into (exact from
cu_seqlens, or a bound where the op may not read it), where each sequence's chunks start, the
cu_seqlens check (one host read serves the check, the chunk count and the fused path's length
bound) and the segment tables of dense calls. The entries that use them: ``api.py``."""
from __future__ import annotations

import torch

from fastmamba.ops._common.checks import INDEX_DTYPES, check_dtype
from fastmamba.ops._common.host_values import host_list, host_reads_allowed
from fastmamba.ops._common.host_math import cdiv


def num_chunks(cu_seqlens: torch.Tensor, chunk_size: int) -> int:
    """How many chunks the scan cuts the packed sequences into (chunks never cross a boundary).

    Reads cu_seqlens on the host (once per tensor version). Chunk k of sequence b has index
    ``chunk_offsets(cu_seqlens, chunk_size)[b] + k`` in ``chunk_states_out``.
    """
    return _count_chunks(host_list(cu_seqlens), chunk_size)


def _count_chunks(cu: list[int], chunk_size: int) -> int:
    return sum(cdiv(int(b) - int(a), chunk_size) for a, b in zip(cu[:-1], cu[1:]))


def chunk_count_bound(tokens: int, n_seg: int, chunk_size: int) -> int:
    """The most chunks ``n_seg`` sequences of ``tokens`` tokens in all can be cut into, without their
    lengths: sum ceil(l / Q) <= sum (l + Q - 1) / Q = (tokens + n_seg (Q - 1)) / Q. Exact for one
    sequence; the scan sizes its grids with it where it may not read cu_seqlens (graph capture)."""
    return (tokens + n_seg * (chunk_size - 1)) // chunk_size


def chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B] index of each sequence's first chunk in ``chunk_states_out`` (computed on the device)."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    n = torch.div(lens + chunk_size - 1, chunk_size, rounding_mode="floor")
    return torch.cumsum(n, 0) - n


def _check_cu_seqlens(op: str, cu_seqlens: torch.Tensor, total: int, read: bool = True) -> list[int] | None:
    """Shape and dtype; where host reads are allowed (and ``read``) also the values, which it
    returns (one read serves the check, the chunk count and the fused path's length bound), else None."""
    check_dtype(op, "cu_seqlens", cu_seqlens, INDEX_DTYPES)
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"{op}: `cu_seqlens` expected shape (B+1,) with B >= 1, got {tuple(cu_seqlens.shape)}")
    if not read or not host_reads_allowed(cu_seqlens):
        return None
    values = host_list(cu_seqlens)
    if values[0] != 0 or values[-1] != total or any(b < a for a, b in zip(values[:-1], values[1:])):
        shown = values if len(values) <= 10 else values[:5] + ["..."] + values[-3:]
        raise ValueError(
            f"{op}: `cu_seqlens` must start at 0, never decrease and end at the token count {total}; got {shown}"
        )
    return values

# Segment tables of dense calls (one sequence per row), by (rows, length, device): constant index
# tensors the kernels only read, made once instead of three small launches per call (issue 19).
_DENSE_SEGMENTS: dict = {}


def _dense_segments(nb: int, L: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cu [nb+1] = 0, L, 2L, ..., row of each segment [nb] = 0..nb-1, [nb] of -1), cached; made
    outside any CUDA-graph capture's pool where possible (a capture only reads them)."""
    key = (nb, L, dev)
    seg = _DENSE_SEGMENTS.get(key)
    if seg is None:
        seg = (torch.arange(0, nb * L + 1, L, dtype=torch.int32, device=dev),
               torch.arange(nb, dtype=torch.int32, device=dev),
               torch.full((nb,), -1, dtype=torch.int32, device=dev))
        if len(_DENSE_SEGMENTS) < 256 and not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _DENSE_SEGMENTS[key] = seg
    return seg


def _dense_call_segments(nb: int, L: int, dev: torch.device, seq_idx: torch.Tensor | None,
                         cu_seqlens: torch.Tensor | None, chunk_size: int, read_cu_seqlens: bool) -> tuple:
    """The segments of a dense call (x [nb, L, H, P]) in the flat token space f = row * L + position:
    (cu [n_seg+1], the chunk count, row of each segment [n_seg], first / last segment of its row
    [n_seg] bool or None, [n_seg] of -1). From cu_seqlens (one row; its chunk count read on the host
    only where ``read_cu_seqlens``, else bounded), the runs of equal seq_idx (read on the host), or
    one segment per row (cached tables)."""
    if cu_seqlens is not None:
        cu = cu_seqlens
        n_seg = cu.shape[0] - 1
        first_of_row = torch.zeros(n_seg, dtype=torch.bool, device=dev)
        first_of_row[0] = True
        last_of_row = torch.zeros(n_seg, dtype=torch.bool, device=dev)
        last_of_row[-1] = True
        row_of_seg = torch.zeros(n_seg, dtype=torch.int32, device=dev)
        # the exact chunk count needs a host read; where the caller may not read (decided when it
        # called, so a compiled graph keeps its answer), an upper bound
        n_chunks = num_chunks(cu, chunk_size) if read_cu_seqlens else chunk_count_bound(L, n_seg, chunk_size)
    elif seq_idx is not None:
        bounds, rows, firsts, lasts = [], [], [], []
        ids = seq_idx.tolist()
        for b in range(nb):
            cuts = [0] + [t for t in range(1, L) if ids[b][t] != ids[b][t - 1]] + [L]
            for k, (s, e) in enumerate(zip(cuts[:-1], cuts[1:])):
                bounds.append(b * L + s)
                rows.append(b)
                firsts.append(k == 0)
                lasts.append(e == L)
        bounds.append(nb * L)
        cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
        row_of_seg = torch.tensor(rows, dtype=torch.int32, device=dev)
        first_of_row = torch.tensor(firsts, dtype=torch.bool, device=dev)
        last_of_row = torch.tensor(lasts, dtype=torch.bool, device=dev)
        n_chunks = sum(cdiv(e - s, chunk_size) for s, e in zip(bounds[:-1], bounds[1:]))
    else:
        cu, row_of_seg, none = _dense_segments(nb, L, dev)
        first_of_row = last_of_row = None
        n_chunks = nb * cdiv(L, chunk_size)
    n_seg = cu.shape[0] - 1
    if cu_seqlens is not None or seq_idx is not None:
        none = torch.full((n_seg,), -1, dtype=torch.int32, device=dev)
    return cu, n_chunks, row_of_seg, first_of_row, last_of_row, none
