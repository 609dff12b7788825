"""One-call offline generation: ``LLM(model).generate(prompts, SamplingParams(...))``.

    from fastmamba import LLM
    from fastmamba.generation.sampling import SamplingParams

    llm = LLM("path/to/checkpoint")                 # or a preset, or a loaded Mamba2LM
    outs = llm.generate(["Hello", "The capital of"], SamplingParams(max_new_tokens=32))
    print(outs[0].text, outs[0].token_ids)

Prompts are texts (with a tokenizer: the checkpoint's tokenizer.json, or ``tokenizer=DIR``) or
lists of token ids. Every prompt becomes one request of one ``Engine`` (continuous batching, CUDA
graphs on a GPU); the results come back in prompt order.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import torch

from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import SamplingParams
from fastmamba.serve.tokenization import Codec


@dataclasses.dataclass(frozen=True)
class Completion:
    """One prompt's result: the generated ids, their text ("" without a tokenizer) and why it ended
    ("length": max_new_tokens reached; "stop": a stop condition)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str


class LLM:
    """A model, its tokenizer and an engine, ready to generate.

    model      checkpoint directory, preset name, or a loaded ``Mamba2LM``
    tokenizer  directory with tokenizer.json (default: the model's directory, when it is one)
    max_batch  requests decoded together; further ``Engine`` options pass through ``engine_kwargs``
    """

    def __init__(self, model, *, tokenizer: str | os.PathLike | None = None, max_batch: int = 64,
                 dtype: torch.dtype | None = None, device=None, **engine_kwargs):
        import fastmamba

        if isinstance(model, (str, os.PathLike)):
            tokenizer = tokenizer or (model if os.path.isdir(model) else None)
            model = fastmamba.load_model(model, dtype=dtype, device=device)
        self.model = model
        self.codec = Codec(tokenizer)
        self.engine = Engine(model, max_batch=max_batch, **engine_kwargs)

    def _ids(self, prompt, i: int) -> list[int]:
        if isinstance(prompt, str):
            if not self.codec.has_text:
                raise ValueError(f"LLM.generate: prompt {i} is text but the model has no tokenizer; pass token ids "
                                 "or tokenizer=DIR")
            return self.codec.encode(prompt)
        if isinstance(prompt, torch.Tensor):
            return prompt.tolist()
        return list(prompt)

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Generate for every prompt (one prompt or a list); returns one ``Completion`` per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [self._ids(p, i) for i, p in enumerate(prompts)]
        params = params if params is not None else SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(ids)
        if len(plist) != len(ids):
            raise ValueError(f"LLM.generate: {len(ids)} prompts but {len(plist)} SamplingParams")
        outs = self.engine.generate(ids, plist)
        return [Completion(p, o, self.codec.decode(o), "length" if len(o) >= sp.max_new_tokens else "stop")
                for p, o, sp in zip(ids, outs, plist)]
