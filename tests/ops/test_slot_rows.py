"""scatter_rows: per-slot writes from a batch with pad rows, no boolean indexing."""
from __future__ import annotations

import doctest

import torch

from fastmamba.ops._common import slot_rows
from fastmamba.ops._common.slot_rows import scatter_rows


def test_scatter_rows_skips_pad_rows_and_keeps_the_rest():
    g = torch.Generator().manual_seed(0)
    dst = torch.randn(6, 3, generator=g)
    before = dst.clone()
    slots = torch.tensor([4, -1, 0], dtype=torch.int32)
    values = torch.randn(3, 3, generator=g, dtype=torch.float64)
    scatter_rows(dst, slots, values)
    assert torch.equal(dst[4], values[0].float()) and torch.equal(dst[0], values[2].float())
    assert torch.equal(dst[[1, 2, 3, 5]], before[[1, 2, 3, 5]])
    scatter_rows(dst, torch.tensor([7, 7]), values[:2], pad_slot_id=7)  # every row padding: nothing written
    assert torch.equal(dst[[1, 2, 3, 5]], before[[1, 2, 3, 5]]) and torch.equal(dst[4], values[0].float())


def test_docstring_examples():
    assert doctest.testmod(slot_rows, raise_on_error=False).failed == 0
