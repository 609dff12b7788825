"""The engine in a process of its own: the server process keeps HTTP, the child owns the GPU.

The engine thread of ``engine_thread.py`` shares the server's GIL with the event loop, and every
token's HTTP work (events, JSON, socket writes) then lands between the engine's kernel launches:
measured on an H100 (mamba2-2.7b, 64 streams), a step took 25.7 ms in the server against 18.2 ms in
the offline engine, for the same tokens. Here the engine runs in a child process (``spawn``), whose
interpreter is its own, and talks to the server over one ``multiprocessing`` pipe:

    server -> child   ("add", cid, prompt, params) | ("abort", cid) | ("stop", drain)
    child -> server   ("ready", info) once the model is loaded, then after every step (and after
                      commands that change the request set) ("events", [(cid, kind, value)], stats, timing)

with kind "token" (value: (token, logprob, top_logprobs)), "finished" (the finish reason) or
"error" (a message). ``cid`` is the server's id of a request. A thread of the server process
reads the pipe (blocking, without the GIL) and hands each step's events to the handlers' event
loops in one call per loop. ``EngineProcess`` offers what ``EngineThread`` does (start, submit,
abort, stop, alive, stats, timing, vocab_size, max_request_tokens), so the app takes either.
"""
from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import threading
import time
from collections.abc import Callable

from fastmamba.generation.engine import StepOutput
from fastmamba.generation.sampling import SamplingParams
from fastmamba.serve.engine_thread import QueueFull, RequestHandle, _deliver, engine_stats


def _child(factory: Callable, conn) -> None:
    """The child process: build the engine, then serve the pipe until told to stop."""
    try:
        engine = factory()
        # lazy initialisation (op registration, kernel compiles, a long prompt's graphs) now, not
        # inside the first clients' requests; nothing of it is kept or counted
        engine.warm_up()
    except BaseException as exc:  # noqa: BLE001 - tell the server why, then exit
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", {"vocab_size": engine.model.cfg.vocab_size, "max_request_tokens": engine.max_request_tokens}))
    by_rid: dict[int, int] = {}  # engine rid -> server cid
    rid_of: dict[int, int] = {}  # server cid -> engine rid
    stopping, drain = False, True
    timing = {"steps": 0, "step_s": 0.0, "around_s": 0.0, "tokens": 0, "prefill_steps": 0, "prefill_step_s": 0.0}
    last_end = None
    while True:
        busy = engine.has_unfinished()
        if not busy:
            last_end = None
        if stopping and (not busy or not drain):
            for cid in list(rid_of):
                engine.abort(rid_of.pop(cid))
            conn.send(("events", [(cid, "error", "the server shut down") for cid in by_rid.values()],
                       engine_stats(engine), timing))
            conn.send(("bye", None))
            return
        events = []
        changed = False
        while conn.poll(0 if busy else 0.05):
            msg = conn.recv()
            changed = True
            if msg[0] == "add":
                _, cid, prompt, params = msg
                if stopping:
                    events.append((cid, "finished", "abort"))
                    continue
                try:  # the server checked the prompt (ids in the vocabulary) and the params
                    rid = engine.add_validated_request(prompt, params)
                except (TypeError, ValueError) as exc:  # validated by the server before, but never wedge
                    events.append((cid, "error", str(exc)))
                    continue
                by_rid[rid], rid_of[cid] = cid, rid
            elif msg[0] == "abort":
                rid = rid_of.pop(msg[1], None)
                if rid is not None:
                    engine.abort(rid)
                    engine.finished.pop(rid, None)
                    by_rid.pop(rid, None)
                    events.append((msg[1], "finished", "abort"))
            elif msg[0] == "stop":
                stopping, drain = True, msg[1]
            busy = True  # look for more before stepping
        if engine.has_unfinished():
            t0 = time.perf_counter()
            if last_end is not None:
                timing["around_s"] += t0 - last_end
            fed = engine.stats["prefill_tokens"]
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving the others
                message = f"engine step failed: {type(exc).__name__}: {exc}"
                for rid in [r for r in by_rid if r in engine.finished]:
                    engine.finished.pop(rid)
                    cid = by_rid.pop(rid)
                    rid_of.pop(cid, None)
                    events.append((cid, "error", message))
                outputs = []
            timing["steps"] += 1
            timing["step_s"] += time.perf_counter() - t0
            if engine.stats["prefill_tokens"] != fed:  # a step that prefilled (and maybe decoded)
                timing["prefill_steps"] += 1
                timing["prefill_step_s"] += time.perf_counter() - t0
            timing["tokens"] += len(outputs)
            for out in outputs:
                cid = by_rid.get(out.rid)
                if cid is None:
                    continue
                events.append((cid, "token", (out.token, out.logprob, out.top_logprobs)))
                if out.finished:
                    engine.finished.pop(out.rid, None)
                    del by_rid[out.rid], rid_of[cid]
                    events.append((cid, "finished", out.finish_reason or "done"))
            changed = True
        if changed:
            conn.send(("events", events, engine_stats(engine), timing))
            last_end = time.perf_counter()


def _deliver_then(events: list, on_step: Callable[[dict, int], None] | None, stats: dict, tokens: int) -> None:
    """Runs on an event loop: a report's events to their queues, then ``on_step`` (the metrics)."""
    _deliver(events)
    if on_step is not None:
        on_step(stats, tokens)


class EngineProcess:
    """An engine built by ``factory()`` (a picklable callable: it runs in the child) in its own process.

    max_waiting  requests accepted but not yet producing tokens before ``submit`` raises QueueFull
    on_step      optional callback(stats, tokens) in the server process after each of the child's
                 reports (metrics)
    """

    def __init__(self, factory: Callable, *, max_waiting: int = 256,
                 on_step: Callable[[dict, int], None] | None = None, start_timeout: float = 900.0):
        self.factory, self.max_waiting, self.on_step = factory, max_waiting, on_step
        self.start_timeout = start_timeout
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(factory, child_conn), name="fastmamba-engine", daemon=True)
        self._child_conn = child_conn
        self._handles: dict[int, RequestHandle] = {}
        self._started: set[int] = set()  # cids that produced an event
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="fastmamba-engine-pipe", daemon=True)
        self._stopping = False
        self.vocab_size: int | None = None
        self.max_request_tokens: int | None = None  # the engine's KV limit per request (None: none)
        self.stats: dict = {}
        self.timing = {"steps": 0, "step_s": 0.0, "around_s": 0.0, "tokens": 0, "prefill_steps": 0,
                       "prefill_step_s": 0.0}

    def start(self) -> None:
        """Start the child and wait until its engine is built (raises RuntimeError if that fails)."""
        self._proc.start()
        self._child_conn.close()
        if not self._conn.poll(self.start_timeout):
            self._proc.kill()
            raise RuntimeError(f"the engine process did not come up in {self.start_timeout:.0f} s")
        kind, info = self._conn.recv()
        if kind != "ready":
            self._proc.join(5)
            raise RuntimeError(f"the engine process failed to start: {info}")
        self.vocab_size = info["vocab_size"]
        self.max_request_tokens = info.get("max_request_tokens")
        self._reader.start()

    def alive(self) -> bool:
        return self._proc.is_alive() and self._reader.is_alive()

    @property
    def in_flight(self) -> int:
        return len(self._handles)

    def _send(self, msg) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def submit(self, prompt: list[int], params: SamplingParams, events: asyncio.Queue | None = None) -> RequestHandle:
        """Queue one request (call from the event loop's thread)."""
        if self._stopping or not self.alive():
            raise QueueFull("the server is shutting down" if self._stopping else "the engine process is not running")
        waiting = len(self._handles) - len(self._started)
        if waiting >= self.max_waiting:
            raise QueueFull(f"{waiting} requests are waiting (limit {self.max_waiting})")
        handle = RequestHandle(prompt if type(prompt) is list else list(prompt), params, asyncio.get_running_loop(),
                               asyncio.Queue() if events is None else events)
        handle.rid = next(self._ids)
        self._handles[handle.rid] = handle
        self._send(("add", handle.rid, handle.prompt, params))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Cancel a request: its slot is freed at the child's next turn. Idempotent."""
        if not handle.done and handle.rid in self._handles:
            try:
                self._send(("abort", handle.rid))
            except (OSError, ValueError):  # the child is gone: nothing holds the slot any more
                pass

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests; with ``drain`` finish the ones in flight, else cancel them."""
        self._stopping = True
        try:
            self._send(("stop", drain))
        except (OSError, ValueError):
            pass
        self._reader.join(timeout)
        self._proc.join(5 if timeout is None else max(timeout, 5))
        if self._proc.is_alive():
            self._proc.kill()

    def _read(self) -> None:
        """The pipe's reader: each report's events to their handlers' loops, in one call per loop."""
        try:
            while True:
                kind, *rest = self._conn.recv()
                if kind == "bye":
                    return
                events, stats, timing = rest
                self.stats, self.timing = stats, timing
                batches: dict[asyncio.AbstractEventLoop, list] = {}
                for cid, what, value in events:
                    handle = self._handles.get(cid)
                    if handle is None:
                        continue
                    self._started.add(cid)
                    if what == "token":
                        token, logprob, top = value
                        value = StepOutput(cid, token, False, logprob=logprob, top_logprobs=top)
                    else:
                        handle.done = True
                        del self._handles[cid]
                        self._started.discard(cid)
                    batches.setdefault(handle.loop, []).append((handle, what, value))
                tokens = sum(1 for e in events if e[1] == "token")
                if not batches:
                    if self.on_step is not None:
                        self.on_step(stats, tokens)
                    continue
                # the metrics after the tokens, on the (first) loop: this thread goes back to the
                # pipe at once and lets the loop have the GIL for the tokens
                for i, (loop, batch) in enumerate(batches.items()):
                    loop.call_soon_threadsafe(_deliver_then, batch, None if i else self.on_step, stats, tokens)
        except (EOFError, OSError):  # the child died: fail what it held
            pass
        finally:
            for cid, handle in list(self._handles.items()):
                handle.done = True
                handle.loop.call_soon_threadsafe(_deliver, [(handle, "error", "the engine process exited")])
            self._handles.clear()
