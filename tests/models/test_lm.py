"""One LM over blocks, one cache class (issue 49): a Mamba-2 LM is the pattern of M, its cache a
HybridCache with an empty attention part and no per-slot lengths."""
from __future__ import annotations

import pytest
import torch

from fastmamba.cache.hybrid_cache import HybridCache
from fastmamba.layers.mamba2 import MambaLayerConfig
from fastmamba.models import HybridLM, Mamba2LM, NemotronHLM, load_model
from fastmamba.models.mamba2 import PRESETS


def test_both_families_are_the_one_lm_with_their_tensor_names():
    m2 = load_model("mamba2-tiny", device="cpu")
    nh = load_model("nemotron-h-tiny", device="cpu")
    assert isinstance(m2, HybridLM) and isinstance(m2, Mamba2LM) and not isinstance(m2, NemotronHLM)
    assert isinstance(nh, HybridLM) and isinstance(nh, NemotronHLM)
    assert m2.cfg.pattern == "M" * m2.cfg.n_layer
    names = set(m2.state_dict())
    assert {"backbone.embeddings.weight", "backbone.layers.1.norm.weight", "backbone.layers.1.mixer.in_proj.weight",
            "backbone.norm_f.weight", "lm_head.weight"} <= names
    assert m2.lm_head.weight is m2.backbone.embeddings.weight  # tied


def test_mamba2_layer_config_is_built_from_the_model_config():
    cfg = PRESETS["mamba2-tiny"]
    layer = cfg.mamba
    assert isinstance(layer, MambaLayerConfig)
    for name in ("d_model", "d_inner", "n_layer", "d_state", "d_conv", "headdim", "ngroups", "chunk_size",
                 "nheads", "conv_dim", "d_in_proj", "norm_eps", "conv_bias", "proj_bias", "norm_before_gate"):
        assert getattr(layer, name) == getattr(cfg, name), name


def test_a_mamba2_cache_is_the_one_cache_class_without_attention_or_lengths():
    model = load_model("mamba2-tiny", device="cpu")
    cache = model.new_cache(3, speculate=1)
    assert type(cache) is HybridCache and not cache.paged and cache.kv is None
    assert cache.max_len is None and cache.tokens_per_step == 2
    assert len(cache.conv) == len(cache.ssm) == model.cfg.n_layer
    assert cache.conv[0].data_ptr() == cache.conv_stack[0].data_ptr()  # the pools are the StateCache's
    slots = cache.alloc(2)
    assert slots.dtype == torch.int32 and cache.free_slots == 1
    with pytest.raises(RuntimeError, match="2 slots requested but only 1 of 3 are free"):
        cache.alloc(2)
    with pytest.raises(RuntimeError, match="keeps no per-slot lengths"):
        cache.grow(slots.tolist(), [1, 1])
    cache.free(slots)
    assert cache.free_slots == 3


def test_paged_false_needs_mamba_layers_and_no_attention():
    cfg = PRESETS["mamba2-tiny"].mamba
    with pytest.raises(ValueError, match="paged=False is the cache of a pure Mamba-2 model"):
        HybridCache(2, mamba_cfg=cfg, n_attn_layers=1, device="cpu", paged=False)
    with pytest.raises(ValueError, match="paged=False is the cache of a pure Mamba-2 model"):
        HybridCache(2, mamba_cfg=None, n_attn_layers=0, device="cpu", paged=False)


def test_a_hybrid_cache_tracks_lengths():
    """A NemotronHConfig asks for a paged cache (its prefill decides continuation by the slots' lengths)."""
    model = load_model("nemotron-h-tiny", device="cpu")
    cache = model.new_cache(2, max_seq_len=32, page_size=4)
    assert cache.paged and cache.kv is not None
    slots = cache.alloc(1)
    model.prefill(torch.tensor([[1, 2, 3]]), cache, slots)
    assert cache.length(int(slots[0])) == 3
