"""A Mamba layer's prefix-cache snapshots of one prefill, copied into the cache's pools by one kernel.

During a prefill that takes snapshots (``LayerSnapshot``: prefix caching), snapshot i of a layer is

    ssm[rows[i]]           = chunk_states[chunk_rows[i]]              (the scan's state after that chunk)
    conv[rows[i]][:, j]    = xbc[conv_tokens[i, j]]  for j < W        (the conv inputs of its last W tokens)

in the pools' dtypes. Written as torch indexing that is four kernels a layer (two gathers into
temporaries, two scatters), ~29 us of a 2048-token prefill's layer on an H200 with four snapshots,
and kernels without programmatic dependent launch in the middle of a graph whose kernels have it.
``copy_snapshots`` is one launch: programs (snapshot, block of the SSM row) copy the state, programs
(snapshot, block of conv channels) gather the conv inputs; under PDL (a graphed prefill) they wait
for the scan first. Rows may repeat (a graph pads its count by repeating a snapshot): the same values
land twice.

Reference: ``fastmamba.ops.snapshot_copy.ref.copy_snapshots_ref`` (the torch indexing), which CPU
tensors take without the interpreter and which pools the kernel does not cover take (an SSM row or
chunk state that is not contiguous over (H, P, N)).
"""
from __future__ import annotations

import torch

from fastmamba.ops._common.dispatch import use_triton
from fastmamba.ops.row_copy.api import rows_contiguous
from fastmamba.ops.snapshot_copy.kernel import launch_copy_snapshots
from fastmamba.ops.snapshot_copy.ref import copy_snapshots_ref


def copy_snapshots(conv: torch.Tensor, ssm: torch.Tensor, rows: torch.Tensor, xbc: torch.Tensor,
                   conv_tokens: torch.Tensor, chunk_states: torch.Tensor, chunk_rows: torch.Tensor) -> None:
    """Copy n snapshots of one layer into its pools (indices trusted: the caller built them from a
    checked plan, ``prefix_cache.snapshot_indices``).

    conv          [R, E, W]     pool, any float dtype; rows ``rows`` written in place
    ssm           [R, H, P, N]  pool, any float dtype; rows ``rows`` written in place
    rows          [n] int       destination rows (may repeat, with the same source)
    xbc           [T, E]        read: the conv's inputs of the prefill (a column view of in_proj's output)
    conv_tokens   [n, W] int    packed token rows whose inputs form each snapshot's conv state
    chunk_states  [C, H, P, N]  read: the scan's state after every chunk (``chunk_states_out``)
    chunk_rows    [n] int       row of chunk_states for each snapshot
    Reference: fastmamba.ops.snapshot_copy.ref.copy_snapshots_ref
    """
    if rows.shape[0] == 0:
        return
    if not (use_triton(xbc) and rows_contiguous(ssm, 1) and rows_contiguous(chunk_states, 1)):
        copy_snapshots_ref(conv, ssm, rows, xbc, conv_tokens, chunk_states, chunk_rows)
        return
    launch_copy_snapshots(conv, ssm, rows, xbc, conv_tokens, chunk_states, chunk_rows)
