"""The one serving loop that owns the engine, and the server-side handle on it.

``serve_engine`` is the loop: it takes commands, steps the engine and reports what happened. It
runs in a thread of the server (``EngineThread``) or in a process of its own (``EngineProcess``);
only the transport differs:

    commands in    ("add", cid, prompt, params) | ("abort", cid) | ("stop", drain_s)
    reports out    (events, stats, timing) after every step, and after commands that changed the
                   request set; events are (cid, kind, value) with kind "token" (value: (token,
                   logprob, top_logprobs)), "finished" (the finish reason) or "error" (a message)

``cid`` is the server's id of a request. ``("stop", drain_s)`` begins the shutdown: requests not yet
admitted fail at once with ``SHUTDOWN``, the admitted ones (prefilling or decoding) run on for at
most ``drain_s`` seconds, then the rest fail with ``SHUTDOWN`` and the loop returns.

``EngineClient`` is the server's side: ``submit`` (from an event loop) sends "add" and returns a
``RequestHandle`` whose ``events`` queue receives ``(handle, "token", StepOutput)``, then one
``(handle, "finished", reason)`` or ``(handle, "error", message)``; ``abort`` sends "abort";
``dispatch`` hands a report's events to the handlers' event loops (one thread-safe call per loop
per report). An exception inside a step fails the requests of that step with "error"; the loop
keeps serving the others.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterable

from fastmamba.generation.engine import StepOutput
from fastmamba.generation.sampling import SamplingParams

SHUTDOWN = "the server is shutting down"


SPEC_COUNTS = ("drafted", "accepted", "verify_steps", "plain_steps")


def spec_stats(engine, timing: dict | None = None) -> dict | None:
    """A speculative engine's counters (None without speculation): drafted and accepted tokens,
    verify steps (replay + legacy; steps the policy ran plain are apart), ``request_steps``
    (requests decoded by those steps) and the policy's last k. With the serving loop's ``timing``:
    since the loop started (``timing["spec_base"]``: the warm-up's counts are left out) and its
    request steps."""
    if not getattr(engine, "speculate", 0):
        return None
    st = engine.stats
    policy = (st.get("policy") or {}).get("last") or {}
    counts = dict(zip(SPEC_COUNTS, (st["drafts_proposed"], st["drafts_accepted"],
                                    st["steps"]["replay"] + st["steps"]["legacy"], st["steps"]["plain"])))
    base = (timing or {}).get("spec_base") or {}
    return {"max_k": engine.speculate, **{k: v - base.get(k, 0) for k, v in counts.items()},
            "request_steps": (timing or {}).get("spec_request_steps", 0),
            "policy": getattr(engine, "policy", None) is not None, "policy_k": policy.get("k")}


def engine_stats(engine, timing: dict | None = None) -> dict:
    """What the metrics show of an engine: request counts, slots, KV pages, prefill and prefix-cache
    counters, and with speculation ``spec_stats`` (``timing``: the serving loop's, for its request steps)."""
    pages = getattr(engine.cache, "kv_pages_in_use", 0)
    return {"spec": spec_stats(engine, timing), "running": len(engine.running) + len(engine.prefilling),
            "waiting": len(engine.waiting),
            "slots_total": engine.cache.num_slots, "slots_used": engine.cache.num_slots - engine.cache.free_slots,
            "kv_pages": pages() if callable(pages) else pages,
            "prefill_tokens": engine.stats.get("prefill_tokens", 0), "prefix": engine.prefix_stats,
            "graph_captures": engine.graph_captures}


def new_timing() -> dict:
    """Where the loop's time goes while it has work: inside ``engine.step()`` or around it."""
    return {"steps": 0, "step_s": 0.0, "around_s": 0.0, "tokens": 0, "prefill_steps": 0, "prefill_step_s": 0.0,
            "spec_request_steps": 0}


def _commands(poll: Callable[[float], Iterable[tuple]], timeout: float, max_rounds: int = 64) -> Iterable[tuple]:
    """The commands to take before the next step, one at a time: ``poll(timeout)``'s, then, after
    each batch is handled, whatever came meanwhile (``poll(0)``) until none is waiting, for at most
    ``max_rounds`` polls (a steady flood of commands never starves the step). A burst of requests
    that keeps arriving while the first ones are added joins the same step, as in the serving loop
    of 6625510; draining the pipe only once, before adding, left a burst's later requests to the
    next step (issue 49: the load test's TTFT p99 was 3% above 6625510's, engine steps equal)."""
    for _ in range(max_rounds):
        msgs = list(poll(timeout))
        if not msgs:
            return
        yield from msgs
        timeout = 0


def serve_engine(engine, poll: Callable[[float], Iterable[tuple]], report: Callable[[list, dict, dict], None]) -> None:
    """Run ``engine`` until a "stop" command's drain ends.

    poll(timeout)  the commands that came, waiting up to ``timeout`` seconds for the first (0 while
                   the engine has work: never wait then)
    report(events, stats, timing)  after every step and every change of the request set
    """
    by_rid: dict[int, int] = {}  # engine rid -> server cid
    rid_of: dict[int, int] = {}  # server cid -> engine rid
    deadline: float | None = None  # once stopping: when the drain ends
    timing = new_timing()
    spec = spec_stats(engine)  # the counters so far (a warm-up's) are not the server's
    timing["spec_base"] = {k: spec[k] for k in SPEC_COUNTS} if spec else {}
    last_end = None

    def drop(cid: int, events: list, kind: str, value: str) -> None:
        rid = rid_of.pop(cid)
        engine.abort(rid)
        engine.finished.pop(rid, None)
        del by_rid[rid]
        events.append((cid, kind, value))

    while True:
        busy = engine.has_unfinished()
        if not busy:
            last_end = None
        events, changed = [], False
        for msg in _commands(poll, 0 if busy else 0.05):
            changed = True
            if msg[0] == "add":
                _, cid, prompt, params = msg
                if deadline is not None:
                    events.append((cid, "error", SHUTDOWN))
                    continue
                try:  # the server checked the prompt (ids in the vocabulary), its length and the params
                    rid = engine.add_validated_request(prompt, params)
                except (TypeError, ValueError) as exc:  # but never wedge the loop
                    events.append((cid, "error", str(exc)))
                    continue
                by_rid[rid], rid_of[cid] = cid, rid
            elif msg[0] == "abort":
                if msg[1] in rid_of:
                    drop(msg[1], events, "finished", "abort")
            elif msg[0] == "stop" and deadline is None:
                deadline = time.perf_counter() + max(float(msg[1]), 0.0)
        if deadline is not None:
            for r in list(engine.waiting):  # never admitted: they do not start now
                if r.rid in by_rid:
                    drop(by_rid[r.rid], events, "error", SHUTDOWN)
            if not engine.has_unfinished() or time.perf_counter() >= deadline:
                for cid in list(rid_of):
                    drop(cid, events, "error", SHUTDOWN)
                report(events, engine_stats(engine, timing), timing)
                return
        if engine.has_unfinished():
            t0 = time.perf_counter()
            if last_end is not None:
                timing["around_s"] += t0 - last_end
            fed = engine.stats["prefill_tokens"]
            decoding, steps_before = len(engine.running), sum(engine.stats["steps"].values())
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
            now = time.perf_counter()
            timing["steps"] += 1
            timing["step_s"] += now - t0
            if engine.stats["prefill_tokens"] != fed:  # a step that prefilled (and maybe decoded)
                timing["prefill_steps"] += 1
                timing["prefill_step_s"] += now - t0
            timing["tokens"] += len(outputs)
            if sum(engine.stats["steps"].values()) != steps_before:  # a speculative (or plain) step ran
                timing["spec_request_steps"] += decoding
            for out in outputs:
                cid = by_rid.get(out.rid)
                if cid is None:
                    continue
                events.append((cid, "token", (out.token, out.logprob, out.top_logprobs)))
                if out.finished:
                    engine.finished.pop(out.rid, None)
                    del by_rid[out.rid], rid_of[cid]
                    events.append((cid, "finished", out.finish_reason or "done"))
            # a request the engine finished on its own without a step output (a hybrid's KV pool ran out)
            for rid in [r for r in by_rid if r in engine.finished]:
                req = engine.finished.pop(rid)
                cid = by_rid.pop(rid)
                rid_of.pop(cid, None)
                events.append((cid, "error", str(req.error or f"finished: {req.finish_reason}")))
            changed = True
        if changed:
            report(events, engine_stats(engine, timing), timing)
            last_end = time.perf_counter()


class QueueFull(RuntimeError):
    """More requests are waiting than ``max_waiting``, or the server is stopping: 503 with Retry-After."""


@dataclasses.dataclass
class RequestHandle:
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    rid: int | None = None  # the server's id of the request (``cid``)
    done: bool = False
    submitted_at: float = dataclasses.field(default_factory=time.perf_counter)


def _deliver(events: list[tuple[RequestHandle, str, object]]) -> None:
    """Runs on an event loop: put a report's events into their handles' queues."""
    for handle, kind, value in events:
        handle.events.put_nowait((handle, kind, value))


def _deliver_then(events: list, on_step: Callable[[dict, int], None] | None, stats: dict, tokens: int) -> None:
    """Runs on an event loop: a report's events to their queues, then ``on_step`` (the metrics)."""
    _deliver(events)
    if on_step is not None:
        on_step(stats, tokens)


class EngineClient:
    """The server's side of a serving loop; subclasses give the transport (``_send``, start, stop).

    max_waiting  requests accepted but not yet producing tokens before ``submit`` raises QueueFull
    on_step      optional callback(stats, tokens) after each report (the metrics), on the event loop
    Attributes set once the engine is up: ``vocab_size``, ``max_request_tokens`` (the KV limit of
    one request; None: none), ``info`` (what the engine runs: model, dtype, device, slots, pages ...).
    """

    def __init__(self, *, max_waiting: int = 256, on_step: Callable[[dict, int], None] | None = None):
        self.max_waiting, self.on_step = max_waiting, on_step
        self._handles: dict[int, RequestHandle] = {}
        self._started: set[int] = set()  # cids that produced an event
        self._ids = itertools.count()
        self._stopping = False
        self.vocab_size: int | None = None
        self.max_request_tokens: int | None = None
        self.info: dict = {}
        self.stats: dict = {}
        self.timing = new_timing()

    # the transport
    def _send(self, msg: tuple) -> None:
        raise NotImplementedError

    def alive(self) -> bool:
        raise NotImplementedError

    @property
    def in_flight(self) -> int:
        return len(self._handles)

    def submit(self, prompt: list[int], params: SamplingParams, events: asyncio.Queue | None = None) -> RequestHandle:
        """Queue one request (call from the event loop's thread); ``events``: the queue its events go
        to (default: a new one)."""
        if self._stopping or not self.alive():
            raise QueueFull(SHUTDOWN if self._stopping else "the engine is not running")
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
        """Cancel a request: its slot and pages are freed at the loop's next turn. Idempotent."""
        if not handle.done and handle.rid in self._handles:
            try:
                self._send(("abort", handle.rid))
            except (OSError, ValueError):  # the engine process is gone: nothing holds the slot any more
                pass

    def begin_shutdown(self, drain_s: float) -> None:
        """Stop accepting requests; the admitted ones run on for at most ``drain_s`` seconds, the
        rest fail with ``SHUTDOWN``. Returns at once (``stop`` waits)."""
        if self._stopping:
            return
        self._stopping = True
        try:
            self._send(("stop", drain_s))
        except (OSError, ValueError):
            pass

    def dispatch(self, events: list, stats: dict, timing: dict) -> None:
        """One report: its events to their handlers' loops (one call per loop), then the metrics."""
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
            return
        # the metrics after the tokens, on the (first) loop: the caller goes back to its work at once
        for i, (loop, batch) in enumerate(batches.items()):
            try:
                loop.call_soon_threadsafe(_deliver_then, batch, None if i else self.on_step, stats, tokens)
            except RuntimeError:  # that loop is closed: its handlers are gone
                pass

    def fail_all(self, message: str) -> None:
        """The engine is gone: every request in flight gets an "error"."""
        for cid, handle in list(self._handles.items()):
            handle.done = True
            try:
                handle.loop.call_soon_threadsafe(_deliver, [(handle, "error", message)])
            except RuntimeError:
                pass
        self._handles.clear()


def describe_engine(engine) -> dict:
    """What an engine runs, for the server's start-up log and ``/tokenize``'s ``max_model_len``."""
    model = engine.model
    weight = model.lm_head.weight
    cache = engine.cache
    kv = getattr(cache, "kv", None)
    info = {"model": type(model).__name__, "dtype": str(weight.dtype).removeprefix("torch."),
            "device": str(weight.device), "slots": cache.num_slots, "vocab_size": model.cfg.vocab_size,
            "max_request_tokens": engine.max_request_tokens,
            "max_position_embeddings": getattr(model.cfg, "max_position_embeddings", None),
            "kv_pages": None if kv is None else kv.num_pages, "kv_page_size": None if kv is None else kv.page_size,
            "prefill_chunk": engine.prefill_chunk, "prefix_entries": None, "prefix_cache_bytes": None,
            "ssm_dtype": getattr(engine, "ssm_dtype_source", None), "kv_dtype": getattr(engine, "kv_cache_note", None)}
    prefix = engine.prefix
    if prefix is not None:
        kv_bytes = sum(t.numel() * t.element_size() for t in prefix.kv_k + prefix.kv_v)
        info["prefix_entries"] = prefix.max_entries
        info["prefix_cache_bytes"] = prefix.max_entries * prefix.bytes_per_entry + kv_bytes
    return info


def log_lines(info: dict, name: str) -> str:
    """One line for the start-up log from ``describe_engine``'s dict."""
    kv = (f"{info['kv_pages']} K/V pages of {info['kv_page_size']} tokens (at most {info['max_request_tokens']} "
          "tokens per request)" if info.get("kv_pages") else "no K/V pages (no attention layers)")
    prefix = info.get("prefix_cache_bytes")
    prefix = (f"prefix cache {info['prefix_entries']} snapshots in {prefix / 2**30:.3f} GiB" if prefix
              else "prefix cache off")
    chunk = info.get("prefill_chunk")
    dtypes = "".join(f", {what} {info[key]}" for key, what in (("ssm_dtype", "SSM states"), ("kv_dtype", "K/V pages"))
                     if info.get(key))
    return (f"model {name} ({info['model']}), dtype {info['dtype']}, device {info['device']}, {info['slots']} slots, "
            f"{kv}, {prefix}, prefill chunk {chunk or 'off (whole prompts)'}{dtypes}")


class ThreadTransport:
    """Commands for a loop in a thread of this process: a lock-protected list and an event."""

    def __init__(self):
        self._items: list[tuple] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()

    def put(self, msg: tuple) -> None:
        with self._lock:
            self._items.append(msg)
        self._ready.set()

    def poll(self, timeout: float) -> list[tuple]:
        if timeout > 0 and not self._items:
            self._ready.wait(timeout)
        with self._lock:
            items, self._items = self._items, []
            self._ready.clear()
        return items
