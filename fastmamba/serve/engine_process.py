"""The serving loop (``worker.serve_engine``) in a process of its own: the server process keeps
HTTP, the child owns the GPU.

An engine thread shares the server's GIL with the event loop, and every token's HTTP work (events,
JSON, socket writes) then lands between the engine's kernel launches: measured on an H100
(mamba2-2.7b, 64 streams), a step took 25.7 ms in the server against 18.2 ms in the offline
engine, for the same tokens. Here the engine runs in a child process (``spawn``), whose
interpreter is its own, and talks to the server over one ``multiprocessing`` pipe: the loop's
commands go down, its reports come up as ("events", events, stats, timing). Before those, while
the engine is built, the child sends ("log", line) progress lines (loading, warming up), then
("ready", info) or ("failed", message); after the loop ends, ("bye", None). A thread of the
server process reads the pipe (blocking, without the GIL) and dispatches each report.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable

from fastmamba.serve.worker import (SHUTDOWN, EngineClient, QueueFull, RequestHandle,  # noqa: F401
                                    describe_engine, serve_engine)

log = logging.getLogger("fastmamba.serve")


def _child(factory: Callable, conn) -> None:
    """The child process: build the engine, warm it up, then run the serving loop on the pipe.

    It ignores SIGINT and SIGTERM: a terminal's Ctrl+C, or a supervisor that signals the whole
    process group, must not kill the engine under the server's drain; the server ends it through
    the pipe (and a server that dies closes the pipe, which ends it too)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        t0 = time.perf_counter()
        conn.send(("log", "building the engine (loading the weights)"))
        engine = factory()
        info = describe_engine(engine)
        conn.send(("log", f"engine built in {time.perf_counter() - t0:.1f} s; warming up (kernel compiles"
                          f"{', CUDA graphs' if engine.decoder is not None else ''})"))
        t1 = time.perf_counter()
        # lazy initialisation (op registration, kernel compiles, a long prompt's graphs) now, not
        # inside the first clients' requests; nothing of it is kept or counted
        engine.warm_up()
        info["warm_up_s"] = time.perf_counter() - t1
    except BaseException as exc:  # noqa: BLE001 - tell the server why, then exit
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return

    def poll(timeout: float) -> list[tuple]:
        msgs = []
        while conn.poll(timeout if not msgs else 0):
            msgs.append(conn.recv())
            timeout = 0
        return msgs

    try:
        conn.send(("ready", info))
        serve_engine(engine, poll, lambda events, stats, timing: conn.send(("events", events, stats, timing)))
        if hasattr(engine, "close"):  # a tensor-parallel engine ends its other ranks (distributed/serve_workers.py)
            engine.close()
        conn.send(("bye", None))
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the server is gone: so is its engine
        pass


class EngineProcess(EngineClient):
    """An engine built by ``factory()`` (a picklable callable: it runs in the child) in its own process.

    max_waiting  requests accepted but not yet producing tokens before ``submit`` raises QueueFull
    on_step      optional callback(stats, tokens) in the server process after each of the child's
                 reports (metrics)
    on_log       callback(line) for the child's start-up progress (default: the "fastmamba.serve" logger)
    """

    def __init__(self, factory: Callable, *, max_waiting: int = 256,
                 on_step: Callable[[dict, int], None] | None = None, start_timeout: float = 900.0,
                 on_log: Callable[[str], None] | None = None):
        super().__init__(max_waiting=max_waiting, on_step=on_step)
        self.factory, self.start_timeout = factory, start_timeout
        self.on_log = on_log or log.info
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(factory, child_conn), name="fastmamba-engine", daemon=True)
        self._child_conn = child_conn
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="fastmamba-engine-pipe", daemon=True)

    def start(self) -> None:
        """Start the child and wait until its engine is built and warm (RuntimeError if that fails)."""
        self._proc.start()
        self._child_conn.close()
        # the child ignores SIGTERM (see _child), so multiprocessing's own exit hook (terminate, then
        # join) would wait for it forever when this process exits without stop(): kill it first
        atexit.register(self._kill_if_alive)
        deadline = time.monotonic() + self.start_timeout
        while True:
            if not self._conn.poll(max(deadline - time.monotonic(), 0)):
                self._proc.kill()
                raise RuntimeError(f"the engine process did not come up in {self.start_timeout:.0f} s")
            try:
                kind, info = self._conn.recv()
            except EOFError:
                self._proc.join(5)
                raise RuntimeError(f"the engine process exited while starting (exit code {self._proc.exitcode})") \
                    from None
            if kind == "log":
                self.on_log(info)
                continue
            if kind != "ready":
                self._proc.join(5)
                raise RuntimeError(f"the engine process failed to start: {info}")
            break
        self.info = info
        self.vocab_size = info["vocab_size"]
        self.max_request_tokens = info.get("max_request_tokens")
        self._reader.start()

    def alive(self) -> bool:
        return self._proc.is_alive() and self._reader.is_alive()

    def _kill_if_alive(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    def _send(self, msg) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop: with ``drain`` the admitted requests run on for up to ``timeout`` seconds (None:
        until done), else they are cancelled; waits for the child to exit."""
        self.begin_shutdown(float("inf") if drain and timeout is None else (timeout or 0.0) if drain else 0.0)
        self._reader.join(None if timeout is None else timeout + 5)
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    def _read(self) -> None:
        """The pipe's reader: each report to ``dispatch``; when the child ends, fail what it held."""
        try:
            while True:
                kind, *rest = self._conn.recv()
                if kind == "bye":
                    return
                if kind == "events":
                    self.dispatch(*rest)
        except (EOFError, OSError):  # the child died
            pass
        finally:
            self.fail_all(SHUTDOWN if self._stopping else "the engine process exited")
