"""The server's wire format: the OpenAI request schemas it accepts, how a body is parsed against
them (``parse``), and its errors (``BadRequest``, OpenAI's error body).

Known fields are typed and range-checked (a wrong type or an out-of-range value is a 400 naming
the field); other fields are let through (OpenAI clients send extras such as ``user``), except the
OpenAI and vLLM fields that fastmamba does not implement (``UNSUPPORTED``: tools, structured output,
beam search ...), and ``echo``, ``best_of`` > ``n``, ``logit_bias``, non-zero presence / frequency
penalties: those are refused by name rather than silently dropped.
"""
from __future__ import annotations

import re
from typing import Annotated, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from fastmamba.generation.sampling import MAX_LOGPROBS

MAX_N = 16  # choices per request
RETRY_AFTER_S = 1  # a 503's Retry-After


# Fields of OpenAI's or vLLM's requests that fastmamba does not implement: a request that sets one to
# anything but its value here (the "off" value; absent or null always passes) is refused with a 400
# naming it, rather than served as if it were not there.
UNSUPPORTED: dict[str, tuple] = {
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "parallel_tool_calls": (True, False), "audio": (), "prediction": (), "reasoning_effort": (),
    "web_search_options": (), "modalities": (["text"],), "suffix": ("",),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (), "structured_outputs": (),
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "min_p": (0, 0.0), "prompt_logprobs": (),
    "allowed_token_ids": (), "bad_words": ([],), "truncate_prompt_tokens": (), "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,), "add_special_tokens": (),
    "continue_final_message": (False,), "chat_template": (), "chat_template_kwargs": ({},), "documents": (),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False
    continuous_usage_stats: Literal[False] = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # extras pass, then ``_unsupported`` refuses the ones we lack

    model: str | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1.0
    stream_options: StreamOptions | None = None
    response_format: dict | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1)] = -1  # -1 or 0: off (vLLM's convention)
    seed: StrictInt | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return []
        v = [v] if isinstance(v, str) else v
        if any(not s for s in v) or len(v) > 8:
            raise ValueError("stop: at most 8 non-empty strings")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0, 0.0):
                raise ValueError(f"{name}: not supported by fastmamba (only 0)")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported by fastmamba")
        if self.response_format is not None and self.response_format != {"type": "text"}:
            kind = self.response_format.get("type")
            raise ValueError(f"response_format: only {{\"type\": \"text\"}} is supported by fastmamba, got type "
                             f"{kind!r} (no structured output yet)")
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value is not None and value not in UNSUPPORTED[name]:
                raise ValueError(f"{name}: not supported by fastmamba")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    """``POST /v1/completions``: ``prompt`` is text, a list of texts, token ids or lists of token ids."""

    # left to right, token ids first: pydantic's default "smart" union validates a 2k-token prompt
    # against every member (~0.4 ms); tried in order it is one pass (~0.06 ms)
    prompt: Annotated[list[StrictInt] | str | list[str] | list[list[StrictInt]], Field(union_mode="left_to_right")]
    max_tokens: Annotated[StrictInt, Field(ge=1)] = 16
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v):
        if isinstance(v, str) or (v and isinstance(v[0], int)):
            items = [v]
        else:
            items = v
        if not items or any(len(p) == 0 for p in items):
            raise ValueError("prompt: must not be empty")
        return v

    @model_validator(mode="after")
    def _completion_unsupported(self):
        if self.echo:
            raise ValueError("echo: not supported by fastmamba")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict]

    def text(self) -> str:
        """The content as one string: text parts joined by newlines (as vLLM renders them)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p["text"] for p in self.content)


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _text_parts_only(self):
        for i, m in enumerate(self.messages):
            for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(f"messages[{i}].content[{j}]: content parts of type {kind!r} are not supported "
                                     "by fastmamba (only 'text')")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content[{j}]: a 'text' part needs a 'text' string")
        return self

    def output_limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a completion ``prompt`` or chat ``messages``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give either `prompt` (a text) or `messages` (a chat)")
        if self.messages is not None:
            ChatCompletionRequest._text_parts_only(self)
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids to text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt]


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, *, param=None, type="invalid_request_error", code=None,
                   headers=None) -> JSONResponse:
    """``error_body`` as a response; a 503 says when to retry (``Retry-After``)."""
    if status == 503 and headers is None:
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    return JSONResponse(error_body(message, type=type, param=param, code=code), status_code=status, headers=headers)


class BadRequest(Exception):
    """A request refused before it reaches the engine: answered as ``error_response(status, ...)``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.type, self.code = param, status, type, code


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
        raise validation_error(err, str(exc)) from None


def validation_error(err: dict, fallback: str) -> BadRequest:
    """A pydantic error (one entry of ``errors()``) as a 400 naming its field."""
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    msg = str(err.get("msg", fallback)).removeprefix("Value error, ")
    if loc:
        return BadRequest(f"{'.'.join(loc)}: {msg}", param=loc[0])
    # a whole-request check names its field first ("tools: not supported ..."): that is the param
    named = re.match(r"([A-Za-z_]+)[\[:.]", msg)
    return BadRequest(msg, param=named.group(1) if named else None)
