"""The server over a hybrid model (the nemotron-h-tiny preset: Mamba-2, attention and MLP layers,
paged K/V) with its prefix cache on: a conversation's later turns start from the previous turn's
snapshot (Mamba states and K/V) and prefill only their new tokens, with the offline engine's
output; every KV page comes back afterwards (counted through /metrics)."""
from __future__ import annotations

import random

import pytest
import torch

from fastmamba.generation.sampling import SamplingParams
from tests.serve.conftest import Server

pytest.importorskip("fastapi")
pytest.importorskip("openai")

MODEL = "nemotron-h-tiny"


@pytest.fixture(scope="module")
def hybrid_server(tmp_path_factory):
    s = Server(["--max-batch", "4"], tmp_path_factory.mktemp("log"), model=MODEL)
    yield s
    s.terminate()


def offline(prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy ids of the offline engine (no prefix cache) for the same preset and weights."""
    import fastmamba
    from fastmamba.generation.engine import Engine

    model = fastmamba.load_model(MODEL, dtype=torch.float32, device="cpu")
    return Engine(model, max_batch=2, cuda_graphs=False).generate([prompt], SamplingParams(max_new_tokens=max_tokens))[0]


def test_hybrid_conversation_hits_the_prefix_cache(hybrid_server, reference_ops):
    import openai

    client = openai.OpenAI(base_url=hybrid_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    rng = random.Random(5)
    history: list[int] = []
    for turn in range(4):
        new = [rng.randrange(1, 250) for _ in range(5)]
        prompt = history + new
        before = (hybrid_server.metric("fastmamba_prefill_tokens"), hybrid_server.metric("fastmamba_prefix_cache_hits"))
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
        reply = out.choices[0].model_extra["token_ids"]
        assert reply == offline(prompt, 3), turn  # the same tokens as without a cache
        after = (hybrid_server.metric("fastmamba_prefill_tokens"), hybrid_server.metric("fastmamba_prefix_cache_hits"))
        if turn:
            assert after[0] - before[0] == len(new) + 1, turn  # the new tokens and the last reply token
            assert after[1] - before[1] == 1
        history = prompt + reply
    assert hybrid_server.metric("fastmamba_kv_pages_in_use") == 0
    assert hybrid_server.metric("fastmamba_slots_in_use") == 0


def test_hybrid_streams_and_disconnects_give_every_page_back(hybrid_server):
    """Streaming clients over the paged K/V: some read to the end, the others hang up mid-stream;
    afterwards no slot and no KV page is in use, and the pages did get used meanwhile."""
    import asyncio
    import time

    import httpx

    rng = random.Random(1)
    peak = []

    async def client(i):
        async with httpx.AsyncClient(base_url=hybrid_server.url, timeout=120) as cl:
            body = {"prompt": [i % 250 + 1] * (10 + i % 7), "max_tokens": 30, "temperature": 0, "stream": True}
            async with cl.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                keep = rng.randint(0, 6) if i % 2 else 10**6
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and keep == 0:
                        break  # hang up mid-stream
                    keep -= line.startswith("data: ")
                    if i == 0:
                        peak.append(hybrid_server.metric("fastmamba_kv_pages_in_use"))

    async def main():
        await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(12))), timeout=300)

    asyncio.run(main())
    deadline = time.time() + 60
    while time.time() < deadline and (hybrid_server.metric("fastmamba_slots_in_use")
                                      or hybrid_server.metric("fastmamba_kv_pages_in_use")):
        time.sleep(0.3)
    assert hybrid_server.metric("fastmamba_slots_in_use") == 0
    assert hybrid_server.metric("fastmamba_kv_pages_in_use") == 0
    assert max(peak) > 0  # the metric follows the pages (it is not stuck at zero)


def test_requests_beyond_the_kv_limit_get_400(hybrid_server):
    """A prompt and max_tokens that one request's KV cache cannot hold are refused with 400 and an
    OpenAI-style body before they reach the engine (they failed inside it with 500 before), streamed
    or not; one position less fits."""
    import httpx

    limit = 4096  # the engine's default max_seq_len for the preset (pages of 16)
    for stream in (False, True):
        body = {"prompt": [1] * (limit - 10), "max_tokens": 12, "temperature": 0, "stream": stream}
        r = httpx.post(hybrid_server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "max_tokens" and err["type"] == "invalid_request_error"
        assert f"need {limit + 1} KV positions" in err["message"] and f"at most {limit}" in err["message"]
    r = httpx.post(hybrid_server.url + "/v1/completions", timeout=60,
                   json={"prompt": [1] * (limit + 1), "max_tokens": 1, "temperature": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(hybrid_server.url + "/v1/completions", timeout=120,
                   json={"prompt": [1] * (limit - 10), "max_tokens": 11, "temperature": 0})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 11


def test_hybrid_n_logprobs_and_stop_ids(hybrid_server, reference_ops):
    """n > 1 (each choice its own request and pages), logprobs and a stop token id over the hybrid:
    greedy choices equal the offline engine's tokens, cut at the stop id."""
    import openai

    client = openai.OpenAI(base_url=hybrid_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    prompt = [7, 3, 99, 42, 5, 5, 18]
    want = offline(prompt, 6)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, n=2, logprobs=2)
    assert [c.model_extra["token_ids"] for c in out.choices] == [want, want]
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and all(v <= 0 for v in lp.token_logprobs) and len(lp.top_logprobs[0]) == 2
    stop = want[2]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                    extra_body={"stop_token_ids": [stop]})
    ids = out.choices[0].model_extra["token_ids"]
    assert ids == want[:want.index(stop) + 1] and out.choices[0].finish_reason == "stop"
    assert hybrid_server.metric("fastmamba_kv_pages_in_use") == 0
