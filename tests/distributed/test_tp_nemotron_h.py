"""Tensor parallelism of the Nemotron-H hybrid on CPUs (gloo, 2 ranks): logits equal TP=1.

Two shapes: nemotron-h-tiny (4 query / 2 KV heads: KV split; Mamba n_groups=2: groups split) and
a variant with 1 KV head and n_groups=1 (KV head and B/C replicated, the gated norm's sum of
squares all-reduced). Prefill then decode steps (paged KV), fp32, relative error <= 1e-5."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fastmamba.distributed import TPGroup, spawn_tp
from fastmamba.distributed.nemotron_h import build_tp_nemotron_h, check_tp_nemotron_h, nemotron_h_shard_plan
from fastmamba.models.loader import random_init
from fastmamba.models.nemotron_h import PRESETS, NemotronHLM
from tests.distributed._workers import run_nemotron_h, tp_nemotron_h

TINY = PRESETS["nemotron-h-tiny"]
REPLICATED = dataclasses.replace(TINY, n_kv_heads=1, n_groups=1)


def _model(cfg, seed):
    model = random_init(NemotronHLM(cfg, device="cpu", dtype=torch.float32), seed=seed).eval()
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # blocks that matter, norms that differ per channel
        for name, p in model.named_parameters():
            if name.endswith(("in_proj.weight", "conv1d.weight", "q_proj.weight", "k_proj.weight", "up_proj.weight")):
                p.mul_(10)
            elif name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
                p.mul_(30)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    return model


def test_tp2_nemotron_h_equal_tp1():
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, TINY.vocab_size, (2, 7), generator=g)
    steps = torch.randint(0, TINY.vocab_size, (2, 3), generator=g)
    models = [_model(TINY, 1), _model(REPLICATED, 2)]
    refs = [run_nemotron_h(m, prompts, steps) for m in models]
    cases = [(m.cfg, {k: v.clone() for k, v in m.state_dict().items()}) for m in models]
    results = spawn_tp(tp_nemotron_h, 2, cases, prompts, steps, device="cpu", timeout_s=240)
    for rank, per_case in enumerate(results):
        for c, (ref, got) in enumerate(zip(refs, per_case)):
            for j, (want, have) in enumerate(zip(ref, got)):
                err = ((have - want).abs().max() / want.abs().max()).item()
                assert err <= 1e-5, f"rank {rank}, case {c}, call {j}: relative error {err:.2e}"


def test_nemotron_h_plan_slices_and_local_shapes():
    """Rank 1 of 2 in the replicated case: its query heads 2..3 read KV head 0 (the only one), its
    Mamba B/C rows are all of them; the local model's shapes equal its slices (no process group)."""
    plan = nemotron_h_shard_plan(REPLICATED, 1, 2)
    attn = REPLICATED.pattern.index("*")
    Dh = REPLICATED.head_dim
    assert plan[f"backbone.layers.{attn}.mixer.q_proj.weight"].ranges == ((2 * Dh, 4 * Dh),)
    assert plan[f"backbone.layers.{attn}.mixer.k_proj.weight"].ranges == ((0, Dh),)
    model = build_tp_nemotron_h(REPLICATED, TPGroup(rank=1, world_size=2, device=torch.device("cpu")),
                                dtype=torch.float32)
    full = NemotronHLM(REPLICATED, device="meta").state_dict()
    from fastmamba.distributed.shard import slice_tensor

    for name, t in model.state_dict().items():
        assert tuple(t.shape) == tuple(slice_tensor(torch.empty(full[name].shape, device="meta"), plan[name]).shape), name


@pytest.mark.parametrize("cfg, world, match", [
    (TINY, 4, r"n_groups|ngroups=2.*world size 4"),
    (dataclasses.replace(TINY, n_kv_heads=4), 8, r"n_heads=4 attention heads over world size 8"),
    (dataclasses.replace(TINY, intermediate_size=98), 4, r"intermediate_size=98"),
    (dataclasses.replace(TINY, n_heads=6, n_kv_heads=3), 2, r"n_kv_heads=3 KV heads over world size 2"),
])
def test_nemotron_h_bad_combinations(cfg, world, match):
    with pytest.raises(ValueError, match=match):
        check_tp_nemotron_h(cfg, world)
