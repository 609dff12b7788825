"""The OpenAI-compatible server, driven with the official ``openai`` client and raw HTTP."""
from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
import torch

pytest.importorskip("fastapi")  # the serve extra; the GPU machine's image may lack it
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from fastmamba.generation.sampling import SamplingParams
from tests.serve.conftest import API_KEY, Server

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def offline(prompts, max_tokens, tokenizer_dir=None):
    """Greedy ids of the offline API for the same preset and weights (run with reference ops)."""
    from fastmamba import llm

    model = llm.LLM("mamba2-tiny", tokenizer=tokenizer_dir, dtype=torch.float32, device="cpu", max_batch=8)
    return [o.token_ids for o in model.generate(prompts, SamplingParams(max_new_tokens=max_tokens))]


def test_health_models_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = httpx.get(server.url + "/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["mamba2-tiny"]
    text = httpx.get(server.url + "/metrics").text
    for name in ("fastmamba_requests_total", "fastmamba_time_to_first_token_seconds_bucket",
                 "fastmamba_inter_token_latency_seconds_bucket", "fastmamba_running_requests",
                 "fastmamba_slots_in_use", "fastmamba_kv_pages_in_use", "fastmamba_prefix_cache_hit_rate"):
        assert name in text


def test_completion_equals_offline_engine(server, client, reference_ops):
    prompts = [[5, 9, 13, 17], [200, 3]]
    want = offline(prompts, 6)
    for prompt, ids in zip(prompts, want):
        out = client.completions.create(model="mamba2-tiny", prompt=prompt, max_tokens=6, temperature=0)
        choice = out.choices[0]
        assert choice.model_extra["token_ids"] == ids
        assert choice.finish_reason == "length"
        assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == 6
        streamed, finish = [], None
        for chunk in client.completions.create(model="mamba2-tiny", prompt=prompt, max_tokens=6, temperature=0,
                                               stream=True):
            streamed += chunk.choices[0].model_extra["token_ids"]
            finish = chunk.choices[0].finish_reason or finish
        assert streamed == ids and finish == "length"


def test_text_prompts_chat_n_and_stop(server, client, reference_ops, tokenizer_dir):
    from fastmamba.serve.tokenization import Codec

    codec = Codec(tokenizer_dir)
    text = "w10 w20 w30"
    want = offline([codec.encode(text)], 8)[0]
    out = client.completions.create(model="mamba2-tiny", prompt=text, max_tokens=8, temperature=0)
    assert out.choices[0].model_extra["token_ids"] == want
    assert out.choices[0].text == codec.decode(want)

    # stop string: the text of the greedy output's third token; the output ends before it
    words = codec.decode(want).split()
    if len(words) >= 3:
        stop = words[2]
        out = client.completions.create(model="mamba2-tiny", prompt=text, max_tokens=8, temperature=0, stop=[stop])
        assert out.choices[0].finish_reason == "stop"
        assert stop not in out.choices[0].text
        assert codec.decode(want).startswith(out.choices[0].text.rstrip())

    # chat: the template renders the messages; n = 3 sampled choices, reproducible with a seed
    msgs = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3 w4 w5"}]
    a = client.chat.completions.create(model="mamba2-tiny", messages=msgs, n=3, temperature=0.9, seed=7, max_tokens=5)
    b = client.chat.completions.create(model="mamba2-tiny", messages=msgs, n=3, temperature=0.9, seed=7, max_tokens=5)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert all(c.message.role == "assistant" for c in a.choices)
    prompt_ids = codec.encode(codec.render_chat(msgs))
    assert a.usage.prompt_tokens == 3 * len(prompt_ids)
    chunks = list(client.chat.completions.create(model="mamba2-tiny", messages=msgs, max_tokens=5, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    want_chat = offline([prompt_ids], 5)[0]
    assert streamed.split() == codec.decode(want_chat).split()
    assert chunks[-1].choices[0].finish_reason == "length"


BAD_REQUESTS = [
    ("malformed json", "/v1/completions", b"{not json", None),
    ("not an object", "/v1/completions", b"[1, 2]", None),
    ("missing prompt", "/v1/completions", {"max_tokens": 4}, "prompt"),
    ("negative max_tokens", "/v1/completions", {"prompt": [1, 2], "max_tokens": -1}, "max_tokens"),
    ("max_tokens of the wrong type", "/v1/completions", {"prompt": [1, 2], "max_tokens": "4"}, "max_tokens"),
    ("top_p 0", "/v1/completions", {"prompt": [1, 2], "top_p": 0}, "top_p"),
    ("top_p above 1", "/v1/completions", {"prompt": [1, 2], "top_p": 1.5}, "top_p"),
    ("temperature of the wrong type", "/v1/completions", {"prompt": [1, 2], "temperature": "hot"}, "temperature"),
    ("n = 0", "/v1/completions", {"prompt": [1, 2], "n": 0}, "n"),
    ("token id outside the vocabulary", "/v1/completions", {"prompt": [1, 9999]}, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": []}, "prompt"),
    ("prompt + max_tokens above the model limit", "/v1/completions", {"prompt": [1] * 60, "max_tokens": 10},
     "max_tokens"),
    ("stop of the wrong type", "/v1/completions", {"prompt": [1, 2], "stop": 5}, "stop"),
    ("stop token outside the vocabulary", "/v1/completions", {"prompt": [1, 2], "stop_token_ids": [300]},
     "stop_token_ids"),
    ("unsupported penalty", "/v1/completions", {"prompt": [1, 2], "presence_penalty": 0.5}, None),
    ("chat without messages", "/v1/chat/completions", {"messages": []}, "messages"),
    ("chat message of an unknown role", "/v1/chat/completions", {"messages": [{"role": "bot", "content": "w1"}]},
     "messages"),
]


@pytest.mark.parametrize("what, path, body, param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_400(server, what, path, body, param):
    before = server.metric("fastmamba_prompt_tokens_total")
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=data, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param
    assert server.metric("fastmamba_prompt_tokens_total") == before  # never reached the engine


def test_api_key_required(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2]})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401


def test_64_concurrent_streams(server, reference_ops):
    import openai

    prompts = [[(7 * i) % 250 + 1, (3 * i) % 250 + 2, 9] for i in range(64)]
    want = offline(prompts, 4)

    async def one(cl, prompt):
        ids = []
        async for chunk in await cl.completions.create(model="mamba2-tiny", prompt=prompt, max_tokens=4,
                                                       temperature=0, stream=True):
            ids += chunk.choices[0].model_extra["token_ids"]
        return ids

    async def main():
        cl = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        return await asyncio.wait_for(asyncio.gather(*(one(cl, p) for p in prompts)), timeout=300)

    got = asyncio.run(main())
    assert got == want


def test_disconnects_free_every_slot(server):
    rng = random.Random(0)

    async def client_that_leaves(i):
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as cl:
            body = {"prompt": [i % 250 + 1, 4, 8], "max_tokens": 40, "temperature": 0, "stream": True}
            async with cl.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                keep = rng.randint(0, 3)
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and keep == 0:
                        break  # hang up mid-stream
                    keep -= line.startswith("data: ")

    async def main():
        await asyncio.wait_for(asyncio.gather(*(client_that_leaves(i) for i in range(50))), timeout=300)

    asyncio.run(main())
    deadline = time.time() + 120
    while time.time() < deadline:
        if (server.metric("fastmamba_slots_in_use") == 0 and server.metric("fastmamba_running_requests") == 0
                and server.metric("fastmamba_waiting_requests") == 0):
            break
        time.sleep(0.5)
    assert server.metric("fastmamba_slots_in_use") == 0
    assert server.metric("fastmamba_running_requests") == 0 and server.metric("fastmamba_waiting_requests") == 0


def test_full_queue_503_then_graceful_sigterm(tmp_path):
    """A server with one slot and one waiting place: the third concurrent request gets 503 with
    Retry-After; SIGTERM lets the in-flight requests finish and the process exits 0."""
    s = Server(["--max-batch", "1", "--max-waiting", "1"], tmp_path)
    try:
        async def post(cl, n):
            return await cl.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": n, "temperature": 0})

        async def until(name, value):
            for _ in range(600):
                if await asyncio.to_thread(s.metric, name) == value:
                    return
                await asyncio.sleep(0.02)
            raise AssertionError(f"{name} never reached {value}")

        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=300) as cl:
                # the first runs and the second waits (seen through /metrics) when the third comes
                first = asyncio.create_task(post(cl, 300))
                await until("fastmamba_running_requests", 1)
                second = asyncio.create_task(post(cl, 300))
                await until("fastmamba_waiting_requests", 1)
                third = await post(cl, 2)
                return await first, await second, third

        first, second, third = asyncio.run(main())
        assert first.status_code == 200 and second.status_code == 200
        assert third.status_code == 503 and third.headers["retry-after"] == "1"
        assert third.json()["error"]["message"]
        # chat on a model without a tokenizer: a clear 400
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]

        async def in_flight():
            async with httpx.AsyncClient(base_url=s.url, timeout=300) as cl:
                task = asyncio.create_task(post(cl, 12))
                await asyncio.sleep(1.0)
                s.proc.send_signal(__import__("signal").SIGTERM)
                return await task

        r = asyncio.run(in_flight())
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 12
    finally:
        rc = s.terminate()
    assert rc == 0, s.output()


def offline_logprobs(prompt, max_tokens, k):
    """(tokens, logprobs, top) of the offline engine, greedy, with the same preset and weights."""
    import fastmamba
    from fastmamba.generation.engine import Engine

    model = fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cpu")
    eng = Engine(model, max_batch=2, cuda_graphs=False)
    eng.add_request(prompt, SamplingParams(max_new_tokens=max_tokens, logprobs=k))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    return [o.token for o in outs], [o.logprob for o in outs], [o.top_logprobs for o in outs]


def test_logprobs_completions_and_chat(server, client, reference_ops, tokenizer_dir):
    from fastmamba.serve.tokenization import Codec

    name = Codec(str(tokenizer_dir)).decode  # the server has a tokenizer: tokens are named by their text
    prompt = [7, 31, 8, 99, 4]
    tokens, lps, tops = offline_logprobs(prompt, 5, 3)
    out = client.completions.create(model="mamba2-tiny", prompt=prompt, max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert out.choices[0].model_extra["token_ids"] == tokens
    assert lp.tokens == [name([t]) for t in tokens]
    assert lp.token_logprobs == pytest.approx(lps, abs=1e-5)
    for got, want in zip(lp.top_logprobs, tops):
        expect = {name([t]): v for t, v in want}  # OpenAI's format keys by text: equal texts collide
        assert list(got) == list(expect) and list(got.values()) == pytest.approx(list(expect.values()), abs=1e-5)
    streamed = []
    for chunk in client.completions.create(model="mamba2-tiny", prompt=prompt, max_tokens=5, temperature=0,
                                           logprobs=3, stream=True):
        if chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == pytest.approx(lps, abs=1e-5)
    chat = client.chat.completions.create(model="mamba2-tiny", messages=[{"role": "user", "content": "w1 w2 w3"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)  # greedy: the best token
        assert bytes(entry.bytes).decode() == entry.token
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH,
                   json={"messages": [{"role": "user", "content": "w1"}], "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_multi_turn_conversation_prefills_only_new_tokens(server, client, reference_ops):
    """Five turns of a conversation (token ids: each prompt is the history plus new tokens): from the
    second turn on, the engine starts from the previous turn's end-of-request snapshot and prefills
    only the new tokens and the previous reply's last token (counted through /metrics)."""
    rng = random.Random(11)
    history: list[int] = []
    for turn in range(5):
        new = [rng.randrange(200, 250) for _ in range(4)]
        prompt = history + new
        before = (server.metric("fastmamba_prefill_tokens"), server.metric("fastmamba_prefix_cache_hits"))
        out = client.completions.create(model="mamba2-tiny", prompt=prompt, max_tokens=3, temperature=0)
        reply = out.choices[0].model_extra["token_ids"]
        assert reply == offline([prompt], 3)[0]  # the same tokens as without a cache
        after = (server.metric("fastmamba_prefill_tokens"), server.metric("fastmamba_prefix_cache_hits"))
        if turn:
            assert after[0] - before[0] == len(new) + 1, turn
            assert after[1] - before[1] == 1
        history = prompt + reply
    assert server.metric("fastmamba_engine_graph_captures") == 0  # the reference ops on a CPU: no CUDA graph
