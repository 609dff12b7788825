"""The server as an OpenAI / vLLM user meets it, on a tiny Mamba-2 checkpoint and a trained BPE
tokenizer written by transformers' ``save_pretrained`` (its chat template in ``chat_template.jinja``):
chat, message content as text parts, every request field honoured or refused by name, the usage
chunk, ``/tokenize`` / ``/detokenize`` / ``/version``, served model names, length limits, OpenAI-shaped
route errors, and a non-streaming client that hangs up. Driven through the official ``openai``
client and raw HTTP against a uvicorn subprocess."""
from __future__ import annotations

import json
import socket
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from fastmamba.generation.sampling import SamplingParams
from tests.serve.conftest import Server
from tests.serve.hf_checkpoints import checkpoint

LIMIT = 64  # --max-model-len
NAMES = ("tiny-mamba", "alias")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("mamba2") / "ckpt", "mamba2")


@pytest.fixture(scope="module")
def srv(ckpt, tmp_path_factory):
    s = Server(["--dtype", "auto", "--served-model-name", *NAMES, "--max-model-len", str(LIMIT), "--max-batch", "4"],
               tmp_path_factory.mktemp("log"), model=ckpt)
    yield s
    s.terminate()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def codec(ckpt):
    from fastmamba.serve.tokenization import Codec

    return Codec(ckpt)


def offline(ckpt, prompt: list[int], params: SamplingParams) -> list[int]:
    """The tokens of the same checkpoint through the offline engine, the request alone (reference ops)."""
    import fastmamba
    from fastmamba.generation.engine import Engine

    model = fastmamba.load_model(ckpt, dtype=torch.float32, device="cpu")
    return Engine(model, max_batch=1, cuda_graphs=False).generate([prompt], params)[0]


def post(srv, path: str, body) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(srv.url + path, content=data, headers={"Content-Type": "application/json"}, timeout=120)


def test_chat_from_chat_template_jinja_and_text_parts(srv, client, codec, ckpt, reference_ops):
    """The template of a tokenizer saved by current transformers (chat_template.jinja) renders the
    chat; content as a list of text parts is the same text joined by newlines."""
    msgs = [{"role": "system", "content": "you are a cat"}, {"role": "user", "content": "hello world"}]
    ids = codec.encode_chat(msgs)
    assert ids[0] == codec.tokenizer.token_to_id("<s>")  # the template writes the BOS, once
    want = offline(ckpt, ids, SamplingParams(max_new_tokens=6))
    out = client.chat.completions.create(model=NAMES[0], messages=msgs, max_tokens=6, temperature=0)
    assert out.choices[0].model_extra["token_ids"] == want[:len(out.choices[0].model_extra["token_ids"])]
    assert out.usage.prompt_tokens == len(ids)
    assert out.choices[0].message.content == codec.decode(out.choices[0].model_extra["token_ids"])
    parts = [{"role": "system", "content": [{"type": "text", "text": "you are"}, {"type": "text", "text": "a cat"}]},
             {"role": "user", "content": [{"type": "text", "text": "hello world"}]}]
    joined = codec.encode_chat([{"role": "system", "content": "you are\na cat"}, msgs[1]])
    got = client.chat.completions.create(model=NAMES[1], messages=parts, max_tokens=6, temperature=0)
    assert got.usage.prompt_tokens == len(joined)
    assert got.choices[0].model_extra["token_ids"] == offline(ckpt, joined, SamplingParams(max_new_tokens=6))[
        :len(got.choices[0].model_extra["token_ids"])]


def test_other_content_parts_are_refused_by_name(srv, client):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=NAMES[0], messages=msgs, max_tokens=2)
    body = err.value.body
    assert "image_url" in body["message"] and "messages[0].content[1]" in body["message"]
    assert body["param"] == "messages"


def test_include_usage_chunk(srv, client):
    """stream_options.include_usage: a last chunk with the usage and no choices, before [DONE]."""
    chunks = list(client.chat.completions.create(model=NAMES[0], messages=[{"role": "user", "content": "one two"}],
                                                 max_tokens=4, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == sum(len(c.choices[0].model_extra["token_ids"] or [])
                                                     for c in chunks[1:-1])
    assert all(c.usage is None for c in chunks[:-1])
    chunks = list(client.completions.create(model=NAMES[0], prompt="the cat", max_tokens=3, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 3 and usage.total_tokens == usage.prompt_tokens + 3
    plain = list(client.completions.create(model=NAMES[0], prompt="the cat", max_tokens=3, temperature=0, stream=True))
    assert all(c.usage is None and c.choices for c in plain)  # not asked: no usage chunk


def test_min_tokens_and_repetition_penalty(srv, client, codec, ckpt, reference_ops):
    """min_tokens holds the stop token back until that many tokens are out; repetition_penalty gives
    the offline engine's tokens (and not the unpenalised ones)."""
    prompt = codec.encode_prompt("the cat sat on the mat")
    greedy = offline(ckpt, prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
    stop = greedy[1]
    out = client.completions.create(model=NAMES[0], prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"stop_token_ids": [stop], "ignore_eos": True})
    assert out.choices[0].model_extra["token_ids"] == greedy[:2]
    params = SamplingParams(max_new_tokens=8, min_tokens=5, stop_token_ids=(stop,), ignore_eos=True)
    want = offline(ckpt, prompt, params)
    assert len(want) >= 5 and stop not in want[:4]
    out = client.completions.create(model=NAMES[0], prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"stop_token_ids": [stop], "ignore_eos": True, "min_tokens": 5})
    assert out.choices[0].model_extra["token_ids"] == want

    penalised = offline(ckpt, prompt, SamplingParams(max_new_tokens=8, repetition_penalty=1.8, ignore_eos=True))
    assert penalised != greedy  # the penalty matters for this prompt
    out = client.completions.create(model=NAMES[0], prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"repetition_penalty": 1.8, "ignore_eos": True})
    assert out.choices[0].model_extra["token_ids"] == penalised


def test_tokenize_detokenize_version(srv, codec):
    r = post(srv, "/tokenize", {"model": NAMES[0], "prompt": "hello caf\u00e9"})
    assert r.status_code == 200, r.text
    ids = codec.encode_prompt("hello caf\u00e9")
    assert r.json() == {"count": len(ids), "max_model_len": LIMIT, "tokens": ids, "token_strs": None}
    r = post(srv, "/tokenize", {"prompt": "hello", "add_special_tokens": False, "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == codec.tokenizer.encode("hello", add_special_tokens=False).ids
    assert len(body["token_strs"]) == body["count"]
    msgs = [{"role": "user", "content": "hello world"}]
    assert post(srv, "/tokenize", {"messages": msgs}).json()["tokens"] == codec.encode_chat(msgs)
    assert post(srv, "/detokenize", {"tokens": ids}).json() == {"prompt": "hello caf\u00e9"}
    r = post(srv, "/detokenize", {"tokens": [1, 10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = post(srv, "/tokenize", {"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    from fastmamba import __version__

    assert httpx.get(srv.url + "/version").json() == {"version": __version__}


def test_model_names(srv, client):
    assert [m.id for m in client.models.list().data] == list(NAMES)
    for name in NAMES:
        assert client.completions.create(model=name, prompt=[5, 6], max_tokens=1).choices
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt=[5, 6], max_tokens=1)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="mamba2-130m", messages=[{"role": "user", "content": "x"}])
    assert post(srv, "/v1/completions", {"prompt": [5, 6], "max_tokens": 1}).status_code == 200  # no model: fine


REFUSED = [
    ("response_format json", "/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("response_format schema", "/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format"),
    ("tools", "/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("tool_choice", "/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("guided_json", "/v1/completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("min_p", "/v1/completions", {"min_p": 0.1}, "min_p"),
    ("stream_options without stream", "/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("min_tokens above max_tokens", "/v1/completions", {"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ("negative min_tokens", "/v1/completions", {"min_tokens": -1}, "min_tokens"),
    ("repetition_penalty 0", "/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("max_tokens 10**30", "/v1/completions", {"max_tokens": 10**30}, "max_tokens"),
    ("max_tokens 2**63", "/v1/chat/completions", {"max_tokens": 2**63}, "max_tokens"),
    ("prompt + max_tokens above --max-model-len", "/v1/completions", {"max_tokens": LIMIT - 1}, "max_tokens"),
]


@pytest.mark.parametrize("what, path, extra, param", REFUSED, ids=[r[0] for r in REFUSED])
def test_fields_are_honoured_or_refused_by_name(srv, what, path, extra, param):
    base = {"prompt": [5, 6, 7]} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    before = srv.metric("fastmamba_prompt_tokens_total")
    r = post(srv, path, {**base, "model": NAMES[0], **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error"
    assert srv.metric("fastmamba_prompt_tokens_total") == before  # never reached the engine


def test_text_response_format_and_no_tools_pass(srv):
    r = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                            "response_format": {"type": "text"}, "tool_choice": "none", "tools": []})
    assert r.status_code == 200, r.text


def test_chat_without_max_tokens_fills_the_context(srv, client, codec):
    """--max-model-len caps a Mamba-2 model too: chat without max_tokens gets the rest of the context."""
    msgs = [{"role": "user", "content": "one two three"}]
    out = client.chat.completions.create(model=NAMES[0], messages=msgs, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == len(codec.encode_chat(msgs))
    assert out.usage.total_tokens == LIMIT and out.choices[0].finish_reason == "length"


@pytest.mark.parametrize("method, path, status", [("GET", "/v1/completions", 405), ("GET", "/v1/chat/completions", 405),
                                                  ("GET", "/nope", 404), ("POST", "/v1/nope", 404),
                                                  ("DELETE", "/v1/models", 405)])
def test_routes_answer_in_openai_shape(srv, method, path, status):
    r = httpx.request(method, srv.url + path, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and path in err["message"]


def test_non_streaming_client_that_hangs_up_frees_its_slot(srv):
    """A non-streaming request whose client disconnects is aborted at once: its slots come back within
    a bounded time, long before its choices (16 of them on 4 slots) would have run out."""
    n, limit = 16, LIMIT - 3
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": limit, "n": n, "ignore_eos": True,
                       "temperature": 0}).encode()
    for _ in range(2):
        gone = hung_up(srv)
        tokens = srv.metric("fastmamba_generation_tokens_total")
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.time() + 30
        while srv.metric("fastmamba_slots_in_use") == 0 and time.time() < deadline:
            time.sleep(0.02)
        assert srv.metric("fastmamba_slots_in_use") > 0
        s.close()  # the client goes away mid-request
        t0 = time.time()
        while (srv.metric("fastmamba_slots_in_use") or srv.metric("fastmamba_waiting_requests")) and time.time() - t0 < 10:
            time.sleep(0.02)
        assert srv.metric("fastmamba_slots_in_use") == 0 and srv.metric("fastmamba_running_requests") == 0
        assert srv.metric("fastmamba_waiting_requests") == 0
        assert srv.metric("fastmamba_generation_tokens_total") - tokens < n * limit  # it did not run to the end
        assert hung_up(srv) == gone + 1


def hung_up(srv) -> float:
    """Completions whose client left before the answer (status 499 in the metrics; 0 before the first)."""
    try:
        return srv.metric('fastmamba_requests_total{endpoint="/v1/completions",status="499"}')
    except KeyError:
        return 0.0
