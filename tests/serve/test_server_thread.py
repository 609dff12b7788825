"""The serving loop in a thread (``create_app(engine)``): the same loop as the engine process's
(``worker.serve_engine``), driven in-process through the app; tokens equal the offline engine's,
an aborted stream frees its slot, and the app's shutdown drains for at most ``shutdown_timeout``."""
from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastmamba.generation.sampling import SamplingParams


@pytest.fixture
def engine(reference_ops):
    import fastmamba
    from fastmamba.generation.engine import Engine

    return Engine(fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cpu"), max_batch=2,
                  cuda_graphs=False)


def test_thread_form_serves_aborts_and_drains(engine, reference_ops):
    from fastapi.testclient import TestClient

    import fastmamba
    from fastmamba.generation.engine import Engine
    from fastmamba.serve.app import create_app

    offline = Engine(fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cpu"), max_batch=1,
                     cuda_graphs=False)
    want = offline.generate([[5, 9, 13]], SamplingParams(max_new_tokens=5, repetition_penalty=1.4))[0]
    app = create_app(engine, model_name="tiny", shutdown_timeout=0.5)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 9, 13], "max_tokens": 5,
                                                 "temperature": 0, "repetition_penalty": 1.4})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want
        with client.stream("POST", "/v1/completions", json={"prompt": [5, 9], "max_tokens": 60, "stream": True,
                                                            "ignore_eos": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: "):
                    break  # hang up after the first chunk
        deadline = time.time() + 10
        while engine.has_unfinished() and time.time() < deadline:
            time.sleep(0.01)
        assert not engine.has_unfinished() and engine.cache.free_slots == 2
        assert client.get("/v1/completions").status_code == 405
        for absurd in (10**30, 2**63):  # no --max-model-len and no K/V: still refused, by name
            r = client.post("/v1/completions", json={"prompt": [5], "max_tokens": absurd})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    worker = app.state.engine_thread
    assert not worker.alive()  # the lifespan's exit stopped the loop
