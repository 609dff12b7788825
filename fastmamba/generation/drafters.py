"""Drafters for speculative decoding: each proposes K tokens per running request.

A drafter has one method, ``propose(requests, k) -> list[list[int]]``: for every request (an
object with ``prompt`` and ``output`` token lists, such as the engine's ``Request``) exactly k
token ids guessed to follow ``prompt + output``. Wrong guesses cost only verify work: greedy
acceptance keeps the longest prefix that matches the target model, so the generated tokens do
not depend on the drafter.

    NgramDrafter   prompt lookup: continue the most recent earlier occurrence of the last n tokens
    OracleDrafter  replays known continuations (a previous greedy run): every draft accepted
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol


class DraftRequest(Protocol):
    prompt: list[int]
    output: list[int]


class Drafter(Protocol):
    def propose(self, requests: Sequence[DraftRequest], k: int) -> list[list[int]]:
        """k draft token ids per request, in request order."""
        ...


def _pad(tokens: list[int], k: int, fill: int) -> list[int]:
    """tokens cut or padded to k (any padding works: acceptance rejects mismatches)."""
    return (tokens + [fill] * k)[:k]


class NgramDrafter:
    """Prompt-lookup drafting over the request's own history (prompt + generated tokens).

    For n from ``max_ngram`` down to ``min_ngram``: find the most recent earlier occurrence of the
    history's last n tokens and propose the (up to) k tokens that followed it. With no match, or
    fewer than k tokens after the match, the proposal is padded by repeating its last token (the
    history's last token when nothing matched). Host-side Python, O(len(history) * n) per request.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"NgramDrafter: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def draft(self, history: Sequence[int], k: int) -> list[int]:
        """k tokens guessed to follow ``history`` (non-empty)."""
        h = list(history)
        L = len(h)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            suffix = h[L - n:]
            for i in range(L - n - 1, -1, -1):  # start of an earlier occurrence, most recent first
                if h[i:i + n] == suffix:
                    found = h[i + n:i + n + k]
                    return _pad(found, k, found[-1])
        return [h[-1]] * k

    def propose(self, requests: Sequence[DraftRequest], k: int) -> list[list[int]]:
        return [self.draft(r.prompt + r.output, k) for r in requests]


class OracleDrafter:
    """Replays known continuations, keyed by prompt: for a request with prompt p that has generated
    m tokens, proposes ``continuations[tuple(p)][m:m+k]`` (padded with the last known token, or 0,
    past its end). Fed a plain greedy run's outputs, every draft is accepted: the upper bound for
    benchmarks and a check for tests. A prompt without an entry gets padding only.
    """

    def __init__(self, continuations: Mapping[Sequence[int], Sequence[int]]):
        self.continuations = {tuple(p): list(c) for p, c in continuations.items()}

    @classmethod
    def from_runs(cls, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> OracleDrafter:
        if len(prompts) != len(outputs):
            raise ValueError(f"OracleDrafter.from_runs: {len(prompts)} prompts but {len(outputs)} outputs")
        return cls(dict(zip(map(tuple, prompts), outputs)))

    def propose(self, requests: Sequence[DraftRequest], k: int) -> list[list[int]]:
        out = []
        for r in requests:
            cont = self.continuations.get(tuple(r.prompt), [])
            m = len(r.output)
            out.append(_pad(cont[m:m + k], k, cont[-1] if cont else 0))
        return out


def make_drafter(name: str, **kwargs) -> Drafter:
    """``ngram`` (kwargs: max_ngram, min_ngram) or ``oracle`` (kwargs: continuations)."""
    if name == "ngram":
        return NgramDrafter(**kwargs)
    if name == "oracle":
        return OracleDrafter(**kwargs)
    raise ValueError(f"make_drafter: unknown drafter {name!r}; expected 'ngram' or 'oracle'")
