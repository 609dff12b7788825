"""``fastmamba serve`` capacity planning (issue 50 point 4), on the CPU against a given device size
(``FASTMAMBA_DEVICE_MEMORY_GIB`` / the hidden ``--device-memory-gib``, what a GPU's total memory is
otherwise): an impossible ``--max-batch`` is refused with the planner's numbers before the port is
bound or a weight is read; without ``--max-batch`` the server takes the plan's, and the K/V pool
the plan's pages; ``--gpu-memory-utilization`` is checked first."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from tests.serve.conftest import Server, free_port  # noqa: E402

GiB = 1 << 30
LEN = 256  # --max-model-len: one request's K/V


def _plan(model: str, dtype, device_bytes: int, max_batch: int | None, speculate: int = 0):
    """What the server plans (cli.plan_serving's arguments, prefix cache off, chunks of 2048)."""
    import torch

    from fastmamba.generation.capacity import meta_model, plan_capacity

    return plan_capacity(meta_model(model, dtype), device_bytes=device_bytes, gpu_memory_utilization=0.9,
                         max_batch=max_batch, max_seq_len=LEN, ssm_dtype=torch.float32, speculate=speculate,
                         prefill_tokens=2048)


def _device_bytes_for(model: str, dtype, requests: float) -> int:
    """A device size whose plan holds ``requests`` full-length requests (a fraction: room to spare)."""
    from fastmamba.generation.capacity import pages_for

    p = _plan(model, dtype, 1 << 40, None)
    one = p.slot_bytes + pages_for(LEN, p.page_size) * p.page_bytes
    return int((p.weight_bytes + p.reserve_bytes + requests * one) / 0.9)


def _run(argv: list[str], env_extra: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "fastmamba.serve", *argv], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.fixture(scope="module")
def corrupt_checkpoint(tmp_path_factory):
    """A Nemotron-H checkpoint directory whose weight file is garbage: only its config.json is readable."""
    pytest.importorskip("transformers")
    from tests.distributed._checkpoints import save_nemotron_h

    root = tmp_path_factory.mktemp("corrupt")
    save_nemotron_h(root)
    (root / "model.safetensors").write_bytes(b"\0garbage, not a safetensors header" * 10)
    return str(root)


def test_impossible_max_batch_is_refused_before_the_port_or_the_weights(corrupt_checkpoint):
    from fastmamba.generation.capacity import CapacityError

    device = _device_bytes_for(corrupt_checkpoint, None, 5.5)
    with pytest.raises(CapacityError) as planned:
        _plan(corrupt_checkpoint, None, int(device / GiB * GiB), 64)
    port = free_port()
    with socket.socket() as taken:  # a busy port: binding first would report it instead
        taken.bind(("127.0.0.1", port))
        r = _run(["--model", corrupt_checkpoint, "--device", "cpu", "--port", str(port), "--max-batch", "64",
                  "--max-model-len", str(LEN), "--prefix-cache-gb", "0"],
                 {"FASTMAMBA_DEVICE_MEMORY_GIB": repr(device / GiB)})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0] == f"fastmamba serve: error: {planned.value}", r.stderr
    assert "max_batch=64 does not fit" in lines[0] and "the most that fits is" in lines[0]
    # the same flags with a batch that fits get past the planner: then the loader meets the garbage
    r = _run(["--model", corrupt_checkpoint, "--device", "cpu", "--port", str(free_port()), "--max-batch", "2",
              "--max-model-len", str(LEN), "--prefix-cache-gb", "0"],
             {"FASTMAMBA_DEVICE_MEMORY_GIB": repr(device / GiB)})
    assert r.returncode == 2 and "does not fit" not in r.stderr and "safetensors" in r.stderr.lower(), r.stderr


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1", "nan"])
def test_bad_gpu_memory_utilization_is_one_line(value):
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        r = _run(["--model", "nemotron-h-tiny", "--device", "cpu", "--port", str(port),
                  "--gpu-memory-utilization", value], {})
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastmamba serve: error: --gpu-memory-utilization: expected a "
                                                   f"fraction in (0, 1], got {float(value)}"), r.stderr


def test_default_max_batch_and_kv_pages_are_the_plans(tmp_path):
    import torch

    model = "nemotron-h-tiny"
    device = _device_bytes_for(model, torch.float32, 5.5)
    plan = _plan(model, torch.float32, int(device / GiB * GiB), None)
    assert plan.max_batch == 5 and plan.kv_pages == 5 * LEN // 16
    s = Server(["--log-level", "info", "--max-model-len", str(LEN), "--prefix-cache-gb", "0",
                "--device-memory-gib", repr(device / GiB)], tmp_path, model=model)
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True},
                       timeout=120)
        assert r.status_code == 200, r.text
        assert s.metric("fastmamba_slots_total") == plan.max_batch  # set after the first step
        log = s.output()
        assert f"--max-batch not given: {plan.max_batch}, what the capacity plan holds" in log
        assert plan.summary() in log
        assert f"{plan.kv_pages} K/V pages of 16 tokens" in log
        assert re.search(r"start-up took [0-9.]+ s: load \+ build [0-9.]+ s, warm-up took [0-9.]+ s", log), log
        # where the time before the engine process goes (--device-memory-gib: no card to ask)
        assert re.search(r"capacity plan made in [0-9.]+ s \(torch's import included\)\n", log), log
        assert re.search(r"starting the engine process for nemotron-h-tiny \(.*; the HTTP side's imports and "
                         r"tokenizer took [0-9.]+ s\)", log), log
    finally:
        assert s.terminate() == 0, s.output()


@pytest.mark.gpu
def test_gpu_server_plans_from_the_cards_memory(tmp_path):
    """On a GPU: the plan is made against the card's total memory (asked in a child process, so the
    HTTP process holds no CUDA context), logged, and its max_batch taken."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    total = torch.cuda.mem_get_info()[1]
    plan = _plan("nemotron-h-tiny", torch.float32, total, None)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTMAMBA_DEVICE_MEMORY_GIB")}
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "fastmamba.serve", "--model", "nemotron-h-tiny", "--dtype",
                                 "fp32", "--device", "cuda", "--port", str(port), "--max-model-len", str(LEN),
                                 "--prefix-cache-gb", "0", "--log-level", "info"], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            import time

            url = f"http://127.0.0.1:{port}"
            for _ in range(600):
                if proc.poll() is not None:
                    break
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.5)
            text = log_path.read_text()
            assert plan.summary() in text, text
            assert f"{plan.max_batch} slots" in text
        finally:
            proc.terminate()
            proc.wait(60)
