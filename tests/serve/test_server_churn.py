"""Churn through the real server: 40 random requests at once (random prompt lengths, sampling
parameters, streamed or not), some of whose clients hang up mid-stream or mid-request, on both model
families, each with whole-prompt and with chunked prefill, the hybrid's chunked one with a K/V pool
too small for every slot (8 pages of 16 tokens for 4 slots). Every answer that completes equals the
offline engine running that request alone; afterwards no slot, K/V page or request is left, and the
server logged no exception."""
from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from fastmamba.generation.sampling import SamplingParams
from tests.serve.conftest import Server

N_REQUESTS = 40
CONFIGS = [
    ("mamba2-tiny", ["--prefill-chunk", "0"], "mamba2-whole-prompts"),
    ("mamba2-tiny", ["--prefill-chunk", "8"], "mamba2-chunked"),
    ("nemotron-h-tiny", ["--prefill-chunk", "0"], "hybrid-whole-prompts"),
    ("nemotron-h-tiny", ["--prefill-chunk", "16", "--num-kv-pages", "8"], "hybrid-chunked-tight-kv"),
]


def plan(seed: int, n_requests: int) -> list[dict]:
    """The requests: body, how its client behaves ("read", "hang-up-stream" after k chunks,
    "hang-up" after a delay) and its SamplingParams for the offline engine."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 250) for _ in range(12)]  # some prompts share a prefix (prefix cache hits)
    out = []
    for i in range(n_requests):
        n = rng.randint(1, 24)
        prompt = (shared[:rng.randint(1, 12)] if rng.random() < 0.3 else []) + [rng.randrange(1, 250) for _ in range(n)]
        body = {"prompt": prompt, "max_tokens": rng.randint(1, 8), "ignore_eos": True}
        if rng.random() < 0.4:
            body.update(temperature=0.8, seed=rng.randrange(1 << 20), top_k=rng.choice([0, 5]),
                        top_p=rng.choice([1.0, 0.9]))
        else:
            body["temperature"] = 0
        if rng.random() < 0.2:
            body["repetition_penalty"] = 1.3
        if rng.random() < 0.2:
            body["min_tokens"] = min(2, body["max_tokens"])
            body["stop_token_ids"] = [rng.randrange(1, 250)]
        body["stream"] = rng.random() < 0.5
        action = rng.choices(["read", "hang-up"], [0.7, 0.3])[0]
        params = SamplingParams(temperature=body["temperature"], top_k=body.get("top_k", 0),
                                top_p=body.get("top_p", 1.0), seed=body.get("seed"), max_tokens=body["max_tokens"],
                                ignore_eos=True, repetition_penalty=body.get("repetition_penalty", 1.0),
                                min_tokens=body.get("min_tokens", 0), stop_token_ids=tuple(body.get("stop_token_ids", ())))
        out.append({"body": body, "action": action, "params": params, "delay": rng.uniform(0.0, 0.5),
                    "chunks": rng.randint(0, 3)})
    return out


def alone(model_name: str, reqs: list[dict]) -> list[list[int]]:
    """Each request's tokens from the offline engine, one request at a time (reference ops)."""
    import fastmamba
    from fastmamba.generation.engine import Engine

    model = fastmamba.load_model(model_name, dtype=torch.float32, device="cpu")
    engine = Engine(model, max_batch=1, cuda_graphs=False)
    return [engine.generate([r["body"]["prompt"]], r["params"])[0] for r in reqs]


async def run_one(url: str, port: int, r: dict):
    """Returns ("done", status, token ids) or ("gone", None, None)."""
    body = r["body"]
    if r["action"] == "hang-up" and not body["stream"]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        data = json.dumps(body).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(data) + data)
        await writer.drain()
        await asyncio.sleep(r["delay"])
        writer.close()  # gone before (or after) the answer: either way nobody reads it
        return "gone", None, None
    async with httpx.AsyncClient(base_url=url, timeout=300) as cl:
        if not body["stream"]:
            resp = await cl.post("/v1/completions", json=body)
            ids = resp.json()["choices"][0]["token_ids"] if resp.status_code == 200 else resp.text
            return "done", resp.status_code, ids
        ids, keep = [], r["chunks"]
        async with cl.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return "done", resp.status_code, await resp.aread()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if r["action"] == "hang-up" and keep == 0:
                    return "gone", None, None  # leaving the block closes the connection mid-stream
                keep -= 1
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return "done", 500, chunk
                ids += chunk["choices"][0]["token_ids"]
        return "done", 200, ids


@pytest.mark.parametrize("model, flags, name", CONFIGS, ids=[c[2] for c in CONFIGS])
def test_churn_through_the_server(model, flags, name, tmp_path, reference_ops):
    n_requests = N_REQUESTS
    reqs = plan(sum(map(ord, name)), n_requests)
    s = Server(["--max-batch", "4", "--prefix-cache-gb", "0.05", *flags], tmp_path, model=model)
    try:
        async def main():
            return await asyncio.wait_for(asyncio.gather(*(run_one(s.url, s.port, r) for r in reqs)), timeout=600)

        results = asyncio.run(main())
        want = alone(model, reqs)
        done = [(i, res) for i, res in enumerate(results) if res[0] == "done"]
        errors = [(i, res) for i, res in done if res[1] != 200]
        assert not errors, errors[:3]
        differ = [i for i, (_, _, ids) in done if ids != want[i]]
        assert not differ, [(i, results[i][2], want[i]) for i in differ[:3]]
        assert n_requests // 2 <= len(done) < n_requests  # both kinds of clients happened
        deadline = time.time() + 30
        names = ("fastmamba_slots_in_use", "fastmamba_kv_pages_in_use", "fastmamba_running_requests",
                 "fastmamba_waiting_requests")
        while time.time() < deadline and any(s.metric(n) for n in names):
            time.sleep(0.1)
        assert {n: s.metric(n) for n in names} == dict.fromkeys(names, 0.0)
    finally:
        rc = s.terminate()
    log = s.output()
    assert rc == 0 and "Traceback" not in log and "Exception" not in log, log
