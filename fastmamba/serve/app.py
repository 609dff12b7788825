"""Routes of the OpenAI-compatible server: named handlers over one ``ServerState``.

    POST /v1/completions, /v1/chat/completions   (``stream: true``: server-sent events, ``data: [DONE]`` last;
                                                  ``stream_options.include_usage``: a usage chunk before it)
    GET  /v1/models, /health, /metrics, /version
    POST /tokenize, /detokenize                  (vLLM's shapes)

Every request is validated where it enters (``protocol.py``; here: the ``model`` name, token ids
against the vocabulary, lengths against ``max_model_len`` and the K/V cache) and refused with an
OpenAI-style error before it reaches the engine. A full waiting queue, or a server that is shutting
down, answers 503 with ``Retry-After``. A client that disconnects (streaming or not) has its
requests aborted: their slots and pages are freed at the serving loop's next turn. Unknown routes
and wrong methods get OpenAI-shaped 404 / 405 bodies too.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastmamba.generation.sampling import SamplingParams
from fastmamba.serve.engine_process import EngineProcess
from fastmamba.serve.engine_thread import EngineThread
from fastmamba.serve.metrics import ServerMetrics
from fastmamba.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, \
    error_body
from fastmamba.serve.tokenization import Codec
from fastmamba.serve.worker import SHUTDOWN, EngineClient, QueueFull, RequestHandle

RETRY_AFTER_S = 1
GIL_SWITCH_S = 0.0005  # see serve()
DEFAULT_SHUTDOWN_S = 30.0
DEFAULT_CHAT_MAX_TOKENS = 256  # chat without max_tokens on a model with no length limit
MAX_TOKENS_CEILING = 1 << 24  # max_tokens above this is refused even where nothing else limits it


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.type, self.code = param, status, type, code


class ClientGone(Exception):
    """The client of a non-streaming request disconnected before its answer was ready."""


@dataclasses.dataclass
class ServerState:
    """What the handlers share: the engine's client, the tokenizer, the metrics and the limits.

    served_names   the names the ``model`` field may take (the first is reported in responses)
    max_model_len  prompt + max_tokens must not exceed it (None: no such limit; a model with
                   attention layers still has its K/V limit, ``worker.max_request_tokens``)
    """

    worker: EngineClient
    codec: Codec
    metrics: ServerMetrics
    served_names: tuple[str, ...]
    max_model_len: int | None
    shutdown_timeout: float = DEFAULT_SHUTDOWN_S

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    @property
    def context_limit(self) -> int | None:
        """The most prompt + max_tokens one request may have: ``max_model_len`` and the K/V limit
        (a request holds prompt + max_tokens - 1 K/V positions)."""
        kv = self.worker.max_request_tokens
        limits = [v for v in (self.max_model_len, None if kv is None else kv + 1) if v is not None]
        return min(limits) if limits else None


def _state(request: Request) -> ServerState:
    return request.app.state.server


# ---------------------------------------------------------------------------------------------- choices


class _Choice:
    """One choice being generated: its engine request, tokens, text and stop-string handling."""

    def __init__(self, index: int, handle: RequestHandle, stops: list[str], codec: Codec):
        self.index, self.handle, self.stops, self.codec = index, handle, stops, codec
        self.tokens: list[int] = []
        self.logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = []  # per token, when asked
        self.text = ""  # decoded output, cut at a matched stop string
        self.sent = 0  # characters of text already streamed
        self.streamed = 0  # tokens already streamed
        self.finish_reason: str | None = None
        self.ended = False  # its last event ("finished" or "error") came
        self.last_token_at: float | None = None
        self.search_from = 0  # stop strings are looked for from here (min_tokens: not before it)

    def add(self, out) -> None:
        """Take one ``StepOutput``."""
        self.tokens.append(out.token)
        if out.logprob is not None:
            self.logprobs.append((out.logprob, out.top_logprobs or ()))
        if not self.codec.has_text:
            return
        text = self.codec.decode(self.tokens)
        min_tokens = self.handle.params.min_tokens
        if len(self.tokens) < min_tokens:  # as vLLM: no stop string before min_tokens
            self.text, self.search_from = text, len(text)
            return
        for s in self.stops:
            at = text.find(s, max(self.search_from - len(s) + 1, 0) if min_tokens else 0)
            if at >= 0 and at + len(s) > self.search_from:
                self.text = text[:at]
                self.finish_reason = "stop"
                return
        self.text = text

    def safe_text(self) -> str:
        """Text that can be streamed now: not a possible start of a stop string, no partial character."""
        text = self.text
        if self.finish_reason is None:
            hold = max((len(s) - 1 for s in self.stops), default=0)
            text = text[:max(len(text) - hold, 0)]
            if text.endswith("\ufffd"):
                text = text[:-1]
        return text


def _token_text(codec: Codec, token: int) -> str:
    """A token as OpenAI's logprobs name it: its text, or ``token_id:N`` without a tokenizer."""
    return codec.decode([token]) if codec.has_text else f"token_id:{token}"


def completion_logprobs(codec: Codec, tokens: list[int], lps: list, offset: int = 0) -> dict:
    """The completions API's logprobs object for ``tokens`` (their (logprob, top) pairs in ``lps``);
    ``offset``: text characters before the first of them."""
    names = [_token_text(codec, t) for t in tokens]
    offsets = []
    for n in names:
        offsets.append(offset)
        offset += len(n)
    return {"tokens": names, "token_logprobs": [lp for lp, _ in lps],
            "top_logprobs": [{_token_text(codec, t): v for t, v in top} for _, top in lps], "text_offset": offsets}


def chat_logprobs(codec: Codec, tokens: list[int], lps: list) -> dict:
    """The chat API's logprobs object: {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}."""
    def entry(t, v):
        name = _token_text(codec, t)
        return {"token": name, "logprob": v, "bytes": list(name.encode())}
    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top]}
                        for t, (lp, top) in zip(tokens, lps)]}


# ---------------------------------------------------------------------------------------------- checks


def check_model(state: ServerState, name: str | None) -> None:
    """404 ``model_not_found`` unless ``name`` is one of the served names (or absent)."""
    if name is not None and name not in state.served_names:
        raise BadRequest(f"The model `{name}` does not exist; this server serves {', '.join(state.served_names)}",
                         param="model", status=404, code="model_not_found")


def check_ids(state: ServerState, ids: list[int], param: str) -> list[int]:
    vocab = state.worker.vocab_size
    if ids and 0 <= min(ids) and max(ids) < vocab:  # the common case at C speed
        return ids
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise BadRequest(f"{param}: token ids {bad[:4]} are outside the vocabulary [0, {vocab})", param=param)
    return ids


def encode_prompt(state: ServerState, p, param: str) -> list[int]:
    if isinstance(p, str):
        if not state.codec.has_text:
            raise BadRequest(f"{param}: this model has no tokenizer; send token ids", param=param)
        ids = state.codec.encode_prompt(p)
        if not ids:
            raise BadRequest(f"{param}: the text encodes to no tokens", param=param)
        return ids
    return check_ids(state, p if type(p) is list else list(p), param)  # pydantic's list is ours to keep


def check_lengths(state: ServerState, prompt_len: int, max_tokens: int) -> None:
    """400 when prompt + max_tokens exceed ``max_model_len`` or one request's K/V, or max_tokens is absurd."""
    limit = state.max_model_len
    if limit is not None and prompt_len + max_tokens > limit:
        raise BadRequest(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceed the model's limit "
                         f"of {limit} tokens (max_model_len)", param="prompt" if prompt_len >= limit else "max_tokens")
    kv_limit = state.worker.max_request_tokens  # a model with attention layers: its K/V cache per request
    if kv_limit is not None and prompt_len + max_tokens - 1 > kv_limit:
        raise BadRequest(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) need "
                         f"{prompt_len + max_tokens - 1} KV positions; one request of this model holds at most "
                         f"{kv_limit} (its KV cache: --max-model-len and the page pool); shorten the prompt "
                         "or lower max_tokens", param="prompt" if prompt_len > kv_limit else "max_tokens")
    if max_tokens > MAX_TOKENS_CEILING:
        raise BadRequest(f"max_tokens: {max_tokens} is more than fastmamba generates for one request "
                         f"({MAX_TOKENS_CEILING}); set --max-model-len to bound requests", param="max_tokens")


def sampling_params(state: ServerState, req, max_tokens: int, prompt_len: int, i: int,
                    logprobs: int | None) -> SamplingParams:
    check_lengths(state, prompt_len, max_tokens)
    if req.min_tokens > max_tokens:
        raise BadRequest(f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})", param="min_tokens")
    return SamplingParams(temperature=req.temperature, top_k=max(req.top_k, 0), top_p=req.top_p,
                          seed=None if req.seed is None else req.seed + i, max_new_tokens=max_tokens,
                          stop_token_ids=tuple(check_ids(state, req.stop_token_ids or [], "stop_token_ids")),
                          logprobs=logprobs, ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
                          repetition_penalty=req.repetition_penalty)


async def parse(request: Request, schema):
    """The body validated against ``schema`` (one pass through pydantic's own JSON reader: a 2k-token
    prompt in 0.2 ms against 0.8 ms through json.loads and then model_validate); 400 naming the field."""
    body = await request.body()
    try:
        return schema.model_validate_json(body)
    except Exception as exc:  # pydantic.ValidationError: reuse the handler's wording
        errors = getattr(exc, "errors", lambda: [])()
        err = errors[0] if errors else {}
        if err.get("type") == "json_invalid":
            raise BadRequest("the body is not valid JSON") from None
        if err.get("type") == "model_type" and not err.get("loc"):
            raise BadRequest("the body must be a JSON object") from None
        raise _validation_error(err, str(exc)) from None


def _validation_error(err: dict, fallback: str) -> BadRequest:
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    msg = str(err.get("msg", fallback)).removeprefix("Value error, ")
    if loc:
        return BadRequest(f"{'.'.join(loc)}: {msg}", param=loc[0])
    # a whole-request check names its field first ("tools: not supported ..."): that is the param
    named = re.match(r"([A-Za-z_]+)[\[:.]", msg)
    return BadRequest(msg, param=named.group(1) if named else None)


# ---------------------------------------------------------------------------------------------- running


def submit_all(state: ServerState, prompts: list[list[int]], req, max_tokens: int | Callable[[int], int],
               logprobs: int | None) -> list[_Choice]:
    """Check every choice of the request, then submit them all (or none: 503 when the queue is full)."""
    codec, worker = state.codec, state.worker
    stops = list(req.stop or [])
    if stops and not codec.has_text:
        raise BadRequest("stop: stop strings need a tokenizer; use stop_token_ids", param="stop")
    limit = max_tokens if callable(max_tokens) else lambda n: max_tokens
    planned = [(ids, sampling_params(state, req, limit(len(ids)), len(ids), i, logprobs))
               for ids in prompts for i in range(req.n)]
    choices, events = [], asyncio.Queue()  # one queue for all the choices of this request
    try:
        for k, (ids, params) in enumerate(planned):
            choices.append(_Choice(k, worker.submit(ids, params, events), stops, codec))
    except QueueFull as exc:
        for c in choices:
            worker.abort(c.handle)
        raise BadRequest(f"server busy: {exc}; retry later", status=503, type="server_busy") from None
    state.metrics.prompt_tokens.inc(sum(len(ids) for ids, _ in planned))
    return choices


def take(state: ServerState, choices: list[_Choice], event) -> tuple[_Choice, str]:
    """Apply one event of the request's queue to its choice; returns (choice, "token" | "finished"),
    or raises RuntimeError for an error event."""
    handle, kind, value = event
    choice = next(c for c in choices if c.handle is handle)
    if kind == "token":
        now = time.perf_counter()
        if choice.last_token_at is None:
            state.metrics.ttft.observe(now - choice.handle.submitted_at)
        else:
            state.metrics.itl.observe(now - choice.last_token_at)
        choice.last_token_at = now
        if choice.finish_reason is None:  # tokens after a matched stop string are dropped
            choice.add(value)
            if choice.finish_reason is not None:
                state.worker.abort(choice.handle)  # a stop string matched: the engine may stop
        return choice, "token"
    if kind == "finished":
        if choice.finish_reason is None:  # the engine's reason: eos / stop -> "stop", length -> "length"
            limit = choice.handle.params.max_new_tokens
            choice.finish_reason = "length" if value == "length" or len(choice.tokens) >= limit else "stop"
        choice.ended = True
        return choice, "finished"
    choice.finish_reason = choice.finish_reason or "error"
    choice.ended = True
    raise RuntimeError(str(value))


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_to_end(state: ServerState, request: Request, choices: list[_Choice]) -> None:
    """Wait until every choice has ended; a client that disconnects meanwhile has its choices
    aborted at once (raises ClientGone)."""
    events = choices[0].handle.events

    async def collect():
        while not all(c.ended for c in choices):
            take(state, choices, await events.get())

    work, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            if not task.done():
                task.cancel()
    if work.done():
        return work.result()  # RuntimeError of an error event propagates
    for c in choices:
        state.worker.abort(c.handle)
    raise ClientGone()


def usage(prompts: list[list[int]], n: int, choices: list[_Choice]) -> dict:
    p = sum(len(ids) for ids in prompts) * n
    c = sum(len(ch.tokens) for ch in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _sse(chunk: dict) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


async def stream(state: ServerState, choices: list[_Choice], make_chunk, first_chunks: list[dict],
                 usage_chunk: Callable[[], dict] | None) -> AsyncIterator[str]:
    """Server-sent events: one chunk per token (text held back while it may start a stop string),
    a last chunk per choice with its finish reason, the usage chunk when asked, then
    ``data: [DONE]``. The events that are ready go out in one write. A client that disconnects
    cancels this generator: its choices are aborted."""
    events = choices[0].handle.events
    try:
        parts = [_sse(chunk) for chunk in first_chunks]
        while not all(c.ended for c in choices):
            batch = [await events.get()]
            while not events.empty():
                batch.append(events.get_nowait())
            for event in batch:
                try:
                    c, kind = take(state, choices, event)
                except RuntimeError as exc:
                    kind = "server_shutting_down" if str(exc) == SHUTDOWN else "server_error"
                    parts.append(_sse(error_body(str(exc), type=kind)))
                    continue
                if kind == "token":
                    if len(c.tokens) > c.streamed:  # every kept token (its text may be held back or empty)
                        new_text = c.safe_text()[c.sent:]
                        c.sent += len(new_text)
                        parts.append(_sse(make_chunk(c, new_text, c.tokens[c.streamed:], None)))
                        c.streamed = len(c.tokens)
                else:
                    rest = c.text[c.sent:]
                    c.sent += len(rest)
                    parts.append(_sse(make_chunk(c, rest, [], c.finish_reason)))
            yield "".join(parts)
            parts = []
        if usage_chunk is not None:
            parts.append(_sse(usage_chunk()))
        yield "".join(parts) + "data: [DONE]\n\n"
    finally:
        for c in choices:
            state.worker.abort(c.handle)


async def finish(state: ServerState, request: Request, choices: list[_Choice], path: str, body: Callable[[], dict]):
    """A non-streaming answer: wait for the choices (aborting them if the client leaves), then ``body()``."""
    try:
        await run_to_end(state, request, choices)
    except ClientGone:
        state.metrics.requests.labels(path, "499").inc()
        return Response(status_code=499)  # nobody reads it
    except RuntimeError as exc:
        if str(exc) == SHUTDOWN:
            return _fail(503, f"{exc}: the request did not finish in time", type="server_shutting_down")
        return _fail(500, str(exc), type="server_error")
    state.metrics.requests.labels(path, "200").inc()
    return body()


def _fail(status: int, message: str, *, param=None, type="invalid_request_error", code=None,
          headers=None) -> JSONResponse:
    if status == 503 and headers is None:
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    return JSONResponse(error_body(message, type=type, param=param, code=code), status_code=status, headers=headers)


# ---------------------------------------------------------------------------------------------- routes


async def health(request: Request):
    if not _state(request).worker.alive():
        return _fail(503, "the engine is not running", type="server_error")
    return {"status": "ok"}


async def metrics_page(request: Request):
    state = _state(request)
    state.metrics.observe_thread(state.worker.timing)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def version(request: Request):
    from fastmamba import __version__

    return {"version": __version__}


async def models(request: Request):
    state = _state(request)
    created = int(time.time())
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": "fastmamba", "root": state.model_name,
         "parent": None, "max_model_len": state.context_limit} for name in state.served_names]}


async def tokenize(request: Request):
    """vLLM's ``/tokenize``: {"prompt": text} (``add_special_tokens``, default true) or {"messages":
    [...]} (``add_generation_prompt``, default true) -> {"count", "max_model_len", "tokens", "token_strs"}."""
    state = _state(request)
    req = await parse(request, TokenizeRequest)
    check_model(state, req.model)
    codec = state.codec
    if not codec.has_text:
        raise BadRequest("this model has no tokenizer (tokenizer.json): nothing to tokenize",
                         param="prompt" if req.prompt is not None else "messages")
    if req.prompt is not None:
        ids = codec.encode_prompt(req.prompt) if req.add_special_tokens \
            else codec.tokenizer.encode(req.prompt, add_special_tokens=False).ids
    else:
        ids = _chat_ids(state, req.messages, add_generation_prompt=req.add_generation_prompt)
    strs = [codec.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.context_limit, "tokens": ids, "token_strs": strs}


async def detokenize(request: Request):
    """vLLM's ``/detokenize``: {"tokens": [ids]} -> {"prompt": text}."""
    state = _state(request)
    req = await parse(request, DetokenizeRequest)
    check_model(state, req.model)
    if not state.codec.has_text:
        raise BadRequest("this model has no tokenizer (tokenizer.json): nothing to detokenize", param="tokens")
    return {"prompt": state.codec.decode(check_ids(state, list(req.tokens), "tokens"))}


def _chat_ids(state: ServerState, messages, *, add_generation_prompt: bool = True) -> list[int]:
    codec = state.codec
    if not codec.has_text or not codec.chat_template:
        raise BadRequest("this model has no chat template (chat_template.jinja, chat_template.json or "
                         "tokenizer_config.json `chat_template`; or serve --chat-template FILE); use /v1/completions",
                         param="messages")
    try:
        ids = codec.encode_chat([m.model_dump(exclude_none=True) for m in messages],
                                add_generation_prompt=add_generation_prompt)
    except ImportError as exc:
        raise BadRequest(str(exc), status=500, type="server_error") from None
    except Exception as exc:  # noqa: BLE001 - a template error (jinja2's TemplateError, raise_exception ...)
        raise BadRequest(f"messages: the chat template failed on these messages: {type(exc).__name__}: {exc}",
                         param="messages") from None
    if not ids:
        raise BadRequest("messages: the chat template renders to no tokens", param="messages")
    return ids


async def completions(request: Request):
    state = _state(request)
    req = await parse(request, CompletionRequest)
    check_model(state, req.model)
    codec, name = state.codec, state.model_name
    prompts = [encode_prompt(state, p, "prompt") for p in req.prompts()]
    choices = submit_all(state, prompts, req, req.max_tokens, req.logprobs)

    def logprobs(c, ids, first=0):
        if req.logprobs is None:
            return None
        return completion_logprobs(codec, ids, c.logprobs[first:first + len(ids)],
                                   offset=len(codec.decode(c.tokens[:first])) if codec.has_text and first else 0)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(c, text, ids, finish):
        return {"id": rid, "object": "text_completion", "created": created, "model": name,
                "choices": [{"index": c.index, "text": text, "token_ids": ids,
                             "logprobs": logprobs(c, ids, len(c.tokens) - len(ids)) if ids else None,
                             "finish_reason": finish}]}

    if req.stream:
        state.metrics.requests.labels("/v1/completions", "200").inc()
        tail = (lambda: {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": [],
                         "usage": usage(prompts, req.n, choices)}) if req.include_usage else None
        return StreamingResponse(stream(state, choices, chunk, [], tail), media_type="text/event-stream")
    return await finish(state, request, choices, "/v1/completions", lambda: {
        "id": rid, "object": "text_completion", "created": created, "model": name,
        "choices": [{"index": c.index, "text": c.text, "token_ids": c.tokens, "logprobs": logprobs(c, c.tokens),
                     "finish_reason": c.finish_reason} for c in choices],
        "usage": usage(prompts, req.n, choices)})


async def chat(request: Request):
    state = _state(request)
    req = await parse(request, ChatCompletionRequest)
    check_model(state, req.model)
    codec, name = state.codec, state.model_name
    if req.top_logprobs is not None and not req.logprobs:
        raise BadRequest("top_logprobs: needs logprobs: true", param="top_logprobs")
    prompts = [_chat_ids(state, req.messages)]
    given = req.output_limit(default=None)
    limit = state.context_limit

    def max_tokens(prompt_len: int) -> int:  # as vLLM: without max_tokens, the rest of the context
        if given is not None:
            return given
        return max(limit - prompt_len, 1) if limit is not None else DEFAULT_CHAT_MAX_TOKENS

    choices = submit_all(state, prompts, req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)

    def logprobs(c, ids, first=0):
        return chat_logprobs(codec, ids, c.logprobs[first:first + len(ids)]) if req.logprobs else None
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(c, text, ids, finish):
        delta = {"content": text} if text or finish is None else {}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                "choices": [{"index": c.index, "delta": delta, "token_ids": ids,
                             "logprobs": logprobs(c, ids, len(c.tokens) - len(ids)) if ids else None,
                             "finish_reason": finish}]}

    if req.stream:
        state.metrics.requests.labels("/v1/chat/completions", "200").inc()
        first = [{"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                  "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}]} for c in choices]
        tail = (lambda: {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                         "choices": [], "usage": usage(prompts, req.n, choices)}) if req.include_usage else None
        return StreamingResponse(stream(state, choices, chunk, first, tail), media_type="text/event-stream")
    return await finish(state, request, choices, "/v1/chat/completions", lambda: {
        "id": rid, "object": "chat.completion", "created": created, "model": name,
        "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text}, "token_ids": c.tokens,
                     "logprobs": logprobs(c, c.tokens), "finish_reason": c.finish_reason} for c in choices],
        "usage": usage(prompts, req.n, choices)})


# ---------------------------------------------------------------------------------------------- errors


async def _on_validation(request: Request, exc: RequestValidationError):
    err = _validation_error(exc.errors()[0] if exc.errors() else {}, "invalid request")
    _state(request).metrics.requests.labels(request.url.path, "400").inc()
    return _fail(400, str(err), param=err.param)


async def _on_bad_request(request: Request, exc: BadRequest):
    _state(request).metrics.requests.labels(request.url.path, str(exc.status)).inc()
    return _fail(exc.status, str(exc), param=exc.param, type=exc.type, code=exc.code)


async def _on_http_error(request: Request, exc: StarletteHTTPException):
    """Unknown routes (404) and wrong methods (405) in OpenAI's error shape, not FastAPI's {"detail"}."""
    status = exc.status_code
    if status == 404:
        message, code = f"{request.method} {request.url.path}: no such route", "not_found"
    elif status == 405:
        message, code = f"{request.method} is not allowed on {request.url.path}", "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    _state(request).metrics.requests.labels("other", str(status)).inc()
    return _fail(status, message, type="invalid_request_error", code=code, headers=getattr(exc, "headers", None))


class _BearerAuth:
    """ASGI middleware: ``/v1/*`` needs ``Authorization: Bearer <api_key>``, else 401 with an
    OpenAI-style body. Plain ASGI rather than ``@app.middleware("http")``, whose wrapper re-streams
    every response through a task and a memory channel (measurable on each streamed token)."""

    def __init__(self, app, *, api_key: str, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics
        self.expected = f"Bearer {api_key}".encode("latin-1")

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):  # constant time
                self.metrics.requests.labels(scope["path"], "401").inc()
                body = error_body("invalid or missing API key (Authorization: Bearer ...)", type="authentication_error")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine, *, model_name: str | Sequence[str], codec: Codec | None = None, api_key: str | None = None,
               max_waiting: int = 256, max_model_len: int | None = None,
               shutdown_timeout: float = DEFAULT_SHUTDOWN_S) -> FastAPI:
    """The app around ``engine``: an ``Engine`` (run by a thread of this process, which owns it from
    now on) or an ``EngineProcess`` (the engine in a child process; ``fastmamba serve`` does this,
    so that HTTP work never delays a step). The worker starts with the app unless already started.

    model_name     the served name, or several (the ``model`` field must be one of them)
    max_model_len  prompt + max_tokens above it are refused (None: only the K/V limit of a model
                   with attention layers, and ``MAX_TOKENS_CEILING``)
    shutdown_timeout  seconds the admitted requests may run on after SIGTERM (``serve``) or at the
                   app's shutdown; the rest are aborted
    """
    metrics = ServerMetrics()

    def on_step(stats: dict, tokens: int) -> None:
        metrics.generation_tokens.inc(tokens)
        metrics.observe_engine(stats)

    if isinstance(engine, EngineProcess):
        worker = engine
        worker.on_step, worker.max_waiting = on_step, max_waiting
    else:
        worker = EngineThread(engine, max_waiting=max_waiting, on_step=on_step)
    names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
    if not names:
        raise ValueError("create_app: model_name must name at least one model")
    state = ServerState(worker, codec or Codec(None), metrics, names, max_model_len, shutdown_timeout)

    @asynccontextmanager
    async def lifespan(app):
        if not worker.alive():
            worker.start()
        app.state.loop = asyncio.get_running_loop()
        if worker.stats:
            metrics.observe_engine(worker.stats)
        yield
        worker.stop(drain=True, timeout=state.shutdown_timeout)

    app = FastAPI(title="fastmamba", lifespan=lifespan)
    app.state.server = state
    app.state.engine_thread = worker
    app.state.metrics = metrics
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(BadRequest, _on_bad_request)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    if api_key:
        app.add_middleware(_BearerAuth, api_key=api_key, metrics=metrics)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics_page, methods=["GET"])
    app.add_api_route("/version", version, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    return app


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", *,
          sock=None) -> None:
    """Run ``app`` with uvicorn until SIGINT / SIGTERM (on ``sock`` when given: a socket the caller
    bound, so that a taken port is reported before the model loads).

    SIGTERM is a graceful shutdown: the serving loop stops admitting, lets the admitted requests run
    for at most the app's ``shutdown_timeout`` seconds and then aborts the rest (their clients get a
    503), so every handler ends and uvicorn's own graceful wait finishes; the process exits with
    status 0, where uvicorn would otherwise re-raise the signal after shutting down."""
    import signal

    import uvicorn

    state: ServerState = app.state.server

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            loop = getattr(app.state, "loop", None)
            if loop is not None and not loop.is_closed():  # from the signal handler: via the loop, never a lock
                loop.call_soon_threadsafe(state.worker.begin_shutdown, state.shutdown_timeout)
            if sig == signal.SIGTERM and sig in self._captured_signals:
                self._captured_signals.remove(sig)

    # The engine thread and the event loop share the GIL. The engine gives it up at every GPU wait;
    # with CPython's default 5 ms switch interval, a busy loop (many streams) then holds it for up to
    # 5 ms before the engine gets it back, a whole decode step. 0.5 ms keeps the engine's turn short.
    sys.setswitchinterval(GIL_SWITCH_S)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=int(state.shutdown_timeout) + 5)
    server = _Server(config)
    where = f"[{host}]" if ":" in host else host
    logging.getLogger("fastmamba.serve").info(f"fastmamba serve: listening on http://{where}:{port} (SIGTERM drains "
                                              f"for up to {state.shutdown_timeout:g} s)")
    server.run(sockets=None if sock is None else [sock])
