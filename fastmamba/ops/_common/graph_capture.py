"""CUDA-graph capture with Python's garbage collector paused.

A collection that runs while a graph is being captured can free cyclic garbage that holds another
CUDA graph (an engine or a provider dropped earlier); its destructor calls ``cudaGraphExecDestroy``,
which is not allowed while a stream captures, and the capture fails later with "operation failed due
to a previous error during capture" at an unrelated launch (seen once in the GPU suite, in a test
that builds a second engine after a first one). torch's ``torch.cuda.graph`` no longer collects
before it captures (``torch.compiler.config.force_cudagraph_gc``, off by default), so the pause is
ours: objects freed by reference counting are not affected, and the garbage is collected after.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, pool=None, **kwargs) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool=pool, **kwargs)`` with the garbage collector off inside."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, **kwargs):
            yield
    finally:
        if was_enabled:
            gc.enable()
