"""The serving loop (``worker.serve_engine``) in a thread of the server process.

Commands go through a lock-protected list (``ThreadTransport``); reports come back as a direct
call of ``EngineClient.dispatch`` on the engine thread, which hands a step's events to each event
loop in one thread-safe call (one wake-up per step, not per token). ``fastmamba serve`` runs the
engine in a process of its own instead (``engine_process.py``), so that HTTP work never shares the
engine's GIL; this form serves an ``Engine`` object built in-process (``create_app(engine)``).
"""
from __future__ import annotations

import threading
from collections.abc import Callable

from fastmamba.generation.engine import Engine
from fastmamba.serve.worker import (SHUTDOWN, EngineClient, QueueFull, RequestHandle, ThreadTransport,  # noqa: F401
                                    _deliver, describe_engine, engine_stats, serve_engine)


class EngineThread(EngineClient):
    """Runs ``serve_engine(engine)`` in a background thread.

    engine       the ``Engine``; nothing else may call it while this thread runs
    max_waiting  requests accepted but not yet running before ``submit`` raises QueueFull
    on_step      optional callback(stats, tokens) after every report (the metrics)
    """

    def __init__(self, engine: Engine, *, max_waiting: int = 256,
                 on_step: Callable[[dict, int], None] | None = None):
        super().__init__(max_waiting=max_waiting, on_step=on_step)
        self.engine = engine
        self.info = describe_engine(engine)
        self.vocab_size = engine.model.cfg.vocab_size
        self.max_request_tokens = engine.max_request_tokens  # the KV limit per request (None: none)
        self.stats = engine_stats(engine)
        self._inbox = ThreadTransport()
        self._thread = threading.Thread(target=self._run, name="fastmamba-engine", daemon=True)

    def _run(self) -> None:
        try:
            serve_engine(self.engine, self._inbox.poll, self.dispatch)
        finally:
            self.fail_all(SHUTDOWN)

    def _send(self, msg: tuple) -> None:
        self._inbox.put(msg)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop: with ``drain`` the admitted requests run on for up to ``timeout`` seconds (None:
        until done), else they are cancelled; waits for the thread."""
        self.begin_shutdown(float("inf") if drain and timeout is None else (timeout or 0.0) if drain else 0.0)
        self._thread.join(None if timeout is None else timeout + 5)
