"""Speculative decoding: drafting, the verify path, acceptance and commit, for the engine's steps.

With ``speculate=K`` a decode step asks the drafter for K tokens per running request and verifies
them in one call (``Mamba2LM.verify``, T = K+1 inputs per request: the last emitted token, then the
drafts). Greedy acceptance keeps the longest prefix of drafts that equal the argmax at the
positions before them; the request emits those n drafts plus the argmax after them (the bonus
token), so 1..K+1 tokens per step, exactly the tokens plain greedy decoding emits. Requests that
sample (temperature > 0) use speculative (rejection) sampling instead
(``Sampler.speculative_sample``): with p_i the request's sampling distribution at position i,
draft d_{i+1} is accepted with probability p_i(d_{i+1}); at the first rejection the emitted token
is drawn from p_i without d_{i+1} (renormalised), and after K acceptances from p_K, so the tokens
are distributed as plain sampling from the target model (drafters propose point masses, q = 1).
The state is then committed over the n+1 inputs consumed (``Mamba2LM.commit``), and the bonus
token is the next step's first input. A request that meets a stop condition inside an accepted
run stops there (the engine's emission drops the rest of the run).

A drafter may propose fewer than K tokens for a request (none at all included): its row is padded
to K (repeating its last draft, or its last token) and its run is cut after its real drafts (any
prefix of an accepted run is a valid run). When no request of the step has a draft, the step is a
plain one (one input per request, ``path="plain"``). Otherwise the verify path is chosen per step
(``verify_path="auto"``: ``spec_policy.choose_verify_path`` with the batch, T and the crossover
table ``verify_table``): "replay" (replay-based rollback, large batches) or "legacy" (a state per
position, then a copy of the accepted one; small batches). A slot whose last step was a replay
step has its replay history flushed into its state before a legacy or plain step. The engine's
``stats`` count steps per path and drafts proposed / accepted. With CUDA graphs (the default on a
GPU) the verify steps replay from graphs per (path, batch bucket) (``GraphedVerifier``).

Host reads per speculative step: one, after the verify (``accept``: the target's tokens, and the
rejection sampling's draws, in one transfer). A drafter with ``propose_device`` (the MTP drafter)
leaves its drafts on the device: the verify inputs are built there and that same transfer reads
them back with the target's tokens, so nothing between the draft and the verify waits for the
host: with CUDA graphs the step is two graph launches on one stream (the MTP's draft graph: its
catch-up and drafts 2..k; the verify graph), not one graph. Other drafters (n-gram, model, oracle)
propose host lists, copied to the device.

Paged K/V (hybrid models): a verify step grows each request's KV by its T inputs before the model
runs, the commit shortens it to the accepted ones (``HybridCache.rollback``).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

import torch

from fastmamba.generation.drafters import NgramDrafter
from fastmamba.generation.engine_config import EngineConfig
from fastmamba.generation.requests import Request
from fastmamba.generation.sampling import Sampler
from fastmamba.generation.spec_policy import SpeculationPolicy, TableEntry, choose_verify_path, lookup_table


class Verified(NamedTuple):
    """What a verify step leaves for the engine to emit.

    runs      each request's accepted tokens (its accepted drafts, then the bonus token); None for a
              plain step, whose ``logits`` [B, V] the engine samples as a decode step's
    logits    [B, T, V'] the verify call's scores (position j scores run token j), or [B, V'] (plain)
    consumed  inputs each request's state was committed over (accepted drafts + 1)
    ntok      inputs per request in the call (T = K+1, or 1 for a plain step)
    """

    runs: list[list[int]] | None
    logits: torch.Tensor
    consumed: list[int]
    ntok: int


class Speculator:
    """The speculative side of one engine: its drafter, verify-path choice, graphs and steps.

    Built by the engine for every config; with ``speculate`` None or 0 it holds no drafter, no
    policy and no graphs, and the engine never asks it for a step.

    model      the target model (``verify``, ``commit``; ``last_hidden`` for a drafter that needs it)
    cache      its state cache (``reserve_legacy``, ``flush``; paged K/V: ``grow``, ``rollback``)
    seeds      the engine's stochastic-rounding seeds: seeds(advance) -> int64 [n_layer] or None
    stats      the engine's ``stats`` dict, whose step and draft counters the verify steps advance
    graphs     capture the verify steps in CUDA graphs (``GraphedVerifier``)
    """

    def __init__(self, model, cache, config: EngineConfig, *, seeds: Callable[..., torch.Tensor | None],
                 stats: dict, graphs: bool):
        K = self.K = config.speculate or 0
        self.model, self.cache, self.seeds, self.stats = model, cache, seeds, stats
        self.device = model.lm_head.weight.device
        self.paged = cache.paged
        # a paged KV cache (hybrid models): the engine grows it on the host before each verify step
        # (or checks the slots of an unpaged one) and shrinks it after the commit, so the model (or its
        # graph) must do neither: verify runs with grow=False
        self._no_rollback = {"rollback": False} if self.paged else {}
        drafter, policy = config.drafter, config.spec_policy
        if isinstance(drafter, str):  # "mtp": the checkpoint's MTP layer (fastmamba.generation.mtp_drafter)
            from fastmamba.generation.mtp_drafter import MTPDrafter

            on_gpu = self.device.type == "cuda"
            drafter = MTPDrafter(model, config.max_batch, max_seq_len=(config.max_seq_len or 4096) + K,
                                 cuda_graphs=on_gpu and config.cuda_graphs is not False)
        # a drafter that drafts from the target's hidden states (MTP): each verify graph's hidden
        # buffer is remembered per (path, bucket) (``verify``); the engine's prefill runs eagerly
        self.hidden_of: dict | None = None
        if getattr(drafter, "needs_hidden", False):
            self.hidden_of = {}
            if callable(getattr(drafter, "observe_prompt", None)):  # every prompt position's (observe_prefill)
                model.keep_hidden = model.keep_all_hidden = True
            policy = "adaptive" if policy is None else policy
        self.drafter = (drafter or NgramDrafter()) if K else None
        # speculation per step: K drafts always (None), or as the policy weighs cost and acceptance
        self.policy: SpeculationPolicy | None = SpeculationPolicy(K) if policy == "adaptive" else policy
        self.verify_path = config.verify_path
        self.verify_table, self.verify_table_entry = self._table(config)
        self.legacy_max_batch = 0
        if K:
            bound = config.legacy_max_batch
            if bound is None:
                bound = max((b for b in range(1, config.max_batch + 1) if self.table_path(b) == "legacy"), default=0)
            self.legacy_max_batch = min(bound, config.max_batch)
            if self.legacy_max_batch:
                cache.reserve_legacy(self.legacy_max_batch)
        self.replay_slots: set[int] = set()  # slots whose SSM state lags their replay history
        self.verifier = None
        if K and graphs:
            from fastmamba.generation.cuda_graphs import GraphedVerifier

            self.verifier = GraphedVerifier(model, cache, config.max_batch, pdl=config.pdl, rand_seed=seeds())

    def _table(self, config: EngineConfig) -> tuple:
        """The verify table (T -> crossover batch) and, when it comes from a file, its entry: the
        measured one for the model's shape and state dtype (or the nearest), this GPU's first."""
        table = config.verify_table
        if not (isinstance(table, (str, os.PathLike)) or (table is None and self.K)):
            return table, None
        state = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(config.ssm_dtype, "fp32")
        gpu = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        shape = getattr(self.model.cfg, "mamba", self.model.cfg)  # a hybrid's Mamba layers
        entry: TableEntry = lookup_table(shape.nheads, shape.headdim, shape.d_state, state, device_name=gpu,
                                         path=table)
        return entry.table, entry

    # ------------------------------------------------------------------ the verify path

    def table_path(self, batch: int) -> str:
        """``verify_path`` when forced, else the table's choice for ``batch`` requests with drafts."""
        if self.verify_path != "auto":
            return self.verify_path
        return choose_verify_path(batch, self.K + 1, self.verify_table)

    def choose_path(self, batch: int) -> str:
        """The verify path of a step of ``batch`` requests with drafts: ``table_path``, but
        replay where "auto" would exceed ``legacy_max_batch``."""
        path = self.table_path(batch)
        return "replay" if path == "legacy" and batch > self.legacy_max_batch else path

    # ------------------------------------------------------------------ one verify step

    def drafts(self, reqs: list[Request], k: int) -> list[list[int]]:
        """The drafter's proposals, checked: 0..k token ids in [0, V) per request."""
        K, V = k, self.model.cfg.vocab_size
        drafts = self.drafter.propose(reqs, K)
        if len(drafts) != len(reqs):
            raise ValueError(f"Engine: the drafter returned {len(drafts)} proposals for {len(reqs)} requests")
        out = []
        for r, d in zip(reqs, drafts):
            d = list(d)
            if len(d) > K or not all(0 <= t < V for t in d):
                raise ValueError(f"Engine: the drafter must propose at most K={K} token ids in [0, {V}) per request, "
                                 f"got {d[:8]}{'...' if len(d) > 8 else ''} for request {r.rid}")
            out.append(d)
        return out

    def draft_counts(self, reqs: list[Request], k: int) -> list[int]:
        """A device drafter's drafts per request in its next call (host bookkeeping), checked."""
        counts = list(self.drafter.draft_counts(reqs, k))
        if len(counts) != len(reqs) or not all(isinstance(n, int) and 0 <= n <= k for n in counts):
            raise ValueError(f"Engine: the drafter's draft_counts must give one int in [0, {k}] per request "
                             f"({len(reqs)}), got {counts[:8]}")
        return counts

    def device_inputs(self, reqs: list[Request], k: int, real: list[int]) -> torch.Tensor:
        """The verify inputs int64 [B, K+1] built on the device from a device drafter's drafts
        (``propose_device``): row b is request b's last token, its ``real[b]`` drafts, then its last
        draft (or last token) repeated, as ``step`` pads host lists. The last tokens and counts are
        copied to the device before the drafts are queued, and nothing after that waits for the
        host: the verify step queues behind the drafts on the same stream."""
        K, B = self.K, len(reqs)
        meta = torch.tensor([r.output[-1] for r in reqs] + real, dtype=torch.int64)
        meta = meta.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" \
            else meta.to(self.device)
        drafts = self.drafter.propose_device(reqs, k)
        if not isinstance(drafts, torch.Tensor) or tuple(drafts.shape) != (B, k) or drafts.dtype != torch.int64 \
                or drafts.device != self.device:
            is_t = isinstance(drafts, torch.Tensor)
            got = (tuple(drafts.shape), drafts.dtype, drafts.device) if is_t else type(drafts).__name__
            raise ValueError(f"Engine: the drafter's propose_device must return int64 [{B}, {k}] on {self.device}, "
                             f"got {got}")
        full = torch.cat([meta[:B, None], drafts], dim=1)  # [B, k+1]: last token, then the drafts
        # input j takes column min(j, real): the last real draft (or the last token) pads the row
        col = torch.minimum(torch.arange(K + 1, device=self.device)[None, :], meta[B:, None])
        return full.gather(1, col)

    def step(self, reqs: list[Request], k: int, sampler: Sampler) -> Verified:
        """Draft (k per request; 0: a plain step), verify, accept and commit for the running
        ``reqs`` (each one's last output token is its first input); the engine then emits.

        A drafter with ``propose_device`` (MTP) keeps its drafts on the device: the verify path,
        the cache's growth and the slots are settled from its ``draft_counts`` before it drafts,
        the verify inputs are built on the device, and the step's one host read comes after the
        verify (``accept``: the inputs and the target's tokens in one transfer). Other drafters'
        host lists are checked (``drafts``) and copied to the device."""
        K = self.K
        on_device = bool(k) and callable(getattr(self.drafter, "propose_device", None))
        drafts = None
        if on_device:
            real = self.draft_counts(reqs, k)
        else:
            drafts = self.drafts(reqs, k) if k else [[] for _ in reqs]
            real = [len(d) for d in drafts]
        path = self.choose_path(len(reqs)) if any(real) else "plain"
        if self.paged:  # room for this step's tokens: 1 (plain) or K+1 (verify), shortened at the commit
            self.cache.grow([r.slot for r in reqs], [1 if path == "plain" else K + 1] * len(reqs))
        self.stats["steps"][path] += 1
        slots = torch.tensor([r.slot for r in reqs], dtype=torch.int32, device=self.device)
        if path != "replay":  # legacy and plain read the SSM state: materialise pending replay histories
            lagging = [r.slot for r in reqs if r.slot in self.replay_slots]
            if lagging:
                self.cache.flush(torch.tensor(lagging, dtype=torch.int32, device=self.device))
        if path == "plain":
            tokens = torch.tensor([[r.output[-1]] for r in reqs], dtype=torch.int64, device=self.device)
            logits = self.verify(tokens, slots, path)[:, 0]
            self.commit(reqs, slots, [1] * len(reqs), path)
            return Verified(None, logits, [1] * len(reqs), 1)

        if on_device:  # draft, then verify: queued back to back, no host read between them
            inputs = None
            tokens = self.device_inputs(reqs, k, real)
        else:
            inputs = [[r.output[-1]] + d + [(d or [r.output[-1]])[-1]] * (K - len(d)) for r, d in zip(reqs, drafts)]
            tokens = torch.tensor(inputs, dtype=torch.int64, device=self.device)
        logits = self.verify(tokens, slots, path)  # [B, T, V']
        runs, consumed = self.accept(reqs, inputs, real, tokens, logits, sampler)
        self.stats["drafts_proposed"] += sum(real)
        self.stats["drafts_accepted"] += sum(len(run) - 1 for run in runs)
        # commit before emitting: a request finishing in this step frees its slot, which a new
        # request may then take (its prefill resets the slot's speculation counters anyway)
        self.commit(reqs, slots, consumed, path)
        return Verified(runs, logits, consumed, K + 1)

    def accept(self, reqs: list[Request], inputs: list[list[int]] | None, real: list[int], tokens: torch.Tensor,
               logits: torch.Tensor, sampler: Sampler) -> tuple[list[list[int]], list[int]]:
        """Each request's run (accepted drafts, then the bonus token) and inputs consumed.

        inputs  [B][K+1] host ids, or None (drafts on the device: read here from ``tokens``)
        tokens  int64 [B, K+1] on the device: last token, then drafts
        real    drafts per request before its padding
        logits  [B, K+1, V'] the verify call's scores
        Greedy rows keep the longest prefix of drafts the argmax agrees with; sampled rows are
        drawn by rejection sampling (``Sampler.speculative_sample``). One host read: the target's
        tokens, the rejection sampling's results and (inputs None) the inputs, in one transfer.
        A request's accepted drafts are appended to ``Request.accepted``.
        """
        K, B = self.K, len(reqs)
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        parts = [] if inputs is not None else [tokens.flatten()]
        if sampled:  # sampled rows: (drafts accepted, token emitted after them), by rejection sampling
            idx = torch.tensor(sampled, dtype=torch.int64, device=self.device)
            n_s, tok_s = sampler.speculative_sample(
                logits[idx], tokens[idx, 1:], [reqs[i].params for i in sampled], [len(reqs[i].output) for i in sampled])
            parts += [n_s.to(torch.int64), tok_s.to(torch.int64)]
        if len(sampled) < B:
            parts.append(sampler.sample_greedy(logits.flatten(0, 1)))
        vals = torch.cat(parts).tolist()  # the step's one read back
        if inputs is None:
            inputs, vals = [vals[i * (K + 1):(i + 1) * (K + 1)] for i in range(B)], vals[B * (K + 1):]
        S = len(sampled)
        spec = dict(zip(sampled, zip(vals[:S], vals[S:2 * S])))
        vals = vals[2 * S:]
        target = [vals[i * (K + 1):(i + 1) * (K + 1)] for i in range(B)] if vals else [None] * B
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
            # padding drafts are not drafts: cut the run after the real ones (a prefix of a valid
            # run is valid: each emitted token follows the target given the tokens before it)
            n = min(n, real[i])
            run = run[:n + 1]
            r.accepted.append(n)
            runs.append(run)
            consumed.append(n + 1)
        return runs, consumed

    def verify(self, tokens: torch.Tensor, slots: torch.Tensor, path: str) -> torch.Tensor:
        """The model's verify call (from a graph when there are graphs): tokens int64 [B, T], slots
        int32 [B]; returns logits [B, T, V']. The rounding seeds advance first."""
        seed = self.seeds(advance=True)
        if self.verifier is not None:
            if self.hidden_of is None:
                return self.verifier.verify(tokens, slots, path)
            captures = self.verifier.captured.count
            logits = self.verifier.verify(tokens, slots, path)
            # the hidden states a graph writes live in its own buffer, the one ``model.last_hidden``
            # pointed to when it was captured: remember it per (path, bucket), point to it after a replay
            key = (path, next(b for b in self.verifier.buckets(path) if b >= tokens.shape[0]))
            if self.verifier.captured.count != captures:
                self.hidden_of[key] = self.model.last_hidden
            self.model.last_hidden = self.hidden_of[key]
            return logits
        return self.model.verify(tokens, self.cache, slots, path=path, rand_seed=seed, grow=False)

    def commit(self, reqs: list[Request], slots: torch.Tensor, consumed: list[int], path: str) -> None:
        """Keep the state after each request's ``consumed`` inputs (slots int32 [B]); the rejected
        drafts' K/V go (the pages past each request's new length too)."""
        accepted = torch.tensor(consumed, dtype=torch.int32, device=self.device)
        if self.verifier is not None:
            self.verifier.commit(slots, accepted, path)
        else:
            self.model.commit(self.cache, slots, accepted, path=path, **self._no_rollback)
        ids = [r.slot for r in reqs]
        if self.paged:
            ntok = 1 if path == "plain" else self.K + 1
            self.cache.rollback(ids, [ntok - c for c in consumed])
        if path == "replay":
            self.replay_slots.update(ids)
        else:
            self.replay_slots.difference_update(ids)

    # ------------------------------------------------------------------ the drafter's view

    def observe(self, reqs: list[Request], counts: list[int], ntok: int = 1) -> None:
        """Hand a drafter that drafts from the target's hidden states (MTP) those of the positions
        each request consumed in the call just run (``model.last_hidden``: its first B*ntok rows, [B*T, M]
        after a verify of T tokens per request, [B, M] after a plain step; a graph's bucket
        may hold pad rows after them)."""
        if self.hidden_of is not None and reqs:
            hidden = self.model.last_hidden[:len(reqs) * ntok].view(len(reqs), ntok, self.model.cfg.d_model)
            self.drafter.observe(reqs, hidden, counts)

    def observe_prefill(self, reqs: list[Request], lengths: list[int], done: list[int]) -> None:
        """After a prefill call that fed ``reqs`` chunks of ``lengths`` tokens, in which the requests
        at indices ``done`` completed their prompt (and emitted their first token): a drafter with
        ``observe_prompt`` (MTP) gets every fed position's hidden state (``model.all_hidden`` [T, M]);
        another one that needs hidden states gets the completed prompts' last ones (``observe``)."""
        if self.hidden_of is None:
            return
        if callable(getattr(self.drafter, "observe_prompt", None)):
            hidden, self.model.all_hidden = self.model.all_hidden, None  # ([T, M]: not held past its use)
            self.drafter.observe_prompt(reqs, hidden, lengths)
        elif done:
            self.drafter.observe([reqs[i] for i in done], self.model.last_hidden[done], [1] * len(done))

    def forget(self, r: Request) -> None:
        """``r`` finished (its slot, still ``r.slot``, is about to be freed): drop what the drafter
        keeps for it (MTP pages) and the slot's pending replay history."""
        if callable(getattr(self.drafter, "forget", None)):
            self.drafter.forget(r)
        if r.slot >= 0:
            self.replay_slots.discard(r.slot)
