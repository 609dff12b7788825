"""What the server's handlers share (``ServerState``), and the checks of a request's values against it.

A request's values are checked here once, where they enter the server, against what the served
model allows: the ``model`` name, token ids against the vocabulary, prompt + ``max_tokens`` against
``max_model_len`` and one request's K/V. What passes goes to the engine as it is: the serving
loop's ``Engine.add_validated_request`` does not check them again.
"""
from __future__ import annotations

import dataclasses

from fastmamba.generation.sampling import SamplingParams
from fastmamba.serve.metrics import ServerMetrics
from fastmamba.serve.protocol import BadRequest
from fastmamba.serve.tokenization import Codec
from fastmamba.serve.worker import EngineClient

DEFAULT_SHUTDOWN_S = 30.0
MAX_TOKENS_CEILING = 1 << 24  # max_tokens above this is refused even where nothing else limits it


@dataclasses.dataclass
class ServerState:
    """What the handlers share: the engine's client, the tokenizer, the metrics and the limits.

    served_names   the names the ``model`` field may take (the first, ``model_name``, is reported
                   in responses)
    max_model_len  prompt + max_tokens must not exceed it (None: no such limit; a model with
                   attention layers still has its K/V limit, ``worker.max_request_tokens``)
    """

    worker: EngineClient
    codec: Codec
    metrics: ServerMetrics
    served_names: tuple[str, ...]
    max_model_len: int | None
    shutdown_timeout: float = DEFAULT_SHUTDOWN_S
    model_name: str = dataclasses.field(init=False)

    def __post_init__(self):
        self.model_name = self.served_names[0]

    @property
    def context_limit(self) -> int | None:
        """The most prompt + max_tokens one request may have: ``max_model_len`` and the K/V limit
        (a request holds prompt + max_tokens - 1 K/V positions)."""
        kv = self.worker.max_request_tokens
        limits = [v for v in (self.max_model_len, None if kv is None else kv + 1) if v is not None]
        return min(limits) if limits else None

    # ------------------------------------------------------------------------------------------ checks

    def check_model(self, name: str | None) -> None:
        """404 ``model_not_found`` unless ``name`` is one of the served names (or absent)."""
        if name is not None and name not in self.served_names:
            raise BadRequest(f"The model `{name}` does not exist; this server serves {', '.join(self.served_names)}",
                             param="model", status=404, code="model_not_found")

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        """``ids`` (a list of ints, as the schema parsed them) if each lies in the vocabulary, else 400."""
        vocab = self.worker.vocab_size
        if ids and 0 <= min(ids) and max(ids) < vocab:  # the common case at C speed
            return ids
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"{param}: token ids {bad[:4]} are outside the vocabulary [0, {vocab})", param=param)
        return ids

    def encode_prompt(self, p, param: str) -> list[int]:
        """A completion prompt (a text, or token ids) as checked token ids."""
        if isinstance(p, str):
            if not self.codec.has_text:
                raise BadRequest(f"{param}: this model has no tokenizer; send token ids", param=param)
            ids = self.codec.encode_prompt(p)
            if not ids:
                raise BadRequest(f"{param}: the text encodes to no tokens", param=param)
            return ids  # the tokenizer's own ids: in its vocabulary
        return self.check_ids(p if type(p) is list else list(p), param)  # pydantic's list is ours to keep

    def chat_ids(self, messages, *, add_generation_prompt: bool = True) -> list[int]:
        """Chat messages rendered by the chat template and encoded."""
        codec = self.codec
        if not codec.has_text or not codec.chat_template:
            raise BadRequest("this model has no chat template (chat_template.jinja, chat_template.json or "
                             "tokenizer_config.json `chat_template`; or serve --chat-template FILE); use "
                             "/v1/completions", param="messages")
        try:
            ids = codec.encode_chat([m.model_dump(exclude_none=True) for m in messages],
                                    add_generation_prompt=add_generation_prompt)
        except ImportError as exc:
            raise BadRequest(str(exc), status=500, type="server_error") from None
        except Exception as exc:  # noqa: BLE001 - a template error (jinja2's TemplateError, raise_exception ...)
            raise BadRequest(f"messages: the chat template failed on these messages: {type(exc).__name__}: {exc}",
                             param="messages") from None
        if not ids:
            raise BadRequest("messages: the chat template renders to no tokens", param="messages")
        return ids

    def check_max_tokens(self, prompt_len: int, max_tokens: int, min_tokens: int) -> None:
        """400 when prompt + max_tokens exceed ``max_model_len`` or one request's K/V, max_tokens is
        absurd, or min_tokens exceeds it: the request's one check of its length (the engine trusts it)."""
        limit = self.max_model_len
        if limit is not None and prompt_len + max_tokens > limit:
            raise BadRequest(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceed the model's limit "
                             f"of {limit} tokens (max_model_len)",
                             param="prompt" if prompt_len >= limit else "max_tokens")
        kv_limit = self.worker.max_request_tokens  # a model with attention layers: its K/V cache per request
        if kv_limit is not None and prompt_len + max_tokens - 1 > kv_limit:
            raise BadRequest(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) need "
                             f"{prompt_len + max_tokens - 1} KV positions; one request of this model holds at most "
                             f"{kv_limit} (its KV cache: --max-model-len and the page pool); shorten the prompt "
                             "or lower max_tokens", param="prompt" if prompt_len > kv_limit else "max_tokens")
        if max_tokens > MAX_TOKENS_CEILING:
            raise BadRequest(f"max_tokens: {max_tokens} is more than fastmamba generates for one request "
                             f"({MAX_TOKENS_CEILING}); set --max-model-len to bound requests", param="max_tokens")
        if min_tokens > max_tokens:
            raise BadRequest(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})",
                             param="min_tokens")

    def sampling_params(self, req, max_tokens: int, prompt_len: int, logprobs: int | None) -> list[SamplingParams]:
        """The ``SamplingParams`` of the request's ``req.n`` choices of one prompt (choice i's seed:
        ``seed + i``), its length and stop token ids checked once for them all."""
        self.check_max_tokens(prompt_len, max_tokens, req.min_tokens)
        stop_ids = tuple(self.check_ids(req.stop_token_ids, "stop_token_ids")) if req.stop_token_ids else ()
        return [SamplingParams(temperature=req.temperature, top_k=max(req.top_k, 0), top_p=req.top_p,
                               seed=None if req.seed is None else req.seed + i, max_new_tokens=max_tokens,
                               stop_token_ids=stop_ids, logprobs=logprobs, ignore_eos=req.ignore_eos,
                               min_tokens=req.min_tokens, repetition_penalty=req.repetition_penalty)
                for i in range(req.n)]
