"""Capacity planning under tensor parallelism: each GPU is planned for rank 0's share, built on the
meta device from the config alone (``tp_meta_model``), and ``fastmamba serve --tensor-parallel-size N``
plans with it before any process starts or weight is read (on the CPU against a given device size)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fastmamba.distributed.launch import spawn_tp
from fastmamba.distributed.loading import tp_meta_model
from fastmamba.generation.capacity import GiB, CapacityError, meta_model, per_request_bytes, plan_capacity, weight_bytes
from tests.distributed._workers import tp_cache_bytes

NAMES = ["nemotron-3-tiny", "nemotron-h-tiny", "mamba2-tiny"]


def share(name: str, world: int, dtype=torch.float32) -> tuple[int, int, int]:
    m = tp_meta_model(name, world, dtype)
    return (weight_bytes(m), *per_request_bytes(m, max_seq_len=256))


def test_the_meta_share_is_what_rank_0_loads():
    """Two gloo ranks load each preset (fp32): rank 0's weights, slot and page bytes equal the meta
    share the planner counts, and rank 1's are no larger."""
    ranks = spawn_tp(tp_cache_bytes, 2, NAMES, device="cpu")
    for name in NAMES:
        assert ranks[0][name] == share(name, 2), name
        assert all(b <= a for a, b in zip(ranks[0][name], ranks[1][name])), name


@pytest.mark.parametrize("name", NAMES)
def test_a_share_is_about_half(name):
    whole = meta_model(name, torch.float32)
    w, slot, page = share(name, 2)
    assert 0.45 * weight_bytes(whole) < w < 0.6 * weight_bytes(whole)  # norms, router, A/D replicated
    s1, p1 = per_request_bytes(whole, max_seq_len=256)
    assert slot <= 0.55 * s1 and page == p1 // 2


def test_the_share_takes_the_dtype_meta_model_takes(tmp_path):
    """Without a dtype the share is built in the dtype ``meta_model`` picks: a preset's bfloat16, a
    checkpoint directory's config.json ``torch_dtype`` (float32 here, as save_pretrained writes it)."""
    pytest.importorskip("transformers")
    from tests.distributed._checkpoints import save_nemotron_h

    assert tp_meta_model("nemotron-h-tiny", 2).lm_head.weight.dtype == torch.bfloat16
    d = save_nemotron_h(tmp_path / "ckpt")
    assert meta_model(d).lm_head.weight.dtype == torch.float32
    assert tp_meta_model(d, 2).lm_head.weight.dtype == torch.float32


def test_a_shape_that_does_not_split_is_named():
    with pytest.raises(ValueError, match="tp_meta_model: cannot shard"):
        tp_meta_model("nemotron-h-tiny", 3)


def _serve(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "fastmamba.serve", "--model", "nemotron-h-tiny", "--device", "cpu",
                           "--dtype", "fp32", "--max-model-len", "256", "--prefix-cache-gb", "0", *argv],
                          capture_output=True, text=True, timeout=120, env=env)


def test_serve_plans_each_gpu_for_its_share():
    """A device size where 2 ranks admit a --max-batch that one GPU cannot hold: --tensor-parallel-size 1
    refuses it with the whole model's plan, 2 admits it and refuses one more than its own largest with
    rank 0's share's numbers, both before the port is bound or any rank starts."""
    from fastmamba.bench.capacity import largest_admitted

    gib = 1.2
    device = int(gib * GiB)

    def plan(world, max_batch):
        m = (meta_model("nemotron-h-tiny", torch.float32) if world == 1
             else tp_meta_model("nemotron-h-tiny", world, torch.float32))
        return plan_capacity(m, device_bytes=device, gpu_memory_utilization=0.9, max_batch=max_batch,
                             max_seq_len=256, ssm_dtype=torch.float32, prefill_tokens=2048)

    def fits(world):
        def check(m):
            try:
                plan(world, m)
                return True
            except CapacityError:
                return False
        return check

    m1, m2 = largest_admitted(fits(1)), largest_admitted(fits(2))
    assert 0 < m1 < m2, (m1, m2)  # each GPU holds about half of a request's state under 2 ranks
    with pytest.raises(CapacityError) as refused_one:
        plan(1, m1 + 1)
    r = _serve("--device-memory-gib", repr(gib), "--max-batch", str(m1 + 1))
    assert r.returncode == 2 and r.stderr.strip() == f"fastmamba serve: error: {refused_one.value}", r.stderr
    with pytest.raises(CapacityError) as refused_two:
        plan(2, m2 + 1)
    r = _serve("--device-memory-gib", repr(gib), "--max-batch", str(m2 + 1), "--tensor-parallel-size", "2")
    assert r.returncode == 2 and r.stderr.strip() == f"fastmamba serve: error: {refused_two.value}", r.stderr
    assert "fit" in str(refused_two.value)


def test_a_planned_tp2_server_takes_its_plan_and_answers(tmp_path):
    """No --max-batch under 2 ranks and a given device size: the server logs rank 0's plan, takes its
    max_batch and pages, and answers a greedy request with TP=1's tokens."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    import fastmamba
    from tests.distributed._workers import greedy
    from tests.serve.conftest import Server

    meta = tp_meta_model("nemotron-h-tiny", 2, torch.float32)

    def plan_for(device_bytes):
        return plan_capacity(meta, device_bytes=device_bytes, gpu_memory_utilization=0.9, max_seq_len=256,
                             ssm_dtype=torch.float32, prefill_tokens=2048)

    roomy = plan_for(1 << 40)  # a device size that holds 3.5 full-length requests per GPU
    one = roomy.slot_bytes + -(-256 // roomy.page_size) * roomy.page_bytes
    gib = (roomy.weight_bytes + roomy.reserve_bytes + 3.5 * one) / 0.9 / GiB
    plan = plan_for(int(gib * GiB))
    assert plan.max_batch == 3
    prompt = [5, 17, 60, 3, 44]
    want = greedy(fastmamba.load_model("nemotron-h-tiny", device="cpu", dtype=torch.float32), [prompt], 5)[0]
    server = Server(["--tensor-parallel-size", "2", "--max-model-len", "256", "--prefix-cache-gb", "0",
                     "--device-memory-gib", repr(gib), "--log-level", "info"], tmp_path, model="nemotron-h-tiny")
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
    finally:
        code = server.terminate()
    log = server.log_path.read_text()
    assert code == 0, log[-3000:]
    assert f"{plan.summary()} (per GPU: rank 0's share of 2)" in log, log[-3000:]
    assert f"--max-batch not given: {plan.max_batch}, what the capacity plan holds" in log, log[-3000:]
