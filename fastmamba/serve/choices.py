"""One request's choices, from submission to the answer: ``submit_all`` queues them on the engine,
``take`` applies the engine's events (tokens, stop strings, finish reasons, latency metrics), and the
answer is either server-sent events (``stream``) or one JSON body once all have ended (``finish``).
A client that disconnects has its choices aborted.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response

from fastmamba.serve.protocol import BadRequest, error_body, error_response
from fastmamba.serve.state import ServerState
from fastmamba.serve.tokenization import Codec
from fastmamba.serve.worker import SHUTDOWN, QueueFull, RequestHandle


class ClientGone(Exception):
    """The client of a non-streaming request disconnected before its answer was ready."""


class Choice:
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



def submit_all(state: ServerState, prompts: list[list[int]], req, max_tokens: int | Callable[[int], int],
               logprobs: int | None) -> list[Choice]:
    """Check every choice of the request, then submit them all (or none: 503 when the queue is full)."""
    codec, worker = state.codec, state.worker
    stops = list(req.stop or [])
    if stops and not codec.has_text:
        raise BadRequest("stop: stop strings need a tokenizer; use stop_token_ids", param="stop")
    limit = max_tokens if callable(max_tokens) else lambda n: max_tokens
    planned = [(ids, params) for ids in prompts
               for params in state.sampling_params(req, limit(len(ids)), len(ids), logprobs)]
    choices, events = [], asyncio.Queue()  # one queue for all the choices of this request
    try:
        for k, (ids, params) in enumerate(planned):
            choices.append(Choice(k, worker.submit(ids, params, events), stops, codec))
    except QueueFull as exc:
        for c in choices:
            worker.abort(c.handle)
        raise BadRequest(f"server busy: {exc}; retry later", status=503, type="server_busy") from None
    state.metrics.prompt_tokens.inc(sum(len(ids) for ids, _ in planned))
    return choices


def take(state: ServerState, choices: list[Choice], event) -> tuple[Choice, str]:
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


async def run_to_end(state: ServerState, request: Request, choices: list[Choice]) -> None:
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


def usage(prompts: list[list[int]], n: int, choices: list[Choice]) -> dict:
    p = sum(len(ids) for ids in prompts) * n
    c = sum(len(ch.tokens) for ch in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _sse(chunk: dict) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


async def stream(state: ServerState, choices: list[Choice], make_chunk, first_chunks: list[dict],
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


async def finish(state: ServerState, request: Request, choices: list[Choice], path: str, body: Callable[[], dict]):
    """A non-streaming answer: wait for the choices (aborting them if the client leaves), then ``body()``."""
    try:
        await run_to_end(state, request, choices)
    except ClientGone:
        state.metrics.requests.labels(path, "499").inc()
        return Response(status_code=499)  # nobody reads it
    except RuntimeError as exc:
        if str(exc) == SHUTDOWN:
            return error_response(503, f"{exc}: the request did not finish in time", type="server_shutting_down")
        return error_response(500, str(exc), type="server_error")
    state.metrics.requests.labels(path, "200").inc()
    return body()

