"""The OpenAI-compatible server's app: ``create_app`` mounts the routes (handlers.py) over one
``ServerState`` (state.py), answers every error in OpenAI's shape, and ``serve`` runs it with uvicorn.

Every request is validated where it enters (the schemas and ``parse`` of protocol.py; then
``ServerState``'s checks: the ``model`` name, token ids against the vocabulary, lengths against
``max_model_len`` and the K/V cache) and refused with an OpenAI-style error before it reaches the
engine. A full waiting queue, or a server that is shutting down, answers 503 with ``Retry-After``.
A client that disconnects (streaming or not) has its requests aborted: their slots and pages are
freed at the serving loop's next turn. Unknown routes and wrong methods get OpenAI-shaped 404 / 405
bodies too.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import sys
from collections.abc import Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastmamba.serve import handlers
from fastmamba.serve.engine_process import EngineProcess
from fastmamba.serve.engine_thread import EngineThread
from fastmamba.serve.metrics import ServerMetrics
from fastmamba.serve.handlers import server_state
from fastmamba.serve.protocol import BadRequest, error_body, error_response, validation_error
from fastmamba.serve.state import DEFAULT_SHUTDOWN_S, ServerState
from fastmamba.serve.tokenization import Codec

GIL_SWITCH_S = 0.0005  # see serve()


async def _on_validation(request: Request, exc: RequestValidationError):
    err = validation_error(exc.errors()[0] if exc.errors() else {}, "invalid request")
    server_state(request).metrics.requests.labels(request.url.path, "400").inc()
    return error_response(400, str(err), param=err.param)


async def _on_bad_request(request: Request, exc: BadRequest):
    server_state(request).metrics.requests.labels(request.url.path, str(exc.status)).inc()
    return error_response(exc.status, str(exc), param=exc.param, type=exc.type, code=exc.code)


async def _on_http_error(request: Request, exc: StarletteHTTPException):
    """Unknown routes (404) and wrong methods (405) in OpenAI's error shape, not FastAPI's {"detail"}."""
    status = exc.status_code
    if status == 404:
        message, code = f"{request.method} {request.url.path}: no such route", "not_found"
    elif status == 405:
        message, code = f"{request.method} is not allowed on {request.url.path}", "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    server_state(request).metrics.requests.labels("other", str(status)).inc()
    return error_response(status, message, type="invalid_request_error", code=code,
                          headers=getattr(exc, "headers", None))


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
    if isinstance(engine, EngineProcess):
        worker = engine
        worker.on_step, worker.max_waiting = metrics.observe_step, max_waiting
    else:
        worker = EngineThread(engine, max_waiting=max_waiting, on_step=metrics.observe_step)
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
    app.add_api_route("/health", handlers.health, methods=["GET"])
    app.add_api_route("/metrics", handlers.metrics_page, methods=["GET"])
    app.add_api_route("/version", handlers.version, methods=["GET"])
    app.add_api_route("/v1/models", handlers.models, methods=["GET"])
    app.add_api_route("/tokenize", handlers.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", handlers.detokenize, methods=["POST"])
    app.add_api_route("/v1/completions", handlers.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", handlers.chat, methods=["POST"])
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
