"""The server's routes, as named handlers over the app's ``ServerState`` (``create_app`` in app.py
mounts them):

    POST /v1/completions, /v1/chat/completions   (``stream: true``: server-sent events, ``data: [DONE]`` last;
                                                  ``stream_options.include_usage``: a usage chunk before it)
    GET  /v1/models, /health, /metrics, /version
    POST /tokenize, /detokenize                  (vLLM's shapes)

Each handler parses its body against its schema (protocol.py), checks the values against the served
model (``ServerState``'s checks, once) and hands the choices to choices.py, which answers.
"""
from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from fastmamba.serve.choices import chat_logprobs, completion_logprobs, finish, stream, submit_all, usage
from fastmamba.serve.protocol import BadRequest, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, \
    TokenizeRequest, error_response, parse
from fastmamba.serve.state import ServerState

DEFAULT_CHAT_MAX_TOKENS = 256  # chat without max_tokens on a model with no length limit


def server_state(request: Request) -> ServerState:
    return request.app.state.server


async def health(request: Request):
    if not server_state(request).worker.alive():
        return error_response(503, "the engine is not running", type="server_error")
    return {"status": "ok"}


async def metrics_page(request: Request):
    state = server_state(request)
    state.metrics.observe_thread(state.worker.timing)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def version(request: Request):
    from fastmamba import __version__

    return {"version": __version__}


async def models(request: Request):
    state = server_state(request)
    created = int(time.time())
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": "fastmamba", "root": state.model_name,
         "parent": None, "max_model_len": state.context_limit} for name in state.served_names]}


async def tokenize(request: Request):
    """vLLM's ``/tokenize``: {"prompt": text} (``add_special_tokens``, default true) or {"messages":
    [...]} (``add_generation_prompt``, default true) -> {"count", "max_model_len", "tokens", "token_strs"}."""
    state = server_state(request)
    req = await parse(request, TokenizeRequest)
    state.check_model(req.model)
    codec = state.codec
    if not codec.has_text:
        raise BadRequest("this model has no tokenizer (tokenizer.json): nothing to tokenize",
                         param="prompt" if req.prompt is not None else "messages")
    if req.prompt is not None:
        ids = codec.encode_prompt(req.prompt) if req.add_special_tokens \
            else codec.tokenizer.encode(req.prompt, add_special_tokens=False).ids
    else:
        ids = state.chat_ids(req.messages, add_generation_prompt=req.add_generation_prompt)
    strs = [codec.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.context_limit, "tokens": ids, "token_strs": strs}


async def detokenize(request: Request):
    """vLLM's ``/detokenize``: {"tokens": [ids]} -> {"prompt": text}."""
    state = server_state(request)
    req = await parse(request, DetokenizeRequest)
    state.check_model(req.model)
    if not state.codec.has_text:
        raise BadRequest("this model has no tokenizer (tokenizer.json): nothing to detokenize", param="tokens")
    return {"prompt": state.codec.decode(state.check_ids(list(req.tokens), "tokens"))}



async def completions(request: Request):
    state = server_state(request)
    req = await parse(request, CompletionRequest)
    state.check_model(req.model)
    codec, name = state.codec, state.model_name
    prompts = [state.encode_prompt(p, "prompt") for p in req.prompts()]
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
    state = server_state(request)
    req = await parse(request, ChatCompletionRequest)
    state.check_model(req.model)
    codec, name = state.codec, state.model_name
    if req.top_logprobs is not None and not req.logprobs:
        raise BadRequest("top_logprobs: needs logprobs: true", param="top_logprobs")
    prompts = [state.chat_ids(req.messages)]
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
