"""Continuous batching: requests join and leave between steps, each with its own slot and sampling.

One ``step()`` either admits waiting requests (prefill, then their first token) or advances every
running request by one token (decode: one CUDA-graph replay on a GPU). Finished requests free
their slot at once, so a waiting request can take it at the next step.

All requests admitted in one step are prefilled together, whatever their prompt lengths: one
packed call (``Mamba2LM.prefill_varlen``) over their prompts laid back to back.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Sequence

import torch

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
    """

    def __init__(self, model: Mamba2LM, *, max_batch: int = 64, cuda_graphs: bool | None = None,
                 ssm_dtype: torch.dtype = torch.float32, pdl: bool = False):
        self.model = model
        self.device = model.lm_head.weight.device
        self.max_batch = max_batch
        self.cache = model.new_cache(max_batch, ssm_dtype=ssm_dtype)
        self.sampler = Sampler(model.cfg.vocab_size, self.device, max_batch)
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
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
        out = []
        for r, t in zip(reqs, tokens):
            r.output.append(t)
            if stop_reached(t, len(r.output), r.params):
                r.finished = True
                self.cache.free([r.slot])
                self.finished[r.rid] = r
            out.append(StepOutput(r.rid, t, r.finished))
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
        reqs = list(self.running)
        tokens = torch.tensor([r.output[-1] for r in reqs], dtype=torch.int64, device=self.device)
        slots = torch.tensor([r.slot for r in reqs], dtype=torch.int32, device=self.device)
        if self.decoder is not None:
            logits = self.decoder.decode(tokens, slots)
        else:
            logits = self.model.decode(tokens, self.cache, slots)
        return self._emit(reqs, logits)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] = SamplingParams()) -> list[list[int]]:
        """Run every prompt to completion; returns the generated ids in prompt order."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"Engine.generate: {len(prompts)} prompts but {len(plist)} SamplingParams")
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_unfinished():
            self.step()
        return [self.finished.pop(rid).output for rid in rids]
