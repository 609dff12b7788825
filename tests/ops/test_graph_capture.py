"""``graph_capture``: a CUDA-graph capture with Python's garbage collector paused, so that a
collection inside it cannot destroy another graph held by cyclic garbage (which breaks the capture).
"""
from __future__ import annotations

import gc

import pytest
import torch

from fastmamba.ops.runtime import graph_capture


def test_collector_state_is_restored_when_the_capture_fails():
    """A capture that cannot start (here: not a CUDAGraph) raises, and the collector is on again;
    one that was off stays off."""
    assert gc.isenabled()
    with pytest.raises(Exception):
        with graph_capture(object()):
            pass
    assert gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(Exception):
            with graph_capture(object()):
                pass
        assert not gc.isenabled()
    finally:
        gc.enable()


class _Holder:
    """Cyclic garbage holding a captured graph, as a dropped engine is."""

    def __init__(self, graph):
        self.graph, self.me = graph, self


@pytest.mark.gpu
def test_capture_survives_cyclic_garbage_holding_another_graph():
    """A graph held by a reference cycle is dropped; the next capture allocates enough Python
    objects to trigger a collection. The collector is paused inside, so the dropped graph is not
    destroyed mid-capture, the capture completes and its replay computes; after it, the collector
    runs and frees the old graph."""
    x = torch.ones(64, device="cuda")
    old = torch.cuda.CUDAGraph()
    with graph_capture(old):
        y_old = x * 2
    _Holder(old)
    del old
    g = torch.cuda.CUDAGraph()
    with graph_capture(g):
        junk = [[i] for i in range(20000)]  # past gen-0 thresholds many times over
        y = x + 1
    del junk
    assert gc.isenabled()
    x.fill_(3)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(y, 4)) and y_old.shape == y.shape
    gc.collect()
