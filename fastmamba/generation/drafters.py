"""Drafters for speculative decoding: each proposes K tokens per running request.

A drafter has one method, ``propose(requests, k) -> list[list[int]]``: for every request (an
object with ``prompt`` and ``output`` token lists, such as the engine's ``Request``) exactly k
token ids guessed to follow ``prompt + output``. Wrong guesses cost only verify work: greedy
acceptance keeps the longest prefix that matches the target model, so the generated tokens do
not depend on the drafter.

    NgramDrafter   prompt lookup: continue the most recent earlier occurrence of the last n tokens
    OracleDrafter  replays known continuations (a previous greedy run): every draft accepted
    ModelDrafter   greedy continuations of a small Mamba-2 draft model (or the target itself)
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from fastmamba.models.mamba2_lm import Mamba2LM


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


def check_draft_vocab(draft_vocab_size: int, target_vocab_size: int) -> None:
    """A draft model must share the target's token ids: equal (padded) vocabulary sizes, else ValueError."""
    if draft_vocab_size != target_vocab_size:
        raise ValueError(f"ModelDrafter: the draft model's vocab_size ({draft_vocab_size}) differs from the target "
                         f"model's ({target_vocab_size}); a draft model must use the target's tokenizer and "
                         f"vocabulary (e.g. mamba2-130m drafting for mamba2-2.7b, both 50288)")


@dataclasses.dataclass
class _Tracked:
    """A request the draft model has seen: its committed slot and how many history tokens it consumed."""
    request: DraftRequest  # held, so that id(request) cannot be reused while tracked
    slot: int
    consumed: int = 0


class ModelDrafter:
    """Greedy drafts from a Mamba-2 draft model: a smaller model of the same vocabulary, or the target.

    model              the draft ``Mamba2LM`` (any dtype/device; drafts come back as host ints)
    max_batch          the most requests one ``propose`` call may carry (the engine's max_batch)
    target_vocab_size  the target model's vocab_size: checked against the draft model's (ValueError)
    decode_catch_up    a request's catch-up of at most this many tokens runs as decode steps
                       (default 8; 0: every catch-up is prefilled); see below
    cuda_graphs        replay the draft model's decode steps from CUDA graphs (default: on a GPU)
    ssm_dtype          the draft cache's SSM state dtype

    The drafter owns a plain (non-speculative) ``StateCache`` of 2 * max_batch slots: max_batch
    scratch slots, and one committed slot per tracked request holding the draft model's state after
    the request's history (prompt + output) up to ``consumed`` tokens. ``propose(requests, k)``:

    1. frees the slots of tracked requests missing from the call (they have finished) and allocates
       one for each new request;
    2. catches every request up on its not-yet-consumed history, from zeros for a new request, from
       its committed state otherwise: new requests and long catch-ups with ONE packed
       ``prefill_varlen``; the short catch-ups of running requests (1..K+1 tokens after a verify
       step) with as many batched ``decode`` steps as the longest of them (CUDA-graph replays on a
       GPU: on an H100, mamba2-130m drafting k=3 after catch-ups of 1-4 tokens, a call takes 3-5 ms
       this way and ~50 ms with an eager packed prefill, whose launches dominate).
       The logits after each request's last history token give draft 1 (argmax); the committed
       states now cover the whole history;
    3. for k > 1, copies the committed conv and SSM states (every layer) into scratch slots and runs
       k-1 greedy ``decode`` steps there, drafts 2..k; the committed slots are left untouched, so
       rejected drafts cost nothing to undo.

    Between two calls each request must have gained at least one token (the engine emits 1..K+1 per
    verify step): no catch-up is empty. Requests are tracked by identity (the same object across
    calls, as the engine's ``Request``). One host sync per call (the drafts).
    """

    def __init__(self, model: Mamba2LM, max_batch: int = 64, *, target_vocab_size: int | None = None,
                 decode_catch_up: int = 8, cuda_graphs: bool | None = None, ssm_dtype: torch.dtype = torch.float32):
        if not (isinstance(max_batch, int) and max_batch >= 1):
            raise ValueError(f"ModelDrafter: max_batch must be an int >= 1, got {max_batch!r}")
        if not (isinstance(decode_catch_up, int) and decode_catch_up >= 0):
            raise ValueError(f"ModelDrafter: decode_catch_up must be an int >= 0, got {decode_catch_up!r}")
        if target_vocab_size is not None:
            check_draft_vocab(model.cfg.vocab_size, target_vocab_size)
        self.model = model
        self.max_batch = max_batch
        self.decode_catch_up = decode_catch_up
        self.vocab_size = model.cfg.vocab_size
        self.device = model.lm_head.weight.device
        self.cache = model.new_cache(2 * max_batch, ssm_dtype=ssm_dtype)
        self.scratch = self.cache.alloc(max_batch)  # int32 on the device; never freed
        self._tracked: dict[int, _Tracked] = {}  # id(request) -> its committed slot
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        self.decoder = None
        if cuda_graphs:
            from fastmamba.generation.cuda_graphs import GraphedDecoder

            self.decoder = GraphedDecoder(model, self.cache, max_batch)

    def check_target(self, target: Mamba2LM) -> None:
        """ValueError unless the draft model's vocabulary matches ``target``'s."""
        check_draft_vocab(self.vocab_size, target.cfg.vocab_size)

    @property
    def tracked(self) -> int:
        """Requests holding a committed slot (those of the last ``propose`` call)."""
        return len(self._tracked)

    def _sync_requests(self, requests: Sequence[DraftRequest]) -> list[_Tracked]:
        """Free finished requests' slots, allocate new ones'; the tracked entries in request order."""
        keys = [id(r) for r in requests]
        if len(set(keys)) != len(keys):
            raise ValueError("ModelDrafter.propose: the same request appears more than once in one call")
        live = set(keys)
        gone = [key for key in self._tracked if key not in live]
        if gone:
            self.cache.free([self._tracked.pop(key).slot for key in gone])
        new = [r for r in requests if id(r) not in self._tracked]
        if new:
            for r, slot in zip(new, self.cache.alloc(len(new)).tolist()):
                self._tracked[id(r)] = _Tracked(r, slot)
        return [self._tracked[key] for key in keys]

    def _catch_up_tokens(self, entry: _Tracked) -> list[int]:
        """The request's history tokens that its committed slot has not consumed yet (>= 1)."""
        r = entry.request
        n_prompt = len(r.prompt)
        if entry.consumed < n_prompt:
            new = list(r.prompt[entry.consumed:]) + list(r.output)
        else:
            new = list(r.output[entry.consumed - n_prompt:])
        if not new:
            raise RuntimeError(f"ModelDrafter.propose: a request has no new tokens since the last call (history of "
                               f"{entry.consumed} tokens, all consumed); each request must gain at least one token "
                               f"between calls, as after every verify step")
        bad = [t for t in new if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"ModelDrafter.propose: token ids {bad[:4]} are outside the draft model's vocabulary "
                             f"[0, {self.vocab_size})")
        return new

    def _decode(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Greedy next tokens [B] int64 after one decode step of ``tokens`` [B] on ``slots`` [B] int32."""
        if self.decoder is not None:
            return self.decoder.decode(tokens, slots).argmax(-1)
        return self.model.decode(tokens, self.cache, slots).argmax(-1)

    def _prefill(self, entries: list[_Tracked], seqs: list[list[int]]) -> torch.Tensor:
        """One packed prefill of ``seqs`` into the entries' committed slots; argmax after each [B] int64."""
        cu_seqlens = list(itertools.accumulate(map(len, seqs), initial=0))
        T, B = cu_seqlens[-1], len(seqs)
        # one host-to-device copy: the tokens back to back, cu_seqlens, the slots, the has-state flags
        started = [int(e.consumed > 0) for e in entries]
        packed = torch.tensor([t for seq in seqs for t in seq] + cu_seqlens + [e.slot for e in entries] + started,
                              dtype=torch.int64).to(self.device)
        ids, cu, slots = packed[:T], packed[T:T + B + 1], packed[T + B + 1:T + 2 * B + 1]
        flags: torch.Tensor | bool = packed[T + 2 * B + 1:].bool()
        if all(started):
            flags = True
        elif not any(started):
            flags = False  # fresh slots: start from zeros without reading them
        return self.model.prefill_varlen(ids, cu, self.cache, slots, has_initial_state=flags).argmax(-1)

    def _decode_catch_up(self, entries: list[_Tracked], seqs: list[list[int]]) -> torch.Tensor:
        """``seqs`` fed one token per decode step into the committed slots; argmax after each [B] int64.

        Longest first, so that step j runs on a prefix of the rows: those with more than j tokens.
        """
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
        lens = [len(seqs[i]) for i in order]
        m, B = lens[0], len(seqs)
        grid = [seqs[i] + [0] * (m - len(seqs[i])) for i in order]  # [B, m], padded
        packed = torch.tensor([t for row in grid for t in row] + [entries[i].slot for i in order] + order,
                              dtype=torch.int64).to(self.device)
        tokens = packed[:B * m].view(B, m)
        slots = packed[B * m:B * m + B].to(torch.int32)
        last = torch.empty(B, dtype=torch.int64, device=self.device)  # sorted order
        for j in range(m):
            active = sum(n > j for n in lens)
            # rows still going get overwritten at a later step: each keeps its last step's argmax
            last[:active] = self._decode(tokens[:active, j].contiguous(), slots[:active])
        out = torch.empty_like(last)
        out[packed[B * m + B:]] = last  # back to the callers' order
        return out

    def propose(self, requests: Sequence[DraftRequest], k: int) -> list[list[int]]:
        if not (isinstance(k, int) and k >= 1):
            raise ValueError(f"ModelDrafter.propose: k must be an int >= 1, got {k!r}")
        if len(requests) > self.max_batch:
            raise ValueError(f"ModelDrafter.propose: {len(requests)} requests, but the drafter was built for "
                             f"max_batch={self.max_batch}")
        entries = self._sync_requests(requests)
        if not entries:
            return []
        seqs = [self._catch_up_tokens(e) for e in entries]
        B = len(entries)
        short = [i for i, (e, seq) in enumerate(zip(entries, seqs)) if e.consumed and len(seq) <= self.decode_catch_up]
        long = sorted(set(range(B)) - set(short))
        # one host-to-device copy: the committed slots, then the two groups' request indices
        meta = torch.tensor([e.slot for e in entries] + long + short, dtype=torch.int64).to(self.device)
        committed, groups = meta[:B], (meta[B:B + len(long)], meta[B + len(long):])
        first = torch.empty(B, dtype=torch.int64, device=self.device)  # draft 1 per request
        # no_grad, not inference_mode: tensors made here stay ordinary, so that the prefill's ops read
        # cu_seqlens on the host once per call, not once per layer (see ops/_common/host_values.py)
        with torch.no_grad():
            for group, idx, run in ((long, groups[0], self._prefill), (short, groups[1], self._decode_catch_up)):
                if group:
                    first[idx] = run([entries[i] for i in group], [seqs[i] for i in group])
            for e, seq in zip(entries, seqs):
                e.consumed += len(seq)
            drafts = [first]
            if k > 1:
                scratch = self.scratch[:B]
                dst = scratch.long()
                for conv, ssm in zip(self.cache.conv, self.cache.ssm):
                    conv.index_copy_(0, dst, conv.index_select(0, committed))
                    ssm.index_copy_(0, dst, ssm.index_select(0, committed))
                for _ in range(k - 1):
                    drafts.append(self._decode(drafts[-1], scratch))
            return torch.stack(drafts, dim=1).tolist()


def make_drafter(name: str, **kwargs) -> Drafter:
    """``ngram`` (kwargs: max_ngram, min_ngram), ``oracle`` (kwargs: continuations) or ``model``
    (kwargs: model, max_batch, target_vocab_size, decode_catch_up, cuda_graphs, ssm_dtype; see
    ``ModelDrafter``)."""
    if name == "ngram":
        return NgramDrafter(**kwargs)
    if name == "oracle":
        return OracleDrafter(**kwargs)
    if name == "model":
        return ModelDrafter(**kwargs)
    raise ValueError(f"make_drafter: unknown drafter {name!r}; expected 'ngram', 'oracle' or 'model'")
