"""Tensor parallelism of the Nemotron-H hybrid on CPUs (gloo, 2 ranks): logits equal TP=1.

Two shapes: nemotron-h-tiny (4 query / 2 KV heads: KV split; Mamba n_groups=2: groups split) and
a variant with 1 KV head and n_groups=1 (KV head and B/C replicated, the gated norm's sum of
squares all-reduced). Prefill then decode steps (paged KV), fp32, relative error <= 1e-5."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fastmamba.distributed import TPGroup
from fastmamba.distributed.nemotron_h import check_tp_nemotron_h, nemotron_h_shard_plan
from fastmamba.models.nemotron_h import PRESETS
from tests.distributed._cases import assert_rank_shapes_are_its_slices

TINY = PRESETS["nemotron-h-tiny"]
REPLICATED = dataclasses.replace(TINY, n_kv_heads=1, n_groups=1)


def test_tp2_nemotron_h_equal_tp1(tp2_run):
    """The shared TP=2 run (conftest.py ``tp2_run``): both hybrid shapes' logits on every rank."""
    assert [m.cfg for m in tp2_run["hybrids"]] == [TINY, REPLICATED]
    for res in tp2_run["results"]:
        for c, (ref, got) in enumerate(zip(tp2_run["hybrid_refs"], res["hybrid"])):
            assert len(got) == len(ref) == 4
            for j, (want, have) in enumerate(zip(ref, got)):
                err = ((have - want).abs().max() / want.abs().max()).item()
                assert err <= 1e-5, f"rank {res['rank']}, case {c}, call {j}: relative error {err:.2e}"


def test_nemotron_h_plan_slices_and_local_shapes():
    """Rank 1 of 2 in the replicated case: its query heads 2..3 read KV head 0 (the only one), its
    Mamba B/C rows are all of them; the local model's shapes equal its slices (no process group)."""
    plan = nemotron_h_shard_plan(REPLICATED, 1, 2)
    attn = REPLICATED.pattern.index("*")
    Dh = REPLICATED.head_dim
    assert plan[f"backbone.layers.{attn}.mixer.q_proj.weight"].ranges == ((2 * Dh, 4 * Dh),)
    assert plan[f"backbone.layers.{attn}.mixer.k_proj.weight"].ranges == ((0, Dh),)
    assert_rank_shapes_are_its_slices(REPLICATED, 1, 2)


@pytest.mark.parametrize("cfg, world, match", [
    (TINY, 4, r"n_groups|ngroups=2.*world size 4"),
    (dataclasses.replace(TINY, n_kv_heads=4), 8, r"n_heads=4 attention heads over world size 8"),
    (dataclasses.replace(TINY, intermediate_size=98), 4, r"intermediate_size=98"),
    (dataclasses.replace(TINY, n_heads=6, n_kv_heads=3), 2, r"n_kv_heads=3 KV heads over world size 2"),
])
def test_nemotron_h_bad_combinations(cfg, world, match):
    with pytest.raises(ValueError, match=match):
        check_tp_nemotron_h(cfg, world)


def test_load_tp_model_nemotron_h_preset_slices():
    """``load_tp_model`` of a hybrid preset on rank 1 of 2 (no process group needed to load): every
    tensor is its plan's slice of the whole preset."""
    from fastmamba.distributed import load_tp_model
    from fastmamba.distributed.shard import slice_tensor
    from fastmamba.models.nemotron_h import load_nemotron_h

    whole = load_nemotron_h("nemotron-h-tiny", dtype=torch.float32, device="cpu").state_dict()
    tp = TPGroup(rank=1, world_size=2, device=torch.device("cpu"))
    part = load_tp_model("nemotron-h-tiny", tp)
    assert part.cfg.n_heads == 2 and part.cfg.n_kv_heads == 1 and part.cfg.mamba_nheads == 4
    plan = nemotron_h_shard_plan(TINY, 1, 2)
    for name, t in part.state_dict().items():
        torch.testing.assert_close(t, slice_tensor(whole[name], plan[name]), rtol=0, atol=0, msg=name)
