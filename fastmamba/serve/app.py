"""FastAPI routes of the OpenAI-compatible server.

    POST /v1/completions, /v1/chat/completions   (``stream: true``: server-sent events, ``data: [DONE]`` last)
    GET  /v1/models, /health, /metrics

Every request is validated here (``protocol.py``, token ids against the vocabulary, lengths against
``max_model_len``) and refused with an OpenAI-style 400 before it reaches the engine thread. A full
waiting queue answers 503 with ``Retry-After``. A client that disconnects mid-stream has its
requests aborted (their slots freed at the engine thread's next turn).
"""
from __future__ import annotations

import hmac
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import SamplingParams
from fastmamba.serve.engine_process import EngineProcess
from fastmamba.serve.engine_thread import EngineThread, QueueFull, RequestHandle
from fastmamba.serve.metrics import ServerMetrics
from fastmamba.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body
from fastmamba.serve.tokenization import Codec

RETRY_AFTER_S = 1
GIL_SWITCH_S = 0.0005  # see serve()


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, type: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.type = param, status, type


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

    def add(self, out) -> None:
        """Take one ``StepOutput``."""
        self.tokens.append(out.token)
        if out.logprob is not None:
            self.logprobs.append((out.logprob, out.top_logprobs or ()))
        if not self.codec.has_text:
            return
        text = self.codec.decode(self.tokens)
        for s in self.stops:
            at = text.find(s)
            if at >= 0:
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


def create_app(engine: Engine | EngineProcess, *, model_name: str, codec: Codec | None = None,
               api_key: str | None = None, max_waiting: int = 256, max_model_len: int | None = None) -> FastAPI:
    """The app around ``engine``: an ``Engine`` (run by a thread of this process, which owns it from
    now on) or an ``EngineProcess`` (the engine in a child process; ``fastmamba serve`` does this,
    so that HTTP work never delays a step). The worker starts with the app unless already started."""
    codec = codec or Codec(None)
    metrics = ServerMetrics()

    def on_step(stats: dict, tokens: int) -> None:
        metrics.generation_tokens.inc(tokens)
        metrics.observe_engine(stats)

    if isinstance(engine, EngineProcess):
        worker = engine
        worker.on_step, worker.max_waiting = on_step, max_waiting
    else:
        worker = EngineThread(engine, max_waiting=max_waiting, on_step=on_step)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        if not worker.alive():
            worker.start()
        metrics.observe_engine(worker.stats) if worker.stats else None
        yield
        worker.stop(drain=True, timeout=30)

    app = FastAPI(title="fastmamba", lifespan=lifespan)
    app.state.engine_thread = worker
    app.state.metrics = metrics

    def fail(status: int, message: str, *, param=None, type="invalid_request_error", headers=None) -> JSONResponse:
        return JSONResponse(error_body(message, type=type, param=param), status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None
        msg = err.get("msg", "invalid request")
        metrics.requests.labels(request.url.path, "400").inc()
        return fail(400, f"{'.'.join(loc) + ': ' if loc else ''}{msg}", param=param)

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest):
        metrics.requests.labels(request.url.path, str(exc.status)).inc()
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
        return fail(exc.status, str(exc), param=exc.param, type=exc.type, headers=headers)

    if api_key:
        app.add_middleware(_BearerAuth, api_key=api_key, metrics=metrics)

    async def parse(request: Request, schema):
        # parsed and validated in one pass by pydantic's own JSON reader (a 2k-token prompt: 0.2 ms
        # against 0.8 ms through json.loads and then model_validate)
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
            loc = [str(p) for p in err.get("loc", ())]
            raise BadRequest(f"{'.'.join(loc) + ': ' if loc else ''}{err.get('msg', str(exc))}",
                             param=loc[0] if loc else None) from None

    def check_ids(ids: list[int], param: str) -> list[int]:
        vocab = worker.vocab_size
        if ids and 0 <= min(ids) and max(ids) < vocab:  # the common case at C speed
            return ids
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"{param}: token ids {bad[:4]} are outside the vocabulary [0, {vocab})", param=param)
        return ids

    def encode_prompt(p, param: str) -> list[int]:
        if isinstance(p, str):
            if not codec.has_text:
                raise BadRequest(f"{param}: this model has no tokenizer; send token ids", param=param)
            ids = codec.encode(p)
            if not ids:
                raise BadRequest(f"{param}: the text encodes to no tokens", param=param)
            return ids
        return check_ids(p if type(p) is list else list(p), param)  # pydantic's list is ours to keep

    def sampling(req, max_tokens: int, prompt_len: int, i: int, logprobs: int | None) -> SamplingParams:
        if max_model_len is not None and prompt_len + max_tokens > max_model_len:
            raise BadRequest(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceed the model's limit "
                             f"of {max_model_len} tokens", param="max_tokens")
        kv_limit = worker.max_request_tokens  # a model with attention layers: its KV cache per request
        if kv_limit is not None and prompt_len + max_tokens - 1 > kv_limit:
            raise BadRequest(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) need "
                             f"{prompt_len + max_tokens - 1} KV positions; one request of this model holds at most "
                             f"{kv_limit} (its KV cache: the engine's max_seq_len and page pool); shorten the prompt "
                             "or lower max_tokens", param="prompt" if prompt_len > kv_limit else "max_tokens")
        kw = dict(temperature=req.temperature, top_k=max(req.top_k, 0), top_p=req.top_p,
                  seed=None if req.seed is None else req.seed + i, max_new_tokens=max_tokens,
                  stop_token_ids=tuple(check_ids(req.stop_token_ids or [], "stop_token_ids")), logprobs=logprobs)
        if "ignore_eos" in SamplingParams.__dataclass_fields__:
            kw["ignore_eos"] = req.ignore_eos
        return SamplingParams(**kw)

    def submit_all(prompts: list[list[int]], req, max_tokens: int, logprobs: int | None) -> list[_Choice]:
        import asyncio

        stops = list(req.stop or [])
        if stops and not codec.has_text:
            raise BadRequest("stop: stop strings need a tokenizer; use stop_token_ids", param="stop")
        planned = [(ids, sampling(req, max_tokens, len(ids), i, logprobs)) for ids in prompts for i in range(req.n)]
        choices, events = [], asyncio.Queue()  # one queue for all the choices of this request
        try:
            for k, (ids, params) in enumerate(planned):
                choices.append(_Choice(k, worker.submit(ids, params, events), stops, codec))
        except QueueFull as exc:
            for c in choices:
                worker.abort(c.handle)
            raise BadRequest(f"server busy: {exc}; retry later", status=503, type="server_busy") from None
        metrics.prompt_tokens.inc(sum(len(ids) for ids, _ in planned))
        return choices

    def take(choices: list[_Choice], event) -> tuple[_Choice, str]:
        """Apply one event of the request's queue to its choice; returns (choice, "token" |
        "finished"), or raises RuntimeError for an error event."""
        handle, kind, value = event
        choice = next(c for c in choices if c.handle is handle)
        if kind == "token":
            now = time.perf_counter()
            if choice.last_token_at is None:
                metrics.ttft.observe(now - choice.handle.submitted_at)
            else:
                metrics.itl.observe(now - choice.last_token_at)
            choice.last_token_at = now
            if choice.finish_reason is None:  # tokens after a matched stop string are dropped
                choice.add(value)
                if choice.finish_reason is not None:
                    worker.abort(choice.handle)  # a stop string matched: the engine may stop
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

    async def run_to_end(choices: list[_Choice]) -> None:
        events = choices[0].handle.events
        while not all(c.ended for c in choices):
            take(choices, await events.get())

    def usage(prompts: list[list[int]], n: int, choices: list[_Choice]) -> dict:
        p = sum(len(ids) for ids in prompts) * n
        c = sum(len(ch.tokens) for ch in choices)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def stream(choices: list[_Choice], make_chunk, first_chunks: list[dict], tail_chunks) -> AsyncIterator[str]:
        """Server-sent events: one chunk per token (text held back while it may start a stop string),
        a last chunk per choice with its finish reason, then ``data: [DONE]``. The events that are
        ready go out in one write."""
        events = choices[0].handle.events
        try:
            parts = [f"data: {json.dumps(chunk)}\n\n" for chunk in first_chunks]
            while not all(c.ended for c in choices):
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                for event in batch:
                    try:
                        c, kind = take(choices, event)
                    except RuntimeError as exc:
                        parts.append(f"data: {json.dumps(error_body(str(exc), type='server_error'))}\n\n")
                        continue
                    if kind == "token":
                        if len(c.tokens) > c.streamed:  # every kept token (its text may be held back or empty)
                            new_text = c.safe_text()[c.sent:]
                            c.sent += len(new_text)
                            parts.append(f"data: {json.dumps(make_chunk(c, new_text, c.tokens[c.streamed:], None))}\n\n")
                            c.streamed = len(c.tokens)
                    else:
                        rest = c.text[c.sent:]
                        c.sent += len(rest)
                        parts.append(f"data: {json.dumps(make_chunk(c, rest, [], c.finish_reason))}\n\n")
                yield "".join(parts)
                parts = []
            for chunk in tail_chunks():
                parts.append(f"data: {json.dumps(chunk)}\n\n")
            yield "".join(parts) + "data: [DONE]\n\n"
        finally:
            for c in choices:
                worker.abort(c.handle)

    # ------------------------------------------------------------------ routes

    @app.get("/health")
    async def health():
        if not worker.alive():
            return fail(503, "the engine is not running", type="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prom():
        metrics.observe_thread(worker.timing)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "fastmamba"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        prompts = [encode_prompt(p, "prompt") for p in req.prompts()]
        choices = submit_all(prompts, req, req.max_tokens, req.logprobs)

        def logprobs(c, ids, first=0):
            if req.logprobs is None:
                return None
            return completion_logprobs(codec, ids, c.logprobs[first:first + len(ids)],
                                       offset=len(c.codec.decode(c.tokens[:first])) if codec.has_text and first else 0)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        metrics.requests.labels("/v1/completions", "200").inc()

        def chunk(c, text, ids, finish):
            return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": c.index, "text": text, "token_ids": ids,
                                 "logprobs": logprobs(c, ids, len(c.tokens) - len(ids)) if ids else None,
                                 "finish_reason": finish}]}

        if req.stream:
            return StreamingResponse(stream(choices, chunk, [], lambda: []), media_type="text/event-stream")
        try:
            await run_to_end(choices)
        except RuntimeError as exc:
            return fail(500, str(exc), type="server_error")
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": [{"index": c.index, "text": c.text, "token_ids": c.tokens,
                             "logprobs": logprobs(c, c.tokens), "finish_reason": c.finish_reason} for c in choices],
                "usage": usage(prompts, req.n, choices)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await parse(request, ChatCompletionRequest)
        if not codec.has_text or not codec.chat_template:
            raise BadRequest("this model has no chat template (tokenizer_config.json `chat_template`); use "
                             "/v1/completions", param="messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("top_logprobs: needs logprobs: true", param="top_logprobs")
        text = codec.render_chat([m.model_dump() for m in req.messages])
        prompts = [encode_prompt(text, "messages")]
        choices = submit_all(prompts, req, req.output_limit(default=256),
                             (req.top_logprobs or 0) if req.logprobs else None)

        def logprobs(c, ids, first=0):
            return chat_logprobs(codec, ids, c.logprobs[first:first + len(ids)]) if req.logprobs else None
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        metrics.requests.labels("/v1/chat/completions", "200").inc()

        def chunk(c, text, ids, finish):
            delta = {"content": text} if text or finish is None else {}
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [{"index": c.index, "delta": delta, "token_ids": ids,
                                 "logprobs": logprobs(c, ids, len(c.tokens) - len(ids)) if ids else None,
                                 "finish_reason": finish}]}

        if req.stream:
            first = [{"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                      "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}]} for c in choices]
            return StreamingResponse(stream(choices, chunk, first, lambda: []), media_type="text/event-stream")
        try:
            await run_to_end(choices)
        except RuntimeError as exc:
            return fail(500, str(exc), type="server_error")
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                             "token_ids": c.tokens, "logprobs": logprobs(c, c.tokens),
                             "finish_reason": c.finish_reason}
                            for c in choices],
                "usage": usage(prompts, req.n, choices)}

    return app


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run ``app`` with uvicorn until SIGINT / SIGTERM. SIGTERM is a graceful shutdown: in-flight
    requests drain (the lifespan stops the engine thread with ``drain=True``) and the process exits
    with status 0, where uvicorn would otherwise re-raise the signal after shutting down."""
    import signal

    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM and sig in self._captured_signals:
                self._captured_signals.remove(sig)

    # The engine thread and the event loop share the GIL. The engine gives it up at every GPU wait;
    # with CPython's default 5 ms switch interval, a busy loop (many streams) then holds it for up to
    # 5 ms before the engine gets it back, a whole decode step. 0.5 ms keeps the engine's turn short.
    sys.setswitchinterval(GIL_SWITCH_S)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30)
    _Server(config).run()
