"""``EngineConfig``: the engine's options checked in one place, before anything is built.

``Engine(model, **options)`` and ``Engine(model, config=EngineConfig(**options))`` are the same
engine; a bad option names itself, what was expected and what came, and the model is not asked
for a cache (nor anything else) first.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import fastmamba
from fastmamba.generation.engine import Engine, EngineConfig
from fastmamba.generation.sampling import SamplingParams
from fastmamba.generation.spec_policy import SpeculationPolicy

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cpu")


class UntouchedModel:
    """A model that fails the test if the engine asks it for anything past its config."""

    def __init__(self, cfg):
        self.cfg = cfg

    def __getattr__(self, name):
        raise AssertionError(f"the engine reached model.{name} before refusing its options")


BAD = [  # (options, error, the message names the option, what was expected, what came)
    ({"max_batch": 0}, ValueError, r"max_batch must be an int >= 1 .*got 0"),
    ({"max_batch": 2.0}, TypeError, r"max_batch must be an int >= 1 .*got float 2.0"),
    ({"cuda_graphs": "yes"}, TypeError, r"cuda_graphs must be None or a bool, got str 'yes'"),
    ({"pdl": 1}, TypeError, r"pdl must be None or a bool, got int 1"),
    ({"ssm_dtype": torch.int8}, TypeError, r"ssm_dtype must be torch.float32, torch.bfloat16 or torch.float16, "
                                           r"got torch.int8"),
    ({"prefill_chunk": 0}, ValueError, r"prefill_chunk must be None or an int >= 1 \(tokens per step\), got 0"),
    ({"graph_prefill_tokens": 8}, ValueError, r"graph_prefill_tokens must be None or an int >= 16, got 8"),
    ({"stochastic_rounding": 1}, TypeError, r"stochastic_rounding must be a bool, got 1"),
    ({"stochastic_rounding": True, "ssm_dtype": torch.float32}, ValueError,
     r"stochastic_rounding=True .* got ssm_dtype=torch.float32"),
    ({"stochastic_rounding": True, "ssm_dtype": torch.bfloat16, "rounding_seed": -1}, ValueError,
     r"rounding_seed must be an int in \[0, 2\*\*31\), got -1"),
    ({"tokenizer": object()}, TypeError, r"tokenizer must have a decode\(ids\) -> str method, got object"),
    ({"max_finished": -1}, ValueError, r"max_finished must be None or an int >= 0, got -1"),
    ({"speculate": -1}, ValueError, r"speculate must be None or an int >= 0 \(number of drafts K\), got -1"),
    ({"drafter": "mtp"}, ValueError, r"a drafter needs speculate=K with K >= 1"),
    ({"speculate": 2, "drafter": "eagle"}, ValueError, r"drafter expected a Drafter object or 'mtp', got 'eagle'"),
    ({"verify_path": "fast"}, ValueError, r"verify_path expected one of \('auto', 'replay', 'legacy'\), got 'fast'"),
    ({"verify_table": 5}, TypeError, r"verify_table expected a mapping .* got int"),
    ({"legacy_max_batch": 0}, ValueError, r"legacy_max_batch must be None or an int >= 1, got 0"),
    ({"max_batch": 4, "verify_path": "legacy", "legacy_max_batch": 2}, ValueError,
     r"verify_path='legacy' runs every batch up to max_batch=4 .* legacy_max_batch=2"),
    ({"spec_policy": "adaptive"}, ValueError, r"spec_policy expected None, 'adaptive' or a SpeculationPolicy "
                                              r"\(with speculate=K\), got 'adaptive'"),
    ({"speculate": 2, "spec_policy": "greedy"}, ValueError, r"spec_policy expected .* got 'greedy'"),
    ({"gpu_memory_utilization": 1.5}, ValueError, r"gpu_memory_utilization: expected a number in \(0, 1\], got 1.5"),
    ({"kv_page_size": 0}, ValueError, r"kv_page_size must be None or an int >= 1, got 0"),
    ({"kv_num_pages": True}, ValueError, r"kv_num_pages must be None or an int >= 1, got True"),
    ({"prefix_cache_bytes": -1}, ValueError, r"prefix_cache_bytes must be None or an int >= 0, got -1"),
    ({"prefix_cache_entries": 1.5}, ValueError, r"prefix_cache_entries must be None or an int >= 0, got 1.5"),
]


@pytest.mark.parametrize("options, error, match", BAD, ids=[
    "batch-0", "batch-float", "graphs-str", "pdl-int", "state-int8", "chunk-0", "graph-prefill-8", "rounding-int",
    "rounding-fp32", "rounding-seed", "tokenizer", "finished", "speculate", "drafter-no-k", "drafter-name",
    "verify-path", "verify-table", "legacy-0", "legacy-forced", "policy-no-k", "policy-name", "utilization",
    "page-size", "pages-bool", "prefix-bytes", "prefix-entries"])
def test_a_bad_option_is_named_before_anything_is_built(tiny, options, error, match):
    with pytest.raises(error, match=match):
        EngineConfig(**options)
    with pytest.raises(error, match=match):  # the same error through Engine, the model untouched
        Engine(UntouchedModel(tiny.cfg), **options)


def test_checks_that_need_the_model_come_before_its_cache(tiny):
    model = UntouchedModel(tiny.cfg)
    with pytest.raises(ValueError, match="max_seq_len configure a paged KV cache.*UntouchedModel has none"):
        Engine(model, max_seq_len=64)
    with pytest.raises(ValueError, match="prefix_block must be a positive multiple of the model's chunk_size"):
        Engine(model, prefix_block=tiny.cfg.chunk_size + 1)
    bad_eos = UntouchedModel(dataclasses.replace(tiny.cfg))
    object.__setattr__(bad_eos.cfg, "eos_token_ids", ("</s>",))
    with pytest.raises(ValueError, match=r"eos_token_ids must be ints, got \('</s>',\)"):
        Engine(bad_eos)


def test_config_and_keywords_build_the_same_engine(tiny):
    options = dict(max_batch=3, cuda_graphs=False, speculate=2, verify_path="legacy", prefill_chunk=8)
    prompts = [[1, 2, 3, 4, 5], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7], [9]]
    by_keywords = Engine(tiny, **options)
    config = EngineConfig(**options)
    by_config = Engine(tiny, config=config)
    assert by_config.config is config and by_keywords.config == config
    assert by_config.generate(prompts, GREEDY) == by_keywords.generate(prompts, GREEDY)
    assert by_config.stats == by_keywords.stats and by_config.stats["steps"]["legacy"] > 0
    assert by_config.legacy_max_batch == by_keywords.legacy_max_batch == 3


def test_config_is_frozen_and_resolves_its_defaults():
    config = EngineConfig(max_batch=600)
    assert config.finished_kept == 2400 and EngineConfig(max_finished=5).finished_kept == 5
    assert EngineConfig(max_batch=2).finished_kept == 1024
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch = 3
    assert EngineConfig(kv_page_size=16, max_seq_len=256).kv_options() == {"max_seq_len": 256, "page_size": 16}
    policy = SpeculationPolicy(2)
    assert EngineConfig(speculate=2, spec_policy=policy).spec_policy is policy


def test_config_and_keywords_together_are_refused(tiny):
    with pytest.raises(TypeError, match="not both; got config and max_batch"):
        Engine(tiny, config=EngineConfig(), max_batch=2)
    with pytest.raises(TypeError, match="config must be an EngineConfig, got dict"):
        Engine(tiny, config={"max_batch": 2})
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_batchh'"):
        Engine(tiny, max_batchh=2)
