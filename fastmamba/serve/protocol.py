"""The OpenAI request schema the server accepts, validated before anything reaches the engine.

Known fields are typed and range-checked (a wrong type or an out-of-range value is a 400 naming
the field); unknown fields are ignored, as OpenAI clients send extras (``user``, ``stream_options``).
Fields the engine cannot honour (``echo``, ``best_of`` > ``n``, ``logit_bias``...) are refused by name
rather than silently dropped.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from fastmamba.generation.sampling import MAX_LOGPROBS

MAX_N = 16  # choices per request


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
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
        return self


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
    content: str


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    def output_limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
