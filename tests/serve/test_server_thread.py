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


def test_a_burst_arriving_while_requests_are_added_joins_the_first_step(engine, reference_ops):
    """``serve_engine`` takes commands until none is waiting before it steps: requests that arrive
    while the first ones are being added (a burst of clients) are admitted to the same step, as the
    serving loop of 6625510 did, rather than one step later."""
    from fastmamba.serve.worker import serve_engine

    params = SamplingParams(max_new_tokens=1)
    arrivals = [[("add", 0, [5, 9, 13], params)], [("add", 1, [7, 2], params)], []]
    polls: list[float] = []
    admitted_at_first_step: list[int] = []

    def poll(timeout):
        polls.append(timeout)
        if arrivals:
            return arrivals.pop(0)
        return [("stop", 0.0)] if len(polls) == 4 else []

    real_step = engine.step

    def step():
        if not admitted_at_first_step:
            admitted_at_first_step.append(len(engine.waiting) + len(engine.running) + len(engine.prefilling))
        return real_step()

    engine.step = step
    reports = []
    serve_engine(engine, poll, lambda events, stats, timing: reports.append(events))
    assert admitted_at_first_step == [2]
    assert polls[:3] == [0.05, 0, 0]  # the idle wait, then look for more before stepping
    finished = {cid for events in reports for cid, kind, _ in events if kind == "finished"}
    assert finished == {0, 1}


def test_a_flood_of_commands_does_not_starve_the_step(engine, reference_ops):
    """Commands that never stop coming are taken ``max_rounds`` polls at a time, then the engine steps."""
    from fastmamba.serve import worker

    params = SamplingParams(max_new_tokens=1)
    cids = iter(range(10_000))
    steps = []
    real_step = engine.step

    def step():
        steps.append(1)
        return real_step()

    engine.step = step

    def poll(timeout):
        if len(steps) >= 2:
            return [("stop", 0.0)]
        return [("add", next(cids), [5, 9], params)]

    worker.serve_engine(engine, poll, lambda *a: None)
    assert len(steps) >= 2
