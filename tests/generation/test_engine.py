"""Engine: continuous batching gives each request the tokens it would get alone; stop conditions."""
from __future__ import annotations

import pytest
import torch

import fastmamba
from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import SamplingParams


@pytest.fixture(scope="module")
def model():
    return fastmamba.load_model("mamba2-tiny", device="cuda" if torch.cuda.is_available() else "cpu")


def greedy_reference(model, prompt, n):
    """Plain greedy decoding from full forwards (no cache): the definition."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids], device=model.lm_head.weight.device))[0, -1].argmax()))
    return ids[len(prompt):]


def test_continuous_batching_matches_greedy_alone(model):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 3, 5)]
    engine = Engine(model, max_batch=2)  # 3 requests, 2 slots: the third joins when one leaves
    params = [SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=2), SamplingParams(max_new_tokens=3)]
    outs = engine.generate(prompts, params)
    for p, sp, out in zip(prompts, params, outs):
        assert out == greedy_reference(model, p, sp.max_new_tokens)
    assert engine.cache.free_slots == 2 and not engine.has_unfinished()


def test_mixed_prompt_lengths_share_one_prefill(model, monkeypatch):
    """Prompts of 1, 5 and 13 tokens are admitted together and prefilled in one packed call; each
    request gets the greedy tokens it gets when it runs alone."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 5, 13)]
    params = SamplingParams(max_new_tokens=3)
    alone = [Engine(model, max_batch=1).generate([p], params)[0] for p in prompts]

    calls = []
    packed_prefill = model.prefill_varlen

    def counting(ids, cu_seqlens, *args, **kwargs):
        calls.append(cu_seqlens.tolist())
        return packed_prefill(ids, cu_seqlens, *args, **kwargs)

    monkeypatch.setattr(model, "prefill_varlen", counting)
    engine = Engine(model, max_batch=4, graph_prefill_tokens=None)  # eager prefill: the spy reads cu_seqlens
    assert engine.generate(prompts, params) == alone
    assert calls == [[0, 1, 6, 19]]  # the three admitted together: one packed prefill
    assert engine.cache.free_slots == 4


def test_stop_tokens_and_seeded_sampling(model):
    prompt = [1, 2, 3, 4]
    first = greedy_reference(model, prompt, 3)
    engine = Engine(model, max_batch=4)
    out = engine.generate([prompt], SamplingParams(max_new_tokens=10, stop_token_ids=(first[0],)))[0]
    assert out == first[:1]  # stops on (and includes) the stop token
    assert engine.generate([prompt], SamplingParams(max_new_tokens=3))[0] == first
    sp = SamplingParams(temperature=1.0, top_k=20, seed=7, max_new_tokens=6)
    a = engine.generate([prompt], sp)[0]
    b = engine.generate([prompt, [9, 9, 9]], [sp, SamplingParams(temperature=1.0, max_new_tokens=6)])[0]
    assert a == b  # a seeded request is reproducible whatever runs beside it


def test_bad_requests(model):
    engine = Engine(model, max_batch=1)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match=r"\[0, 256\).*prompt\[1\]=999"):
        engine.add_request([5, 999])
    with pytest.raises(ValueError, match="2 prompts but 1"):
        engine.generate([[1], [2]], [SamplingParams()])


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager(model):
    from fastmamba.generation.cuda_graphs import GraphedDecoder

    ids = torch.randint(0, 256, (3, 6), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    eager_cache, graph_cache = model.new_cache(8), model.new_cache(8)
    slots = torch.tensor([5, 1, 3], dtype=torch.int32, device="cuda")
    model.prefill(ids, eager_cache, slots)
    model.prefill(ids, graph_cache, slots)
    decoder = GraphedDecoder(model, graph_cache, max_batch=8)
    tok = ids[:, -1]
    for _ in range(4):
        want = model.decode(tok, eager_cache, slots)
        got = decoder.decode(tok, slots)  # batch 3 replays the bucket-4 graph with one padded row
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        tok = want.argmax(-1)
    for a, b in zip(eager_cache.ssm, graph_cache.ssm):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_cuda_graph_decode_bf16_projections_and_pdl(pdl):
    """bf16 (the projections run as fastmamba's gemv) inside CUDA graphs, with and without PDL:
    the same logits as eager decoding with the projections in cuBLAS, the same states."""
    from fastmamba.generation.cuda_graphs import GraphedDecoder

    model = fastmamba.load_model("mamba2-tiny", device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (5, 6), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    eager_cache, graph_cache = model.new_cache(8), model.new_cache(8)
    slots = torch.tensor([7, 0, 2, 5, 4], dtype=torch.int32, device="cuda")
    model.prefill(ids, eager_cache, slots)
    model.prefill(ids, graph_cache, slots)
    decoder = GraphedDecoder(model, graph_cache, max_batch=8, pdl=pdl)
    tok = ids[:, -1]
    try:
        for _ in range(4):
            model.set_decode_tricks(triton_gemv=False)
            want = model.decode(tok, eager_cache, slots)
            model.set_decode_tricks()
            got = decoder.decode(tok, slots)  # batch 5 replays the bucket-8 graph with three padded rows
            torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)
            tok = want.argmax(-1)
    finally:
        model.set_decode_tricks()
    for a, b in zip(eager_cache.ssm, graph_cache.ssm):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)
