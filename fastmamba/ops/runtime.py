"""What the runtime (layers, cache, models, generation, bench) needs from the ops beyond the drop-in calls.

``fastmamba.ops`` holds the public ops; this module is the one other door into them, for the few
op-side switches and bounds that a runtime built on the ops has to reach. Nothing outside
``fastmamba/ops`` imports an op's internals (``ops/_common``, ``ops/<op>/kernel.py`` ...); it imports
them from here, so an op can rearrange its files without touching its callers.

Trusted inputs, host values
    ``trusted_inputs()``: a block whose op calls skip the value checks that read device tensors on the
    host (slot ranges, cu_seqlens order): for callers that checked those values once where they
    entered. ``host_reads_allowed(t)``: whether reading ``t`` on the host is allowed now (not while a
    CUDA graph is being captured, under ``torch.compile`` or inside ``trusted_inputs()``).
    ``host_list(t)``: ``t.tolist()``, read afresh every call. ``check_host_copies(op, copies)``:
    ValueError when a caller's host copy of an index tensor has another length than the tensor.
CUDA graphs
    ``graph_capture(graph, pool)``: ``torch.cuda.graph`` with Python's garbage collector paused (a
    collection inside a capture can destroy another graph, which breaks the capture).
PDL (programmatic dependent launch)
    ``programmatic_dependent_launch()``: the block under which our kernels launch with PDL (graphs
    capture inside it); ``pdl_supported(t)``: whether ``t``'s GPU can (sm_90 or newer).
Which prefill kernels run
    ``hopper_kernels()``: calls inside take the Hopper chunk-output scan where it applies (graph
    warm-up and capture go inside one such block); ``long_prefill_kernels(tokens)``: the same for an
    eager prefill long enough to hide its host cost, else nothing.
Work bounds (grids sized without reading lengths, for graph capture)
    ``chunk_count_bound(tokens, n_seg, chunk_size)``: most scan chunks; ``NORM_SPAN``: the scan's
    columns per partial sum of squares (its deferred gated norm); ``GEMV_MAX_ROWS``: most rows of x
    one ``gemv`` call takes; ``cdiv`` and ``next_power_of_2`` on host ints.
Slot rows and slot errors
    ``scatter_rows(dst, slots, values)``: rows of a slot pool written through slot indices, pad slots
    skipped; ``raise_pending_slot_errors()``: raise the first bad slot index a kernel recorded on the
    device (checks that do not sync).
Dispatch
    ``interpreter_enabled()``: whether Triton's CPU interpreter is on (``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

from fastmamba.ops._common.checks import check_host_copies
from fastmamba.ops._common.dispatch import interpreter_enabled
from fastmamba.ops._common.graph_capture import graph_capture
from fastmamba.ops._common.host_math import cdiv, next_power_of_2
from fastmamba.ops._common.host_values import host_list, host_reads_allowed, trusted_inputs
from fastmamba.ops._common.pdl import pdl_supported, programmatic_dependent_launch
from fastmamba.ops._common.slot_errors import raise_pending_slot_errors
from fastmamba.ops._common.slot_rows import scatter_rows
from fastmamba.ops.gemv.configs import MAX_ROWS as GEMV_MAX_ROWS
from fastmamba.ops.ssd_scan.chunked.kernel_common import NORM_SPAN
from fastmamba.ops.ssd_scan.plan import chunk_count_bound
from fastmamba.ops.ssd_scan.hopper import hopper_kernels, long_prefill_kernels

__all__ = [
    "GEMV_MAX_ROWS", "NORM_SPAN", "cdiv", "check_host_copies", "chunk_count_bound", "graph_capture", "host_list",
    "host_reads_allowed", "hopper_kernels", "interpreter_enabled", "long_prefill_kernels", "next_power_of_2",
    "pdl_supported", "programmatic_dependent_launch", "raise_pending_slot_errors", "scatter_rows",
    "trusted_inputs",
]
