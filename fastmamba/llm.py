"""One-call offline generation: ``LLM(model).generate(prompts, SamplingParams(...))`` and ``LLM.chat``.

    from fastmamba import LLM, SamplingParams

    llm = LLM("path/to/checkpoint")                 # or a preset, or a loaded Mamba2LM / NemotronHLM
    outs = llm.generate(["Hello", "The capital of"], SamplingParams(max_new_tokens=32))
    print(outs[0].text, outs[0].token_ids, outs[0].finish_reason)
    outs = llm.chat([{"role": "user", "content": "Hi"}])   # the checkpoint's chat template

Prompts are texts (with a tokenizer: the checkpoint's tokenizer.json, or ``tokenizer=DIR``) or
token ids (a list or tuple of ints, numpy integers, a 1-D integer numpy array or tensor). Texts
are encoded as the CLI and the server encode them (``Codec.encode_prompt``: the tokenizer's own
special tokens, e.g. its BOS); chats render the template and encode it without adding them again
(``Codec.encode_chat``). Every prompt becomes one request of one ``Engine`` (continuous batching,
CUDA graphs on a GPU); the results come back in prompt order.
"""
from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Mapping, Sequence

from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import SamplingParams
from fastmamba.generation.tokenizer import Codec
from fastmamba.presets import hub_id_hint

# the engine's finish reasons as the OpenAI / vLLM vocabulary says them: end of sequence is a stop
_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort", "error": "error"}


@dataclasses.dataclass(frozen=True)
class Completion:
    """One prompt's result: the prompt's ids, the generated ids, their text ("" without a
    tokenizer), why it ended (``finish_reason``: "stop" at the model's end-of-sequence token, a stop
    token or a stop string; "length" at max_new_tokens) and what stopped it (``stop_reason``: the
    token id or stop string, None for "length")."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: int | str | None = None


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)  # numpy integers register as Integral


def _is_array(v: object) -> bool:
    """A numpy array or a torch tensor (told apart without importing numpy)."""
    return hasattr(v, "ndim") and hasattr(v, "dtype") and callable(getattr(v, "tolist", None))


def _array_ids(a, where: str) -> list[int]:
    kind = getattr(a.dtype, "kind", None)  # numpy: "i" / "u" for integers
    if kind is None:  # a torch tensor
        integral = not (a.is_floating_point() or a.is_complex() or str(a.dtype) == "torch.bool")
    else:
        integral = kind in "iu"
    if not integral:
        raise TypeError(f"{where}: token ids must be integers, got an array of {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{where}: a prompt of token ids must be 1-D, got shape {tuple(a.shape)}")
    return [int(t) for t in a.tolist()]


def _is_id_sequence(p: object) -> bool:
    """One prompt of token ids (not a list of prompts)."""
    if _is_array(p):
        return p.ndim == 1
    return isinstance(p, Sequence) and not isinstance(p, (str, bytes)) and len(p) > 0 and _is_int(p[0])


def _is_conversation(c: object) -> bool:
    return isinstance(c, Sequence) and not isinstance(c, (str, bytes)) and len(c) > 0 \
        and (isinstance(c[0], Mapping) or hasattr(c[0], "model_dump"))


class LLM:
    """A model, its tokenizer and an engine, ready to generate.

    model          checkpoint directory, preset name, or a loaded ``Mamba2LM`` / ``NemotronHLM``
    tokenizer      directory with tokenizer.json (default: the model's directory, when it is one and
                   has one); an explicit one must exist and hold tokenizer.json
    chat_template  a template file or text for ``chat`` (default: the tokenizer directory's
                   chat_template.jinja / chat_template.json / tokenizer_config.json)
    dtype, device  how to load ``model`` (see ``fastmamba.load_model``); with a loaded model they
                   must match it (a mismatch is a ValueError: move the model first)
    max_batch      requests decoded together; further ``Engine`` options pass through ``engine_kwargs``

    Raises TypeError for a ``model`` or ``tokenizer`` of the wrong type, FileNotFoundError for a path
    that does not exist (a Hub id is answered with how to download it), ValueError for the rest, all
    before the model is loaded where the arguments alone decide.
    """

    def __init__(self, model, *, tokenizer: str | os.PathLike | None = None,
                 chat_template: str | os.PathLike | None = None, max_batch: int = 64, dtype=None, device=None,
                 **engine_kwargs):
        import fastmamba

        if isinstance(model, (str, os.PathLike)):
            source = os.fspath(model)
            hint = hub_id_hint(source, then="LLM('DIR')") if not os.path.exists(source) else None
            if hint:
                raise FileNotFoundError(f"LLM: {hint}")
            if tokenizer is None and os.path.isdir(source):
                codec = Codec(source, chat_template=chat_template) if chat_template is None \
                    else Codec(source, chat_template=chat_template, required=True)
            else:
                codec = self._explicit_codec(tokenizer, chat_template)
            model = fastmamba.load_model(source, dtype=dtype, device=device)
        elif hasattr(model, "cfg") and callable(getattr(model, "new_cache", None)):
            self._check_loaded(model, dtype, device)
            codec = self._explicit_codec(tokenizer, chat_template)
        else:
            raise TypeError(f"LLM: model expected a checkpoint directory, a preset name or a loaded model "
                            f"(Mamba2LM / NemotronHLM), got {type(model).__name__}")
        self.model = model
        self.codec = codec
        self.engine = Engine(model, max_batch=max_batch, tokenizer=codec if codec.has_text else None, **engine_kwargs)

    @staticmethod
    def _explicit_codec(tokenizer, chat_template) -> Codec:
        if tokenizer is None:
            if chat_template is not None:
                raise ValueError("LLM: chat_template needs a tokenizer (tokenizer=DIR)")
            return Codec(None)
        return Codec(tokenizer, chat_template=chat_template, required=True)

    @staticmethod
    def _check_loaded(model, dtype, device) -> None:
        """dtype / device with a loaded model: accepted only when the model already has them."""
        import torch

        from fastmamba.models.loader import parse_dtype

        weight = model.lm_head.weight
        want = parse_dtype(dtype, where="LLM")
        if want is not None and want != weight.dtype:
            raise ValueError(f"LLM: dtype={dtype!r} but the loaded model is {weight.dtype}; LLM does not convert a "
                             "loaded model: pass a checkpoint path with dtype=, or convert it first (model.to(dtype))")
        if device is not None:
            try:
                dev = torch.device(device)
            except (RuntimeError, TypeError) as exc:
                raise ValueError(f"LLM: device {device!r} is not a device ({exc})") from None
            if dev.type != weight.device.type or (dev.index is not None and dev.index != weight.device.index):
                raise ValueError(f"LLM: device={device!r} but the loaded model is on {weight.device}; LLM does not "
                                 "move a loaded model: pass a checkpoint path with device=, or move it first "
                                 "(model.to(device))")

    # ------------------------------------------------------------------ prompts

    def _ids(self, prompt, where: str) -> list[int]:
        if isinstance(prompt, str):
            if not self.codec.has_text:
                raise ValueError(f"{where} is text but the model has no tokenizer; pass token ids or tokenizer=DIR")
            return self.codec.encode_prompt(prompt)
        if _is_array(prompt):
            return _array_ids(prompt, where)
        if isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
            ids = []
            for j, t in enumerate(prompt):
                if not _is_int(t):
                    raise TypeError(f"{where}[{j}]: token ids must be ints, got {type(t).__name__} {t!r}")
                ids.append(int(t))
            return ids
        raise TypeError(f"{where}: expected a string or a sequence of int token ids, got {type(prompt).__name__}")

    @staticmethod
    def _params(params, n: int, who: str) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if isinstance(params, (list, tuple)):
            for i, sp in enumerate(params):
                if not isinstance(sp, SamplingParams):
                    raise TypeError(f"{who}: params[{i}] must be a SamplingParams, got {type(sp).__name__}")
            if len(params) != n:
                raise ValueError(f"{who}: {n} prompts but {len(params)} SamplingParams")
            return list(params)
        raise TypeError(f"{who}: params must be a SamplingParams or a list of them, got {type(params).__name__}")

    # ------------------------------------------------------------------ generation

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Generate for every prompt; returns one ``Completion`` per prompt, in order.

        prompts  one prompt or a list of them; a prompt is a string (needs the tokenizer) or token
                 ids (list / tuple of ints or numpy integers, a 1-D integer numpy array or tensor; a
                 2-D one is a batch of prompts)
        params   one ``SamplingParams`` for all (default ``SamplingParams()``) or one per prompt
        """
        if isinstance(prompts, str) or _is_id_sequence(prompts):
            prompts = [prompts]
        elif _is_array(prompts) and prompts.ndim == 2:
            prompts = list(prompts)
        elif _is_array(prompts) or not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
            raise TypeError(f"LLM.generate: prompts expected a string, token ids, or a list of those, got "
                            f"{type(prompts).__name__}")
        if len(prompts) == 0:
            raise ValueError("LLM.generate: no prompts (an empty list)")
        ids = [self._ids(p, f"LLM.generate: prompts[{i}]") for i, p in enumerate(prompts)]
        return self._run(ids, self._params(params, len(ids), "LLM.generate"))

    def chat(self, messages, params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Reply to one conversation (a list of ``{"role", "content"}`` messages) or to each of a list
        of conversations; returns one ``Completion`` per conversation.

        ``content`` is a string or a list of text parts (``{"type": "text", "text": ...}``). The
        conversation is rendered with the chat template (the assistant's turn opened) and encoded
        without adding special tokens again (``Codec.encode_chat``).
        """
        if _is_conversation(messages):
            conversations = [messages]
        elif isinstance(messages, Sequence) and not isinstance(messages, (str, bytes)) and messages \
                and all(_is_conversation(c) for c in messages):
            conversations = list(messages)
        else:
            raise TypeError("LLM.chat: messages expected a conversation (a non-empty list of {'role', 'content'} "
                            "messages) or a list of conversations, got "
                            f"{type(messages).__name__}{' (empty)' if isinstance(messages, Sequence) else ''}")
        ids = [self.codec.encode_chat(c) for c in conversations]
        return self._run(ids, self._params(params, len(ids), "LLM.chat"))

    def _run(self, ids: list[list[int]], plist: list[SamplingParams]) -> list[Completion]:
        engine = self.engine
        rids: list[int] = []
        try:
            for p, sp in zip(ids, plist):  # each is checked before it is queued
                rids.append(engine.add_request(p, sp))
            done = {}
            mine = set(rids)
            while len(done) < len(rids) and engine.has_unfinished():
                for out in engine.step():
                    if out.finished and out.rid in mine:
                        done[out.rid] = out.request
        except BaseException:
            for rid in rids:
                engine.abort(rid)
                engine.finished.pop(rid, None)
            raise
        for rid in rids:
            done.setdefault(rid, engine.finished.get(rid))
            engine.finished.pop(rid, None)
        failed = [done[rid] for rid in rids if done[rid].finish_reason == "error"]
        if failed:
            raise failed[0].error
        return [Completion(list(p), list(req.output), self.codec.decode(req.output),
                           _FINISH.get(req.finish_reason, req.finish_reason), req.stop_reason)
                for p, req in ((p, done[rid]) for p, rid in zip(ids, rids))]
