"""``fastmamba serve --tensor-parallel-size 2`` on CPUs (gloo): the engine process is rank 0 of 2
and keeps the other rank in step (``fastmamba.distributed.serve_workers``). Through the real
server (uvicorn in a subprocess on 127.0.0.1) and the official ``openai`` client, over a
Nemotron-H checkpoint written by transformers' ``save_pretrained``: greedy requests, sent together,
give TP=1's tokens (the offline engine's); a repeated prompt (a prefix-cache hit), an unseeded
sampled request (every rank must draw the same token) and a client that hangs up mid-stream
(an abort on every rank) leave the ranks in step; SIGTERM ends every rank with status 0. The flag
is checked before anything starts."""
from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
pytest.importorskip("transformers")

PROMPTS = [[5, 17, 60, 3, 44], [9, 2], [70, 71, 72, 10, 11, 12, 1]]
MAX_NEW = 6


@pytest.fixture(scope="module")
def nemotron_dir(tmp_path_factory):
    from tests.distributed._checkpoints import save_nemotron_h

    return save_nemotron_h(tmp_path_factory.mktemp("tp_serve") / "nemotron_h")


def _serve_tp2_equals_tp1(nemotron_dir: str, tmp_path, device: str) -> None:
    import httpx
    import openai

    import fastmamba
    from tests.distributed._workers import greedy
    from tests.serve.conftest import Server

    lm = fastmamba.load_model(nemotron_dir, device="cuda:0" if device == "cuda" else device)
    want = greedy(lm, PROMPTS, MAX_NEW, cuda_graphs=device == "cuda")
    del lm
    server = Server(["--tensor-parallel-size", "2", "--max-batch", "4", "--prefix-cache-gb", "0.02",
                     "--device", device], tmp_path, model=nemotron_dir)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)

        def ask(prompt, **kw):
            out = client.completions.create(model=nemotron_dir, prompt=prompt, max_tokens=MAX_NEW, **kw)
            return out.choices[0]

        got: dict[int, list[int]] = {}
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, ask(PROMPTS[i], temperature=0)
                                                                     .model_extra["token_ids"]))
                   for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert [got.get(i) for i in range(len(PROMPTS))] == want, server.output()
        # no seed: the ranks share one generator's draws; min_tokens keeps a drawn EOS from ending it early
        sampled = ask(PROMPTS[0], temperature=1.0, extra_body={"min_tokens": MAX_NEW})
        assert len(sampled.model_extra["token_ids"]) == MAX_NEW and sampled.finish_reason == "length"
        with httpx.Client(base_url=server.url, timeout=120) as http:  # hang up after two chunks
            body = {"prompt": PROMPTS[2], "max_tokens": 40, "temperature": 0, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for i, _ in enumerate(r.iter_lines()):
                    if i >= 2:
                        break
        assert ask(PROMPTS[1], temperature=0).model_extra["token_ids"] == want[1]  # a prefix-cache hit
        assert ask(PROMPTS[2], temperature=0).model_extra["token_ids"] == want[2]
    finally:
        code = server.terminate()
    log = server.log_path.read_text()
    assert code == 0, log[-3000:]
    assert "tensor-parallel ranks 1..1 exited with codes [0]" in log, log[-3000:]
    assert "diverged" not in log and "Traceback" not in log, log[-3000:]


def test_serve_tp2_equals_tp1_and_exits_0(nemotron_dir, tmp_path):
    _serve_tp2_equals_tp1(nemotron_dir, tmp_path, "cpu")


NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.kernels
@pytest.mark.skipif(NGPU < 2, reason=f"serving over NCCL needs 2 CUDA GPUs; this machine has {NGPU}")
def test_serve_tp2_gpu_nccl_equals_tp1(nemotron_dir, tmp_path):
    """The same on 2 GPUs: NCCL, the Triton kernels and the engine's CUDA graphs on every rank."""
    _serve_tp2_equals_tp1(nemotron_dir, tmp_path, "cuda")


@pytest.mark.parametrize("flags, match", [
    (["--tensor-parallel-size", "3"], "cannot shard 8 heads (nheads=8) over world size 3"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size: expected an integer >= 1, got 0"),
    (["--tp", "2", "--device", "cuda"], "--device cuda with --tensor-parallel-size 2 needs 2 CUDA GPUs"),
])
def test_serve_tp_flag_checked_before_start(capfd, flags, match):
    from fastmamba.serve.cli import main

    if "cuda" in flags and torch.cuda.is_available():
        pytest.skip("checks the answer on a machine without CUDA")
    assert main(["--model", "mamba2-tiny", "--port", "1", *flags]) == 2
    err = capfd.readouterr().err
    assert err.count("error:") == 1 and match in err, err
