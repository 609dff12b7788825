"""Capacity planning: slot and page bytes counted from the real caches (built on the meta device),
plans that fit what they promise, and refusals that name the numbers before anything is loaded."""
from __future__ import annotations

import json

import pytest
import torch

from fastmamba.generation.capacity import (
    GiB,
    CapacityError,
    meta_model,
    pages_for,
    per_request_bytes,
    plan_capacity,
    tensor_bytes,
    weight_bytes,
)
from fastmamba.models import Mamba2Config, Mamba2LM, NemotronHConfig, NemotronHLM

HYBRID = NemotronHConfig(d_model=64, vocab_size=96, pattern="M*M-M*", n_heads=4, n_kv_heads=2, head_dim=16,
                         intermediate_size=80, mamba_nheads=4, mamba_headdim=16, n_groups=2, d_state=16, chunk_size=8)
MAMBA = Mamba2Config(d_model=64, n_layer=3, vocab_size=96, d_state=16, headdim=16, chunk_size=8)


def hybrid(dtype=torch.bfloat16):
    return NemotronHLM(HYBRID, device="meta", dtype=dtype)


def test_slot_and_page_bytes_are_what_the_caches_allocate():
    model = hybrid()
    slot, page = per_request_bytes(model, max_seq_len=64, page_size=16)
    one = tensor_bytes(model.new_cache(1, max_seq_len=64, page_size=16, num_pages=1))
    big = tensor_bytes(model.new_cache(5, max_seq_len=64, page_size=16, num_pages=7))
    assert big == one + 4 * slot + 6 * page
    # by hand: per Mamba layer conv (W=4 columns of E = D + 2 G N channels, bf16) and SSM (H P N, fp32)
    d_inner, conv_dim = 4 * 16, 4 * 16 + 2 * 2 * 16
    per_layer = conv_dim * 4 * 2 + 4 * 16 * 16 * 4
    assert slot >= 3 * per_layer  # plus the slot's rows of the page table and bookkeeping
    assert page == 2 * 2 * 16 * 2 * 16 * 2  # K and V x 2 attention layers x 16 tokens x 2 KV heads x 16 x bf16
    assert d_inner == 64


def test_speculative_buffers_are_counted_in_the_one_slot_of_a_request():
    model = hybrid()
    plain, _ = per_request_bytes(model, max_seq_len=64)
    spec, _ = per_request_bytes(model, max_seq_len=64, speculate=4)
    assert spec > plain


def test_a_pure_mamba_model_has_no_pages():
    model = Mamba2LM(MAMBA, device="meta", dtype=torch.bfloat16)
    slot, page = per_request_bytes(model)
    assert slot > 0 and page == 0
    plan = plan_capacity(model, device_bytes=2 * GiB, reserve_bytes=0)
    assert plan.kv_pages == 0 and plan.max_batch == 256


def test_the_default_plan_fits_every_request_at_max_seq_len():
    model = hybrid()
    slot, page = per_request_bytes(model, max_seq_len=128)
    budget = 40 * slot + 40 * pages_for(128, 16) * page + 1000  # room for 40 full-length requests
    plan = plan_capacity(model, device_bytes=budget + weight_bytes(model), gpu_memory_utilization=1.0,
                         max_seq_len=128, reserve_bytes=0)
    assert plan.max_batch == 40
    assert plan.kv_pages == 40 * pages_for(128, 16)
    assert plan.full_length_requests == 40
    assert plan.cache_bytes <= plan.budget_bytes
    cache = model.new_cache(plan.max_batch, max_seq_len=128, page_size=16, num_pages=plan.kv_pages)
    assert tensor_bytes(cache) - tensor_bytes(model.new_cache(1, max_seq_len=128, num_pages=1)) <= plan.budget_bytes


def test_an_explicit_max_batch_beyond_the_full_length_count_shares_fewer_pages():
    model = hybrid()
    slot, page = per_request_bytes(model, max_seq_len=128)
    full = pages_for(128, 16)
    budget = 40 * slot + 40 * full * page
    plan = plan_capacity(model, device_bytes=budget + weight_bytes(model), gpu_memory_utilization=1.0,
                         max_seq_len=128, reserve_bytes=0, max_batch=60)
    assert plan.max_batch == 60
    assert plan.kv_pages == (budget - 60 * slot) // page
    assert full <= plan.kv_pages < 60 * full
    assert plan.cache_bytes <= plan.budget_bytes


def test_an_impossible_max_batch_is_refused_with_the_numbers():
    model = hybrid()
    slot, page = per_request_bytes(model, max_seq_len=128)
    budget = 10 * slot + pages_for(128, 16) * page
    with pytest.raises(CapacityError, match=r"max_batch=11 does not fit: 11 slots x .* MiB of Mamba state .* "
                                            r"the most that fits is 10"):
        plan_capacity(model, device_bytes=budget + weight_bytes(model), gpu_memory_utilization=1.0,
                      max_seq_len=128, reserve_bytes=0, max_batch=11)
    plan = plan_capacity(model, device_bytes=budget + weight_bytes(model), gpu_memory_utilization=1.0,
                         max_seq_len=128, reserve_bytes=0, max_batch=10)
    assert plan.max_batch == 10 and plan.kv_pages == pages_for(128, 16)


def test_a_model_that_does_not_fit_at_all_is_refused():
    model = hybrid()
    with pytest.raises(CapacityError, match=r"the model does not fit: .* GiB are left for caches"):
        plan_capacity(model, device_bytes=weight_bytes(model), gpu_memory_utilization=1.0, reserve_bytes=0)


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, "0.9", float("nan")])
def test_bad_utilization_is_refused(bad):
    with pytest.raises(CapacityError, match="gpu_memory_utilization: expected a number in"):
        plan_capacity(hybrid(), device_bytes=80 * GiB, gpu_memory_utilization=bad)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4", True])
def test_bad_max_batch_is_refused(bad):
    with pytest.raises(CapacityError, match="max_batch: expected a positive integer"):
        plan_capacity(hybrid(), device_bytes=80 * GiB, max_batch=bad)


def test_tied_embeddings_count_once():
    tied = Mamba2LM(Mamba2Config(d_model=64, n_layer=1, vocab_size=96, d_state=16, headdim=16, tie_embeddings=True),
                    device="meta", dtype=torch.float32)
    untied = Mamba2LM(Mamba2Config(d_model=64, n_layer=1, vocab_size=96, d_state=16, headdim=16,
                                   tie_embeddings=False), device="meta", dtype=torch.float32)
    assert weight_bytes(untied) - weight_bytes(tied) == 96 * 64 * 4


def test_a_checkpoint_is_planned_from_its_config_alone(tmp_path):
    """No weight file exists: the planner reads config.json only."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.NemotronHConfig(vocab_size=96, hidden_size=64, hybrid_override_pattern="M*M-",
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       intermediate_size=80, mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
                                       ssm_state_size=16, conv_kernel=4, chunk_size=8)
    cfg.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "nemotron_h"
    model = meta_model(str(tmp_path), dtype="bf16")
    assert all(p.device.type == "meta" for p in model.parameters())
    plan = plan_capacity(model, device_bytes=GiB, max_seq_len=64, reserve_bytes=0)
    assert plan.max_batch == 256 and plan.kv_pages == 256 * pages_for(64, 16)


def test_the_nano_shape_at_8k_on_an_80_gib_card():
    """Nemotron-3 Nano in bf16 (about 59 GiB of weights) leaves room for tens of requests at 8k."""
    model = meta_model("nemotron-3-nano")
    plan = plan_capacity(model, device_bytes=80 * GiB, max_seq_len=8192)
    assert 55 * GiB < plan.weight_bytes < 62 * GiB
    assert 16 <= plan.max_batch <= 256
    assert plan.cache_bytes <= plan.budget_bytes
    with pytest.raises(CapacityError, match="the most that fits is"):
        plan_capacity(model, device_bytes=80 * GiB, max_seq_len=8192, max_batch=4096)


# ------------------------------------------------------------------ Engine(gpu_memory_utilization=)


def _real_hybrid():
    torch.manual_seed(0)
    return NemotronHLM(HYBRID, device="cpu", dtype=torch.float32)


def _device_gib(model, requests: float, max_seq_len: int) -> float:
    """A device size (GiB) whose plan for ``model`` holds ``requests`` full-length requests."""
    from fastmamba.generation.capacity import meta_twin, reserve_estimate

    meta = meta_twin(model)
    slot, page = per_request_bytes(meta, max_seq_len=max_seq_len)
    reserve = reserve_estimate(meta, max_batch=2, prefill_tokens=2048)
    return (weight_bytes(meta) + reserve + requests * (slot + pages_for(max_seq_len, 16) * page)) / 0.9 / GiB


def test_engine_gpu_memory_utilization_plans_the_pool_and_refuses_what_does_not_fit(monkeypatch):
    from fastmamba.generation.engine import Engine

    model = _real_hybrid()
    LONG = 1024  # one request's K/V (512 KiB) well above the reserve's share of a larger max_batch
    # None keeps today's pool: every slot at max_seq_len
    plain = Engine(model, max_batch=2, max_seq_len=LONG, graph_prefill_tokens=None)
    assert plain.capacity is None and plain.cache.kv.num_pages == 2 * pages_for(LONG, 16)
    # on a CPU there is no device memory to divide, unless a size is given
    monkeypatch.delenv("FASTMAMBA_DEVICE_MEMORY_GIB", raising=False)
    with pytest.raises(ValueError, match="gpu_memory_utilization plans against a CUDA device's memory"):
        Engine(model, max_batch=2, max_seq_len=LONG, gpu_memory_utilization=0.9)
    # room for 1.5 full-length requests: max_batch=2 slots fit beside one request's pages, and the pool
    # holds what is left (fewer pages than 2 full-length requests: a request may wait for pages)
    monkeypatch.setenv("FASTMAMBA_DEVICE_MEMORY_GIB", repr(_device_gib(model, 1.5, LONG)))
    engine = Engine(model, max_batch=2, max_seq_len=LONG, gpu_memory_utilization=0.9, graph_prefill_tokens=None)
    plan = engine.capacity
    assert plan is not None and plan.max_batch == 2 and plan.max_seq_len == LONG
    assert pages_for(LONG, 16) <= plan.kv_pages < 2 * pages_for(LONG, 16)
    assert engine.cache.kv.num_pages == plan.kv_pages
    with pytest.raises(CapacityError, match=r"max_batch=40 does not fit: .* the most that fits is \d+"):
        Engine(model, max_batch=40, max_seq_len=LONG, gpu_memory_utilization=0.9)
    with pytest.raises(CapacityError, match=r"gpu_memory_utilization: expected a number in \(0, 1\], got 1.5"):
        Engine(model, max_batch=2, max_seq_len=LONG, gpu_memory_utilization=1.5)
    # the planned engine runs: greedy tokens equal the plain engine's
    from fastmamba.generation.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    assert engine.generate([[3, 1, 4, 1, 5]], params) == plain.generate([[3, 1, 4, 1, 5]], params)


def test_an_mtp_drafters_kv_is_counted_in_each_slot():
    """``drafter="mtp"``: a slot also carries its share of the drafter's own K/V, which MTPDrafter
    allocates for every request at max_seq_len + K."""
    from fastmamba.generation.capacity import mtp_drafter_bytes
    from fastmamba.generation.mtp_drafter import MTPDrafter
    from fastmamba.models import NEMOTRON_H_PRESETS

    cfg = NEMOTRON_H_PRESETS["nemotron-3-tiny-mtp"]
    model = NemotronHLM(cfg, device="cpu", dtype=torch.float32)
    share = mtp_drafter_bytes(model, max_seq_len=100, speculate=2)
    one, three = (tensor_bytes(MTPDrafter(model, b, max_seq_len=100 + 2).pages) for b in (1, 3))
    assert share > 0 and three - one == 2 * share  # per request (plus a pad page and tables, once)
    meta = NemotronHLM(cfg, device="meta", dtype=torch.float32)
    plain = plan_capacity(meta, device_bytes=GiB, max_seq_len=100, speculate=2, reserve_bytes=0)
    mtp = plan_capacity(meta, device_bytes=GiB, max_seq_len=100, speculate=2, reserve_bytes=0, drafter="mtp")
    assert mtp.slot_bytes == plain.slot_bytes + share
    assert mtp_drafter_bytes(hybrid(), max_seq_len=100, speculate=2) == 0  # no MTP layer


@pytest.mark.parametrize("bad", [1.5, 0, "0.9"])
def test_engine_names_a_bad_utilization_before_the_device(bad):
    """Engine(gpu_memory_utilization=...) with a bad value names it, on any device (a CPU model's
    "no device memory to divide" came first before)."""
    from fastmamba.generation.engine import Engine

    model = NemotronHLM(HYBRID, device="cpu", dtype=torch.float32)
    with pytest.raises(CapacityError, match="gpu_memory_utilization: expected a number in"):
        Engine(model, max_batch=2, gpu_memory_utilization=bad)
