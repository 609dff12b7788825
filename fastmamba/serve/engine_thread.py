"""The one thread that owns the engine (and so the GPU): requests in through an inbox, tokens out
to each request's asyncio queue.

Handlers call ``submit`` (from the event loop), which enqueues the request and returns a
``RequestHandle`` whose ``events`` queue receives ``(handle, "token", StepOutput)``, then one
``(handle, "finished", reason)`` or ``(handle, "error", message)``; the choices of one HTTP request
may share one queue (``submit(..., events=q)``). A step's events reach each event loop in one
thread-safe call (one wake-up per step, not per token). ``abort`` (a client that went away, a stop
string matched) removes the request at the thread's next turn and frees its slot. Between steps
the thread drains the inbox; with nothing to run it blocks on the inbox. An exception inside a
step fails the requests of that step with "error" and the thread keeps serving the rest.
"""
from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from collections.abc import Callable

from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import SamplingParams


def engine_stats(engine: Engine) -> dict:
    """What the metrics show of an engine: request counts, slots, KV pages, prefill and prefix-cache counters."""
    pages = getattr(engine.cache, "kv_pages_in_use", 0)
    return {"running": len(engine.running), "waiting": len(engine.waiting),
            "slots_total": engine.cache.num_slots, "slots_used": engine.cache.num_slots - engine.cache.free_slots,
            "kv_pages": pages() if callable(pages) else pages,
            "prefill_tokens": engine.stats.get("prefill_tokens", 0), "prefix": engine.prefix_stats,
            "graph_captures": engine.graph_captures}


class QueueFull(RuntimeError):
    """More requests are waiting than ``max_waiting``: the server answers 503 with Retry-After."""


@dataclasses.dataclass
class RequestHandle:
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    rid: int | None = None  # the engine's id, once admitted by the engine thread
    done: bool = False
    submitted_at: float = dataclasses.field(default_factory=time.perf_counter)

    def push(self, kind: str, value: object) -> None:
        """Thread-safe: hand an event to the handler's event loop."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self, kind, value))


def _deliver(events: list[tuple[RequestHandle, str, object]]) -> None:
    """Runs on an event loop: put a step's events into their handles' queues."""
    for handle, kind, value in events:
        handle.events.put_nowait((handle, kind, value))


class EngineThread:
    """Runs ``engine.step()`` in a background thread.

    engine       the ``Engine``; nothing else may call it while this thread runs
    max_waiting  requests accepted but not yet running before ``submit`` raises QueueFull
    on_step      optional callback(stats, tokens) after every step and every change of the request set
                 (``engine_stats``; tokens emitted by the step): the metrics
    """

    def __init__(self, engine: Engine, *, max_waiting: int = 256,
                 on_step: Callable[[dict, int], None] | None = None):
        self.engine = engine
        self.vocab_size = engine.model.cfg.vocab_size
        self.max_request_tokens = engine.max_request_tokens  # the KV limit per request (None: none)
        self.max_waiting = max_waiting
        self.on_step = on_step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[int, RequestHandle] = {}
        self._pending = 0  # submitted, not yet taken by the thread
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._drain = True
        self._thread = threading.Thread(target=self._run, name="fastmamba-engine", daemon=True)
        # where the thread's time goes while it has work: inside engine.step(), or around it (inbox,
        # handing out events, metrics); tokens emitted
        self.timing = {"steps": 0, "step_s": 0.0, "around_s": 0.0, "tokens": 0}

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def stats(self) -> dict:
        return engine_stats(self.engine)

    @property
    def in_flight(self) -> int:
        return len(self._handles) + self._pending

    def submit(self, prompt: list[int], params: SamplingParams, events: asyncio.Queue | None = None) -> RequestHandle:
        """Queue one request (call from the event loop's thread); ``events``: the queue its events go
        to (default: a new one)."""
        if self._stop.is_set():
            raise QueueFull("the server is shutting down")
        with self._lock:
            waiting = self._pending + len(self.engine.waiting)
            if waiting >= self.max_waiting:
                raise QueueFull(f"{waiting} requests are waiting (limit {self.max_waiting})")
            self._pending += 1
        handle = RequestHandle(list(prompt), params, asyncio.get_running_loop(),
                               asyncio.Queue() if events is None else events)
        self._inbox.put(("add", handle))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Cancel a request: its slot is freed at the thread's next turn. Idempotent."""
        if not handle.done:
            self._inbox.put(("abort", handle))

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests; with ``drain`` finish the ones in flight, else cancel them."""
        self._drain = drain
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the thread

    def _take(self, block: bool) -> bool:
        """Apply the inbox's adds and aborts; True if anything came."""
        changed = False
        while True:
            try:
                kind, handle = self._inbox.get(block=block, timeout=0.05 if block else None)
            except queue.Empty:
                return changed
            block, changed = False, True
            if kind == "add":
                with self._lock:
                    self._pending -= 1
                if self._stop.is_set() and not self._drain:
                    handle.done = True
                    handle.push("finished", "abort")
                    continue
                try:
                    handle.rid = self.engine.add_request(handle.prompt, handle.params)
                except (TypeError, ValueError) as exc:  # validated before, but never wedge the thread
                    handle.done = True
                    handle.push("error", str(exc))
                    continue
                self._handles[handle.rid] = handle
            elif kind == "abort" and handle.rid is not None and not handle.done:
                self.engine.abort(handle.rid)
                self.engine.finished.pop(handle.rid, None)
                self._handles.pop(handle.rid, None)
                handle.done = True
                handle.push("finished", "abort")

    def _fail_finished(self, message: str) -> None:
        """After a failed step: the requests the engine finished with an error get ``message``; the
        rest keep going."""
        for rid, handle in list(self._handles.items()):
            req = self.engine.finished.pop(rid, None)
            if req is not None:
                handle.done = True
                self._handles.pop(rid)
                handle.push("error", message)

    def _fail_all(self, message: str) -> None:
        for rid, handle in list(self._handles.items()):
            self.engine.abort(rid)
            self.engine.finished.pop(rid, None)
            handle.done = True
            handle.push("error", message)
        self._handles.clear()

    def _run(self) -> None:
        last_end = None  # when the previous step ended, while the engine stayed busy
        while True:
            busy = self.engine.has_unfinished()
            if not busy:
                last_end = None
            if self._stop.is_set() and (not busy or not self._drain):
                self._take(block=False)
                self._fail_all("the server shut down") if self._handles else None
                return
            if self._take(block=not busy) and self.on_step is not None:
                self.on_step(engine_stats(self.engine), 0)  # gauges see adds and aborts at once
            if not self.engine.has_unfinished():
                continue
            t0 = time.perf_counter()
            if last_end is not None:
                self.timing["around_s"] += t0 - last_end
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving the others
                self._fail_finished(f"engine step failed: {type(exc).__name__}: {exc}")
                continue
            self.timing["steps"] += 1
            self.timing["step_s"] += time.perf_counter() - t0
            self.timing["tokens"] += len(outputs)
            batches: dict[asyncio.AbstractEventLoop, list] = {}
            for out in outputs:
                handle = self._handles.get(out.rid)
                if handle is None:
                    continue
                batch = batches.setdefault(handle.loop, [])
                batch.append((handle, "token", out))
                if out.finished:
                    handle.done = True
                    self._handles.pop(out.rid, None)
                    self.engine.finished.pop(out.rid, None)  # handed out: the engine need not keep it
                    batch.append((handle, "finished", out.finish_reason or "done"))
            for loop, batch in batches.items():
                loop.call_soon_threadsafe(_deliver, batch)
            if self.on_step is not None:
                self.on_step(engine_stats(self.engine), len(outputs))
            last_end = time.perf_counter()
