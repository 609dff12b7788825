"""Continuous batching: requests join and leave between steps, each with its own slot and sampling.

One ``step()`` either admits waiting requests (prefill, then their first token) or advances every
running request by one token (decode: one CUDA-graph replay on a GPU). Finished requests free
their slot at once, so a waiting request can take it at the next step.

All requests admitted in one step are prefilled together, whatever their prompt lengths: one
packed call (``Mamba2LM.prefill_varlen``) over their prompts laid back to back.

Speculative decoding (``speculate=K``): a decode step asks the drafter for K tokens per running
request and verifies them in one call (``Mamba2LM.verify``, T = K+1 inputs per request: the last
emitted token, then the drafts). Greedy acceptance keeps the longest prefix of drafts that equal
the argmax at the positions before them; the request emits those n drafts plus the argmax after
them (the bonus token), so 1..K+1 tokens per step, exactly the tokens plain greedy decoding emits.
Requests with temperature > 0 use speculative (rejection) sampling instead
(``Sampler.speculative_sample``): with p_i the request's sampling distribution at position i,
draft d_{i+1} is accepted with probability p_i(d_{i+1}); at the first rejection the emitted token
is drawn from p_i without d_{i+1} (renormalised), and after K acceptances from p_K, so the tokens
are distributed as plain sampling from the target model (drafters propose point masses, q = 1).
The state is then committed over the n+1 inputs consumed (``Mamba2LM.commit``), and the bonus
token is the next step's first input. A request that meets a stop condition inside an accepted
run stops there: the rest of the run is dropped.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Sequence

import torch

from fastmamba.generation.drafters import Drafter, NgramDrafter
from fastmamba.generation.sampling import Sampler, SamplingParams, stop_reached
from fastmamba.models.mamba2_lm import Mamba2LM


@dataclasses.dataclass
class Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    slot: int = -1
    output: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False
    # speculation: drafts accepted per verify step (as verified; a stop condition may cut the run after)
    accepted: list[int] = dataclasses.field(default_factory=list)

    @property
    def accepted_drafts(self) -> int:
        """Draft tokens accepted over the request's verify steps (each step also emits one bonus token)."""
        return sum(self.accepted)


@dataclasses.dataclass(frozen=True)
class StepOutput:
    rid: int
    token: int
    finished: bool


class Engine:
    """Generation over a ``Mamba2LM`` with continuous batching.

    max_batch     requests decoded together (and slots in the state cache)
    cuda_graphs   replay decode steps from CUDA graphs (GPU only; default: on when on a GPU)
    ssm_dtype     SSM state dtype (fp32 default; bf16/fp16 halve the state traffic)
    pdl           programmatic dependent launch inside the graphs (Hopper+)
    speculate     K >= 1: speculative decoding, verifying K drafts per request per step (greedy
                  acceptance at temperature 0, rejection sampling above; eager, no CUDA graphs
                  yet); None or 0: plain decoding
    drafter       proposes the drafts (``fastmamba.generation.drafters``); default NgramDrafter()
    """

    def __init__(self, model: Mamba2LM, *, max_batch: int = 64, cuda_graphs: bool | None = None,
                 ssm_dtype: torch.dtype = torch.float32, pdl: bool = False, speculate: int | None = None,
                 drafter: Drafter | None = None):
        if speculate is not None and not (isinstance(speculate, int) and speculate >= 0):
            raise ValueError(f"Engine: speculate must be None or an int >= 0 (number of drafts K), got {speculate!r}")
        self.speculate = speculate or 0
        if self.speculate and cuda_graphs:
            raise NotImplementedError("Engine: speculative decoding runs eagerly; CUDA-graph capture of the "
                                      "verify step is not implemented (pass cuda_graphs=False)")
        if drafter is not None and not self.speculate:
            raise ValueError("Engine: a drafter needs speculate=K with K >= 1")
        self.drafter = (drafter or NgramDrafter()) if self.speculate else None
        self.model = model
        self.device = model.lm_head.weight.device
        self.max_batch = max_batch
        self.cache = model.new_cache(max_batch, ssm_dtype=ssm_dtype, speculate=self.speculate)
        self.sampler = Sampler(model.cfg.vocab_size, self.device, max_batch)
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and not self.speculate
        self.decoder = None
        if cuda_graphs:
            from fastmamba.generation.cuda_graphs import GraphedDecoder

            self.decoder = GraphedDecoder(model, self.cache, max_batch, pdl=pdl)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: dict[int, Request] = {}
        self._ids = itertools.count()

    def add_request(self, prompt: Sequence[int] | torch.Tensor, params: SamplingParams = SamplingParams()) -> int:
        ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        if not ids:
            raise ValueError("Engine.add_request: the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.model.cfg.vocab_size]
        if bad:
            raise ValueError(f"Engine.add_request: token ids {bad[:4]} are outside [0, {self.model.cfg.vocab_size})")
        req = Request(next(self._ids), ids, params)
        self.waiting.append(req)
        return req.rid

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _emit(self, reqs: list[Request], logits: torch.Tensor) -> list[StepOutput]:
        tokens = self.sampler.sample(logits, [r.params for r in reqs], [len(r.output) for r in reqs]).tolist()
        return self._emit_runs(reqs, [[t] for t in tokens])

    def _emit_runs(self, reqs: list[Request], runs: list[list[int]]) -> list[StepOutput]:
        """Append each request's run of tokens, stopping (and freeing its slot) at a stop condition."""
        out = []
        for r, run in zip(reqs, runs):
            for t in run:
                r.output.append(t)
                if stop_reached(t, len(r.output), r.params):
                    r.finished = True
                    self.cache.free([r.slot])
                    self.finished[r.rid] = r
                out.append(StepOutput(r.rid, t, r.finished))
                if r.finished:
                    break
        self.running = [r for r in self.running if not r.finished]
        return out

    def _prefill(self) -> list[StepOutput]:
        n = min(len(self.waiting), self.max_batch - len(self.running), self.cache.free_slots)
        admitted = [self.waiting.popleft() for _ in range(n)]
        slots = self.cache.alloc(n)  # one alloc: one zeroing pass; int32 on the device, admitted order
        for req, slot in zip(admitted, slots.tolist()):
            req.slot = slot
        # one packed call: the prompts back to back, then cu_seqlens, in one host-to-device copy
        cu_seqlens = list(itertools.accumulate((len(r.prompt) for r in admitted), initial=0))
        T = cu_seqlens[-1]
        packed = torch.tensor([t for r in admitted for t in r.prompt] + cu_seqlens, dtype=torch.int64)
        packed = packed.to(self.device)
        # fresh slots: start from zeros without reading them
        logits = self.model.prefill_varlen(packed[:T], packed[T:], self.cache, slots, has_initial_state=False)
        self.running.extend(admitted)
        return self._emit(admitted, logits)

    def step(self) -> list[StepOutput]:
        """Admit waiting requests if any (prefill), else decode one token for every running one."""
        if self.waiting and len(self.running) < self.max_batch and self.cache.free_slots:
            return self._prefill()
        if not self.running:
            return []
        if self.speculate:
            return self._verify_step()
        reqs = list(self.running)
        tokens = torch.tensor([r.output[-1] for r in reqs], dtype=torch.int64, device=self.device)
        slots = torch.tensor([r.slot for r in reqs], dtype=torch.int32, device=self.device)
        if self.decoder is not None:
            logits = self.decoder.decode(tokens, slots)
        else:
            logits = self.model.decode(tokens, self.cache, slots)
        return self._emit(reqs, logits)

    def _verify_step(self) -> list[StepOutput]:
        """One speculative step for every running request: draft, verify, accept, emit, commit."""
        reqs, K, V = list(self.running), self.speculate, self.model.cfg.vocab_size
        drafts = self.drafter.propose(reqs, K)
        if len(drafts) != len(reqs):
            raise ValueError(f"Engine: the drafter returned {len(drafts)} proposals for {len(reqs)} requests")
        inputs = []
        for r, d in zip(reqs, drafts):
            d = list(d)
            if len(d) != K or not all(0 <= t < V for t in d):
                raise ValueError(f"Engine: the drafter must propose K={K} token ids in [0, {V}) per request, "
                                 f"got {d[:8]} for request {r.rid}")
            inputs.append([r.output[-1]] + d)
        tokens = torch.tensor(inputs, dtype=torch.int64, device=self.device)
        slots = torch.tensor([r.slot for r in reqs], dtype=torch.int32, device=self.device)
        logits = self.model.verify(tokens, self.cache, slots)  # [B, T, V']
        sampled = [i for i, r in enumerate(reqs) if r.params.temperature > 0]
        spec = {}  # sampled rows: (drafts accepted, token emitted after them), by rejection sampling
        if sampled:
            idx = torch.tensor(sampled, dtype=torch.int64, device=self.device)
            n_s, tok_s = self.sampler.speculative_sample(
                logits[idx], tokens[idx, 1:], [reqs[i].params for i in sampled], [len(reqs[i].output) for i in sampled])
            spec = dict(zip(sampled, zip(n_s.tolist(), tok_s.tolist())))
        target = [None] * len(reqs)
        if len(sampled) < len(reqs):
            target = self.sampler.sample_greedy(logits.flatten(0, 1)).view(len(reqs), K + 1).tolist()
        runs, consumed = [], []
        for i, (r, row, best) in enumerate(zip(reqs, inputs, target)):
            if i in spec:
                n, tok = spec[i]
                run = row[1:n + 1] + [tok]  # the n accepted drafts, then the residual / bonus draw
            else:
                n = 0  # drafts accepted: the longest prefix that the target model also picks
                while n < K and row[n + 1] == best[n]:
                    n += 1
                run = best[:n + 1]  # the n drafts, then the bonus token
            r.accepted.append(n)
            runs.append(run)
            consumed.append(n + 1)
        # commit before emitting: a request finishing in this step frees its slot, which a new
        # request may then take (its prefill resets the slot's speculation counters anyway)
        self.model.commit(self.cache, slots, torch.tensor(consumed, dtype=torch.int32, device=self.device))
        return self._emit_runs(reqs, runs)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] = SamplingParams()) -> list[list[int]]:
        """Run every prompt to completion; returns the generated ids in prompt order."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"Engine.generate: {len(prompts)} prompts but {len(plist)} SamplingParams")
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_unfinished():
            self.step()
        return [self.finished.pop(rid).output for rid in rids]
