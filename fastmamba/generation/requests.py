"""What goes into the engine and what comes out: ``Request``, ``StepOutput``, and the checks on each.

A request's life in the engine:
  * ``Engine.add_request`` checks the prompt (``prompt_ids``: Python ints or an integer tensor, ids
    in [0, V)) and the ``SamplingParams`` before anything is queued; a refused request leaves no trace.
  * A request stops after the token that meets its first stop condition (``stop_reason``, giving
    ``Request.finish_reason``): "eos" (one of the model's end-of-sequence ids,
    ``model.cfg.eos_token_ids``, unless ``params.ignore_eos``), "stop" (one of
    ``params.stop_token_ids``, or the decoded output now contains one of ``params.stop`` strings:
    needs the engine's ``tokenizer``), "length" (``max_new_tokens``). The token that stopped it is
    kept in the output. Its slot is freed at once.
  * Each finished request is handed out once: the ``StepOutput`` that carries its last token has
    ``finished=True``, its ``finish_reason`` and the ``Request`` itself. The engine also keeps it in
    ``finished`` (by id) until collected (``pop_finished``, or ``finished.pop(rid)``), but only the
    newest ``max_finished`` uncollected ones: a caller that reads the step outputs and never
    collects does not make the engine grow.
  * An exception inside a step (the model, the sampler, the drafter) fails the requests of that
    step: each is finished with finish_reason "error" (``Request.error`` holds the exception; it
    is kept in ``finished`` like any finished request) and its slot freed; then the exception
    propagates unchanged (on Python >= 3.11 with a note naming the failed requests). Other
    requests stay queued and later steps run as usual. "abort": ``Engine.abort``.
  * With ``SamplingParams.logprobs``, each emitted token's log-probability and the top ones
    (``run_logprobs``) ride on its ``StepOutput``.

No queue, slot or device state lives here (``scheduler`` queues requests, ``engine`` runs them).
"""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Mapping, Set
from typing import Protocol

import torch

from fastmamba.generation.sampling import SamplingParams, finish_reason

FINISH_REASONS = ("eos", "stop", "length", "error", "abort")


class Detokenizer(Protocol):
    """What the engine needs of a tokenizer (stop strings): ``tokenizers.Tokenizer`` and
    Hugging Face tokenizers have it."""

    def decode(self, ids: list[int]) -> str: ...


@dataclasses.dataclass
class Request:
    """One generation request. ``output`` grows by the tokens emitted; once ``finished``,
    ``finish_reason`` is one of FINISH_REASONS and ``stop_reason`` the stop token id or stop
    string that matched (None for "length", "error", "abort"); ``error`` the exception of a failed step."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    slot: int = -1  # -1 while waiting and once finished (the slot is freed)
    output: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: BaseException | None = None
    prefilled: int = 0  # prompt tokens fed so far (chunked prefill: a prompt may take several steps)
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache instead of prefilled
    # speculation: drafts accepted per verify step (as verified; a stop condition may cut the run after)
    accepted: list[int] = dataclasses.field(default_factory=list)

    @property
    def accepted_drafts(self) -> int:
        """Draft tokens accepted over the request's verify steps (each step also emits one bonus token)."""
        return sum(self.accepted)


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """One emitted token. On a request's last token ``finished`` is True, ``finish_reason`` says why
    and ``request`` is the finished ``Request`` (its whole output); otherwise both are None. With
    ``SamplingParams.logprobs`` set, ``logprob`` and ``top_logprobs`` come from the model's
    distribution at that position (log-softmax of the logits, before temperature / top-k / top-p)."""

    rid: int
    token: int
    finished: bool
    finish_reason: str | None = None
    request: Request | None = None
    logprob: float | None = None  # with params.logprobs: the token's log-probability
    top_logprobs: tuple[tuple[int, float], ...] | None = None  # and the k most likely (id, logprob), best first


def int_token(t: object) -> int | None:
    """``t`` as a Python int when it is an integer token id (int, numpy integer, 0-d integer tensor), else None."""
    if isinstance(t, numbers.Integral) and not isinstance(t, bool):
        return int(t)
    if isinstance(t, torch.Tensor) and t.dim() == 0 and not (t.is_floating_point() or t.is_complex()
                                                               or t.dtype == torch.bool):
        return int(t)
    return None


def prompt_ids(prompt: object, V: int, who: str) -> list[int]:
    """The prompt as a list of Python ints in [0, V), or TypeError / ValueError starting with ``who``.

    prompt  a sequence (list, tuple, 1-D numpy array) of int token ids, or a 1-D integer tensor [L]
    """
    if isinstance(prompt, torch.Tensor):
        if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
            raise TypeError(f"{who}the prompt tensor must hold integer token ids, got dtype {prompt.dtype}")
        if prompt.dim() != 1:
            raise ValueError(f"{who}the prompt tensor must be 1-D [L], got shape {tuple(prompt.shape)}")
        ids = prompt.tolist()
    elif isinstance(prompt, (str, bytes)):
        raise TypeError(f"{who}the prompt must be token ids, got a {type(prompt).__name__} "
                        "(encode the text with the tokenizer first)")
    elif isinstance(prompt, (list, tuple)) and set(map(type, prompt)) <= {int}:  # the common case, in C
        ids = list(prompt)
    elif isinstance(prompt, Iterable) and not isinstance(prompt, (Mapping, Set)):  # lists, tuples, numpy
        ids = []
        for i, t in enumerate(prompt):
            v = int_token(t)
            if v is None:
                raise TypeError(f"{who}prompt[{i}] must be an int token id, got "
                                f"{type(t).__name__} {t!r}")
            ids.append(v)
    else:
        raise TypeError(f"{who}the prompt must be a sequence of int token ids or an integer "
                        f"tensor, got {type(prompt).__name__}")
    if not ids:
        raise ValueError(f"{who}the prompt is empty")
    if min(ids) < 0 or max(ids) >= V:
        bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < V]
        where = ", ".join(f"prompt[{i}]={t}" for i, t in bad[:4])
        raise ValueError(f"{who}token ids must lie in [0, {V}) (the vocabulary), got {where}"
                         f"{' ...' if len(bad) > 4 else ''}")
    return ids


def stop_reason(r: Request, token: int, eos_token_ids: tuple[int, ...],
                tokenizer: Detokenizer | None) -> tuple[str | None, int | str | None]:
    """(finish reason, stop reason) after ``token``, just appended to ``r.output``; (None, None): go on.
    Stop strings are looked for in the whole decoded output (a stop string may span tokens)."""
    reason = finish_reason(token, len(r.output), r.params, eos_token_ids)
    if reason in ("eos", "stop"):
        return reason, token
    if r.params.stop and len(r.output) >= r.params.min_tokens:
        text = tokenizer.decode(r.output)
        for s in r.params.stop:
            if s in text:
                return "stop", s
    return reason, None


def run_logprobs(reqs: list[Request], runs: list[list[int]],
                 logits: torch.Tensor | None) -> dict[tuple[int, int], tuple[float, tuple[tuple[int, float], ...]]]:
    """(request index, position) -> (logprob, top) for the requests that asked for logprobs;
    ``logits`` [B, T, V] (position j scores run token j). One device-to-host copy."""
    want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    if not want or logits is None:
        return {}
    k = max(reqs[i].params.logprobs for i in want)
    rows = [(i, j) for i in want for j in range(len(runs[i]))]
    dev = logits.device
    ri = torch.tensor([i for i, _ in rows], device=dev)
    rj = torch.tensor([j for _, j in rows], device=dev)
    lp = torch.log_softmax(logits[ri, rj].float(), dim=-1)  # [R, V]
    tok = torch.tensor([runs[i][j] for i, j in rows], device=dev)
    chosen = lp.gather(1, tok[:, None])[:, 0]
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    chosen, top_v, top_i = chosen.tolist(), top_v.tolist(), top_i.tolist()
    out = {}
    for n, (i, j) in enumerate(rows):
        kk = reqs[i].params.logprobs
        out[i, j] = chosen[n], tuple(zip(top_i[n][:kk], top_v[n][:kk]))
    return out
