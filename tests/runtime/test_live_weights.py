"""Weights are read live: no weight-derived tensor is cached (the kernels compute -exp(A_log)
themselves), so the model runs under ``torch.inference_mode()`` like outside it, and an in-place
weight change is seen by the next eager step, the next engine step and the next CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

import fastmamba
from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import SamplingParams
from tests.helpers import scaled_tiny_model, seeded

EXACT = dict(atol=0.0, rtol=0.0)  # fp32, same kernels, same inputs: bit for bit


def _ids(seed: int, shape=(2, 6)) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=seeded(seed))


def _decode(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of teacher-forced decode steps over ids [B, n] from fresh (zero) slots, stacked
    [n, B, V]. (Decode only: a prefill costs minutes under the loaded CPU interpreter; the engine
    test below runs prefills.)"""
    dev = model.lm_head.weight.device
    ids = ids.to(dev)
    cache = model.new_cache(ids.shape[0] + 1)
    cache.alloc(1)  # the requests use rows 1.. (not the identity mapping)
    slots = cache.alloc(ids.shape[0])
    return torch.stack([model.decode(ids[:, t], cache, slots) for t in range(ids.shape[1])])


def test_inference_mode_load_forward_decode_and_generate_equal_the_normal_path():
    ids = _ids(0, (2, 3))
    prompts = [[5, 9, 1], [7, 7, 2, 200, 3]]
    params = SamplingParams(max_new_tokens=3)
    normal = fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cpu")
    want_fwd, want_steps = normal(ids), _decode(normal, ids)
    want_gen = Engine(normal, max_batch=2, cuda_graphs=False).generate(prompts, params)
    with torch.inference_mode():
        model = fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cpu")
        assert model.backbone.layers[0].mixer.A_log.is_inference()
        got_fwd, got_steps = model(ids), _decode(model, ids)
        got_gen = Engine(model, max_batch=2, cuda_graphs=False).generate(prompts, params)
        # a model loaded normally, then run inside inference mode (the usual serving pattern)
        again = _decode(normal, ids)
    torch.testing.assert_close(got_fwd, want_fwd, **EXACT)
    torch.testing.assert_close(got_steps, want_steps, **EXACT)
    torch.testing.assert_close(again, want_steps, **EXACT)
    assert got_gen == want_gen


def _change(model, how: str) -> None:
    """An in-place weight change of every layer, the way a user or a reloader makes it."""
    mixers = [layer.mixer for layer in model.backbone.layers]
    with torch.no_grad():
        if how == "A_log.sub_":
            for m in mixers:
                m.A_log.sub_(-4)  # |A| x e^4: the states decay within a token or two, which the logits show
        elif how == "param.data.mul_":  # .data does not bump the parameter's version counter
            for m in mixers:
                m.A_log.data.mul_(0.25)
                m.dt_bias.data.add_(0.5)
                m.out_proj.weight.data.mul_(-1)
        elif how == "load_state_dict":
            g = seeded(11)
            sd = {k: v + 0.3 * torch.randn(v.shape, generator=g).to(v) if k.endswith(("A_log", "D", "weight")) else v
                  for k, v in model.state_dict().items()}
            model.load_state_dict(sd)
        else:
            raise AssertionError(how)


CHANGES = ["A_log.sub_", "param.data.mul_", "load_state_dict"]


def _fresh_with_change(how: str, device="cpu"):
    fresh = scaled_tiny_model(device)
    _change(fresh, how)
    return fresh


@pytest.mark.parametrize("how", CHANGES)
def test_weight_change_is_seen_by_the_next_eager_step(how):
    ids = _ids(1, (2, 3))
    model = scaled_tiny_model("cpu")
    before = _decode(model, ids)  # every decode op runs once with the old weights (any cache fills)
    _change(model, how)
    want = _decode(_fresh_with_change(how), ids)
    assert not torch.allclose(want, before, atol=1e-3, rtol=1e-3), "the change must matter for the test to mean anything"
    torch.testing.assert_close(_decode(model, ids), want, **EXACT)


def test_weight_change_is_seen_by_an_engine_built_before_it():
    """The engine's own path (prefill, then its decode path: eager on the CPU), reused across a
    ``.data`` change (which bumps no version counter)."""
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    params = SamplingParams(max_new_tokens=2)
    model = scaled_tiny_model("cpu")
    engine = Engine(model, max_batch=2, cuda_graphs=False)
    old_tokens = engine.generate(prompts, params)
    _change(model, "param.data.mul_")
    want_tokens = Engine(_fresh_with_change("param.data.mul_"), max_batch=2, cuda_graphs=False).generate(prompts, params)
    assert engine.generate(prompts, params) == want_tokens
    assert want_tokens != old_tokens


def test_weight_change_is_seen_under_inference_mode():
    ids = _ids(2, (2, 3))
    with torch.inference_mode():
        model = scaled_tiny_model("cpu")
        _decode(model, ids)
        _change(model, "A_log.sub_")  # (in-place updates of inference tensors are allowed inside inference mode)
        got = _decode(model, ids)
    torch.testing.assert_close(got, _decode(_fresh_with_change("A_log.sub_"), ids), **EXACT)


@pytest.mark.gpu
@pytest.mark.parametrize("how", CHANGES)
def test_graphed_decoder_captured_before_a_weight_change_equals_eager_after_it(how):
    from fastmamba.generation.cuda_graphs import GraphedDecoder

    model = scaled_tiny_model("cuda")
    ids = _ids(3, (3, 8)).cuda()
    graph_cache, eager_cache = model.new_cache(4), model.new_cache(4)
    slots = torch.tensor([2, 0, 3], dtype=torch.int32, device="cuda")
    decoder = GraphedDecoder(model, graph_cache, max_batch=4)
    model.prefill(ids[:, :4], graph_cache, slots)
    decoder.decode(ids[:, 4], slots)  # captured with the old weights
    _change(model, how)
    for pool in (*graph_cache.conv, *graph_cache.ssm):  # both caches restart from the same prompt
        pool.zero_()  # (the decode above advanced graph_cache's slots)
    model.prefill(ids[:, :4], graph_cache, slots)
    model.prefill(ids[:, :4], eager_cache, slots)
    for t in range(4, 8):
        graphed = decoder.decode(ids[:, t], slots).clone()
        eager = model.decode(ids[:, t], eager_cache, slots)
        torch.testing.assert_close(graphed, eager, atol=1e-5, rtol=1e-5)
    for layer in range(model.cfg.n_layer):
        torch.testing.assert_close(graph_cache.ssm[layer], eager_cache.ssm[layer], atol=1e-5, rtol=1e-5)
    fresh = _fresh_with_change(how, "cuda")
    fresh_cache = fresh.new_cache(4)
    fresh.prefill(ids[:, :4], fresh_cache, slots)
    for t in range(4, 8):
        fresh_logits = fresh.decode(ids[:, t], fresh_cache, slots)
    torch.testing.assert_close(graphed, fresh_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_graphed_decoder_after_rebinding_the_weights_needs_invalidate():
    """``load_state_dict(assign=True)`` moves the weights to new storage: ``invalidate()`` recaptures."""
    from fastmamba.generation.cuda_graphs import GraphedDecoder

    model = scaled_tiny_model("cuda")
    ids = _ids(4, (2, 6)).cuda()
    slots = torch.tensor([1, 0], dtype=torch.int32, device="cuda")
    graph_cache, eager_cache = model.new_cache(2), model.new_cache(2)
    decoder = GraphedDecoder(model, graph_cache, max_batch=2)
    decoder.decode(ids[:, 0], slots)
    sd = {k: (v * 0.5).clone() if k.endswith("A_log") else v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(sd, assign=True)
    decoder.invalidate()
    for pool in (*graph_cache.conv, *graph_cache.ssm):  # the decode above advanced graph_cache's slots
        pool.zero_()
    model.prefill(ids[:, :3], graph_cache, slots)
    model.prefill(ids[:, :3], eager_cache, slots)
    for t in range(3, 6):
        torch.testing.assert_close(decoder.decode(ids[:, t], slots), model.decode(ids[:, t], eager_cache, slots),
                                   atol=1e-5, rtol=1e-5)
