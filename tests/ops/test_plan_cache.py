"""PlanCache (fastmamba.ops._common.plans): the one kind of launch-plan memo the ops share."""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops._common import plans
from fastmamba.ops._common.plans import PlanCache, clear_plans, sig


def test_a_cache_that_stops_keeps_its_first_plans():
    cache = PlanCache("test-stop", 2)
    assert cache.has_room()
    assert cache.remember("a", 1) == 1 and cache.remember("b", 2) == 2
    assert not cache.has_room()
    assert cache.remember("c", 3) == 3  # returned, not stored
    assert dict(cache) == {"a": 1, "b": 2} and cache.get("c") is None


def test_a_cache_that_clears_starts_over_when_full():
    cache = PlanCache("test-clear", 2, when_full="clear")
    cache.remember("a", 1)
    cache.remember("b", 2)
    assert cache.has_room()
    cache.remember("c", 3)
    assert dict(cache) == {"c": 3}


def test_clear_plans_forgets_every_ops_plans():
    from fastmamba.ops.conv1d import api as conv1d_api
    from fastmamba.ops.conv1d_fn import api as fn_api
    from fastmamba.ops.conv1d_fn import kernel as fn_kernel
    from fastmamba.ops.conv1d_fn import varlen_kernel as fn_varlen_kernel
    from fastmamba.ops.gated_rmsnorm import api as norm_api
    from fastmamba.ops.state_update import api as ssu_api

    ours = PlanCache("test-registry", 4)
    caches = [conv1d_api._PLANS, ssu_api._PLANS, fn_api._VALID_FN, norm_api._VALID, fn_kernel._fn_plans,
              fn_varlen_kernel._varlen_plans, ours]
    for i, cache in enumerate(caches):
        assert isinstance(cache, PlanCache)
        cache[("test", i)] = i
    clear_plans()
    assert all(len(cache) == 0 for cache in caches)
    plans._ALL.remove(ours)


def test_signature_of_a_tensor_and_of_none():
    t = torch.zeros(2, 6)[:, ::2]
    assert sig(t) == (torch.Size([2, 3]), (6, 2), torch.float32, torch.device("cpu"))
    assert sig(None) is None


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="when_full expected 'stop' or 'clear', got 'evict'"):
        PlanCache("test-bad", 4, when_full="evict")
