"""The server's life over a hybrid checkpoint (Nemotron-H written by transformers' save_pretrained,
with a trained tokenizer): the start-up log, the K/V sized by the checkpoint's
max_position_embeddings or by --max-model-len (8192 admits a 6000-token prompt), --chat-template,
a non-streaming client that hangs up giving its slot and pages back, and SIGTERM draining the
admitted requests for --shutdown-timeout seconds, then aborting the rest and exiting 0 with no
traceback (with a request whose client stopped reading still running)."""
from __future__ import annotations

import json
import signal
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")

from tests.serve.conftest import Server
from tests.serve.hf_checkpoints import checkpoint

MAX_POS = 256
DRAIN_S = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("hybrid") / "ckpt", "nemotron_h", max_position_embeddings=MAX_POS)


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "override.jinja"
    path.write_text("{% for m in messages %}OVERRIDE {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return path


@pytest.fixture(scope="module")
def srv(ckpt, template, tmp_path_factory):
    s = Server(["--log-level", "info", "--max-batch", "2", "--chat-template", str(template),
                "--shutdown-timeout", str(DRAIN_S)], tmp_path_factory.mktemp("log"), model=ckpt)
    yield s
    s.terminate()


def post(srv, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=timeout)


def test_start_up_log_names_what_runs(srv, ckpt):
    log = srv.output()
    for fragment in (f"model {ckpt}", "NemotronHLM", "dtype float32", "device cpu", "2 slots",
                     f"K/V pages of 16 tokens (at most {MAX_POS} tokens per request)", "prefix cache",
                     "warming up", "warm-up took", "chat template yes", f"listening on http://127.0.0.1:{srv.port}"):
        assert fragment in log, (fragment, log)
    assert log.index("warming up") < log.index("warm-up took")


def test_kv_and_limit_from_max_position_embeddings(srv):
    """No --max-model-len: the checkpoint's max_position_embeddings bounds requests and sizes the K/V."""
    assert httpx.get(srv.url + "/v1/models").json()["data"][0]["max_model_len"] == MAX_POS
    r = post(srv, "/v1/completions", {"prompt": [7] * (MAX_POS - 6), "max_tokens": 10})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert str(MAX_POS) in r.json()["error"]["message"]
    r = post(srv, "/v1/completions", {"prompt": [7] * (MAX_POS - 6), "max_tokens": 6, "ignore_eos": True})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 6


def test_chat_template_flag_overrides_the_tokenizers(srv):
    r = post(srv, "/tokenize", {"messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200, r.text
    assert "OVERRIDE hello" in post(srv, "/detokenize", {"tokens": r.json()["tokens"]}).json()["prompt"]
    out = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3,
                                             "temperature": 0, "ignore_eos": True})
    assert out.status_code == 200 and out.json()["usage"]["prompt_tokens"] == r.json()["count"]


def _hold(srv, body: dict) -> socket.socket:
    """A raw client that sends a non-streaming request and then neither reads nor closes."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return s


def _wait(srv, name: str, value: float, timeout: float) -> float:
    t0 = time.time()
    while srv.metric(name) != value and time.time() - t0 < timeout:
        time.sleep(0.02)
    assert srv.metric(name) == value, name
    return time.time() - t0


def test_hung_up_client_gives_slot_and_pages_back(srv):
    s = _hold(srv, {"prompt": [9] * 40, "max_tokens": 200, "ignore_eos": True})
    _wait(srv, "fastmamba_slots_in_use", 1, 30)
    assert srv.metric("fastmamba_kv_pages_in_use") > 0
    s.close()
    _wait(srv, "fastmamba_slots_in_use", 0, 10)
    _wait(srv, "fastmamba_kv_pages_in_use", 0, 10)


@pytest.fixture(scope="module")
def long_srv(ckpt, tmp_path_factory):
    s = Server(["--max-model-len", "8192", "--max-batch", "2", "--prefix-cache-gb", "0",
                "--shutdown-timeout", str(DRAIN_S)], tmp_path_factory.mktemp("log"), model=ckpt)
    yield s
    s.terminate()


def test_max_model_len_8192_admits_a_6000_token_prompt(long_srv):
    """--max-model-len sizes the hybrid's K/V (it was fixed at 4096 tokens whatever the flag said)."""
    s = long_srv
    assert httpx.get(s.url + "/v1/models").json()["data"][0]["max_model_len"] == 8192
    r = post(s, "/v1/completions", {"prompt": [11] * 6000, "max_tokens": 2, "ignore_eos": True}, timeout=600)
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": 6000, "completion_tokens": 2, "total_tokens": 6002}
    r = post(s, "/v1/completions", {"prompt": [11] * 8190, "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_sigterm_drains_then_aborts_and_exits_0(long_srv):
    """Last in this module: SIGTERM while a short streamed request runs (it finishes) and a long one
    whose client stopped reading runs too (aborted when the drain ends: the server does not wait
    for it); the process exits 0 with no traceback."""
    s = long_srv
    stuck = _hold(s, {"prompt": [3] * 20, "max_tokens": 8000, "ignore_eos": True})
    _wait(s, "fastmamba_slots_in_use", 1, 30)
    started, result = threading.Event(), {"tokens": [], "finish": None}

    def short():
        body = {"prompt": [4] * 5, "max_tokens": 8, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    result["tokens"] += choice["token_ids"]
                    result["finish"] = choice["finish_reason"] or result["finish"]
                    started.set()

    t = threading.Thread(target=short)
    t.start()
    assert started.wait(60)  # the short request is running (it has a token)
    t0 = time.time()
    s.proc.send_signal(signal.SIGTERM)
    rc = s.proc.wait(DRAIN_S + 30)
    took = time.time() - t0
    t.join(10)
    stuck.close()
    log = s.output()
    assert rc == 0, log
    assert len(result["tokens"]) == 8 and result["finish"] == "length"
    assert "Traceback" not in log and "graceful shutdown exceeded" not in log.lower()
    assert took < DRAIN_S + 20, took
