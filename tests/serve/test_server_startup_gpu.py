"""GPU: the server's start-up time (process start to the first 200 on /health, warm-up included) next
to the time to load the weights alone, for mamba2-2.7b and nemotron-h-8b (random-weight presets of
the real shapes). Prints one line per model for the report; asserts only that the server came up and
answered a request.

    .venv/bin/python -m pytest -q -s -m gpu tests/serve/test_server_startup_gpu.py
"""
from __future__ import annotations

import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from tests.serve.conftest import Server


class SlowServer(Server):
    def wait_ready(self, timeout: float = 900.0) -> None:  # a big model's load and warm-up
        super().wait_ready(timeout)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["mamba2-2.7b", "nemotron-h-8b"])
def test_start_up_time(model, tmp_path):
    import torch

    import fastmamba

    t0 = time.perf_counter()
    lm = fastmamba.load_model(model, device="cuda")
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    del lm
    torch.cuda.empty_cache()

    t0 = time.perf_counter()
    s = SlowServer(["--device", "cuda", "--dtype", "bfloat16", "--log-level", "info"], tmp_path, model=model)
    try:
        ready_s = time.perf_counter() - t0
        r = httpx.post(s.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=120)
        assert r.status_code == 200, r.text
        warm = [line for line in s.output().splitlines() if "warm-up took" in line]
        print(f"\n{model}: process start -> /health 200 in {ready_s:.1f} s (weights alone: {load_s:.1f} s); "
              f"{warm[-1] if warm else ''}")
    finally:
        assert s.terminate() == 0, s.output()
