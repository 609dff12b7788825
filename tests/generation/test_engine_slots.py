"""StateCache slot bookkeeping (what the engine relies on): alloc / free refuse bad input before
taking or freeing anything, so a refused call never leaks or double-frees a slot."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastmamba.cache.state_cache import StateCache
from fastmamba.models.config import PRESETS


@pytest.fixture
def cache():
    return StateCache(PRESETS["mamba2-tiny"], 5, device="cpu", conv_dtype=torch.float32)


def test_alloc_hands_out_distinct_zeroed_slots(cache):
    for conv, ssm in zip(cache.conv, cache.ssm):
        conv.fill_(7.0)
        ssm.fill_(7.0)
    a = cache.alloc(2)
    assert a.dtype == torch.int32 and a.tolist() == [0, 1] and cache.free_slots == 3
    for conv, ssm in zip(cache.conv, cache.ssm):
        assert torch.equal(conv[:2], torch.zeros_like(conv[:2])) and torch.equal(ssm[:2], torch.zeros_like(ssm[:2]))
        assert bool((conv[2:] == 7).all()) and bool((ssm[2:] == 7).all())  # the others are not touched
    assert cache.alloc(0).tolist() == [] and cache.free_slots == 3
    cache.free(torch.tensor([1], dtype=torch.int32))
    cache.free([np.int64(0)])
    assert cache.free_slots == 5


@pytest.mark.parametrize(
    "n, err, match",
    [(-2, ValueError, "n must be >= 0, got -2"), (-1, ValueError, ">= 0"), (2.0, TypeError, "got float 2.0"),
     ("2", TypeError, "got str"), (True, TypeError, "got bool"), (6, RuntimeError, "6 slots requested but only 5")],
    ids=["minus-2", "minus-1", "float", "str", "bool", "too-many"],
)
def test_bad_alloc_takes_nothing(cache, n, err, match):
    with pytest.raises(err, match=match):
        cache.alloc(n)
    assert cache.free_slots == 5
    assert cache.alloc(5).tolist() == [0, 1, 2, 3, 4]


def test_alloc_beyond_the_free_slots(cache):
    cache.alloc(4)
    with pytest.raises(RuntimeError, match="2 slots requested but only 1 of 5 are free"):
        cache.alloc(2)
    assert cache.free_slots == 1 and cache.alloc(1).tolist() == [4]


@pytest.mark.parametrize(
    "slots, err, match",
    [([0, 0], ValueError, "slot 0 appears twice"), ([1, 3], ValueError, "slot 3 is not allocated"),
     ([2], ValueError, "slot 2 is not allocated"), ([1, 5], ValueError, r"slot 5 is outside \[0, 5\)"),
     ([-1], ValueError, "outside"), ([1.0], TypeError, "got float"), (["1"], TypeError, "got str"),
     (torch.tensor([1.0]), TypeError, "dtype torch.float32"), (torch.tensor([[0, 1]]), TypeError, r"shape \(1, 2\)")],
    ids=["twice", "one-unallocated", "unallocated", "out-of-range", "negative", "float", "str", "float-tensor",
         "2d-tensor"],
)
def test_bad_free_frees_nothing(cache, slots, err, match):
    cache.alloc(2)  # slots 0 and 1
    with pytest.raises(err, match=match):
        cache.free(slots)
    assert cache.free_slots == 3
    cache.free([0, 1])  # both still allocated: the refused call freed neither
    assert cache.free_slots == 5
    with pytest.raises(ValueError, match="not allocated"):
        cache.free([0])
