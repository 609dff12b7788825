"""Continuous batching: requests join and leave between steps, each with its own slot and sampling.

One ``step()`` either admits waiting requests (prefill, then their first token) or advances every
running request by one token (decode: one CUDA-graph replay on a GPU). Finished requests free
their slot at once, so a waiting request can take it at the next step.

All requests admitted in one step are prefilled together, whatever their prompt lengths: one
packed call (``Mamba2LM.prefill_varlen``) over their prompts laid back to back.

The engine is three rooms and this one:
  * ``engine_config.EngineConfig``: every option, its default and its check;
  * ``scheduler.Scheduler``: the queues, admission, the chunk plan, K/V page accounting (hybrid
    models) and the prefix-cache snapshot plan, from host-side counts only;
  * ``speculative.Speculator``: drafting, the verify path, acceptance and commit (``speculate=K``);
  * here, ``Engine``: the public API and the runner, which executes the plans (prefill, decode and
    verify calls, eagerly or from CUDA graphs) and emits their tokens, stopping requests.
``requests`` holds ``Request`` / ``StepOutput`` and the checks on a prompt and after a token.

A request's life (intake checks, stop conditions, how finished and failed requests are handed
out) is told in ``requests``' docstring.

Hybrid models (``NemotronHLM``: Mamba-2, attention and MLP layers) run through the same calls;
their cache (``HybridCache``) adds paged K/V for the attention layers, whose pages the scheduler
counts (``scheduler``'s docstring says how a request waits for pages, and when one is failed
because none can advance). Speculative decoding is described in ``speculative``'s docstring.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from fastmamba.generation.engine_config import VERIFY_PATHS, EngineConfig
from fastmamba.generation.requests import (FINISH_REASONS, Detokenizer, Request, StepOutput, prompt_ids, run_logprobs,
                                           stop_reason)
from fastmamba.generation.rounding import StochasticRounding
from fastmamba.generation.sampling import Sampler, SamplingParams
from fastmamba.generation.scheduler import Scheduler
from fastmamba.generation.speculative import Speculator
from fastmamba.models.checkpoint_config import ssm_state_dtype
from fastmamba.models.mamba2_lm import Mamba2LM
from fastmamba.models.quantization import set_kv_cache_dtype

__all__ = ["Engine", "EngineConfig", "Request", "StepOutput", "Detokenizer", "VERIFY_PATHS", "FINISH_REASONS"]


def _from_spec(name: str, doc: str) -> property:
    """A read-only Engine attribute that the engine's ``Speculator`` holds."""
    return property(lambda self: getattr(self.spec, name), doc=doc)


class Engine:
    """Generation over a ``Mamba2LM`` or a hybrid ``NemotronHLM`` with continuous batching.

    ``Engine(model, **options)`` or ``Engine(model, config=EngineConfig(...))``: the options, their
    defaults and their checks are ``EngineConfig``'s (its docstring lists them); ``config`` keeps
    them. A bad option is a TypeError / ValueError naming it, raised before anything is allocated.

    scheduler     the ``Scheduler``: ``waiting``, ``prefilling`` and ``running`` requests, ``prefix``
                  (the ``PrefixCache`` or None) and ``prefix_block`` are its, read through here
    spec          the ``Speculator``: ``drafter``, ``policy``, ``verify_path``, ``verify_table``,
                  ``verify_table_entry``, ``legacy_max_batch`` and ``verifier`` are its
    cache         the model's state cache (``model.new_cache``; ``HybridCache`` with paged K/V)
    decoder / prefiller  the CUDA graphs of decode steps / packed prefills (None: eager)
    capacity      ``gpu_memory_utilization``'s plan (``fastmamba.generation.capacity.CapacityPlan``) or None
    finished      uncollected finished requests by id, oldest first (at most ``max_finished``)

    ``stats``: {"steps": {"replay": n, "legacy": n, "plain": n}, "drafts_proposed": n,
    "drafts_accepted": n} over the engine's verify steps (a draft is accepted when it is emitted),
    and "prefill_tokens": the prompt tokens actually run through prefill (a prefix-cache hit's
    tokens are not); with a speculation policy, "policy": its last report.

    End-of-sequence ids come from ``model.cfg.eos_token_ids`` (a tuple of ints; empty or absent:
    none, only the request's own stop conditions apply); ``eos_token_ids`` holds them.
    """

    def __init__(self, model: Mamba2LM, *, config: EngineConfig | None = None, **options):
        if config is None:
            config = EngineConfig(**options)
        elif not isinstance(config, EngineConfig):
            raise TypeError(f"Engine: config must be an EngineConfig, got {type(config).__name__}")
        elif options:
            raise TypeError(f"Engine: give the options in config or as keywords, not both; got config and "
                            f"{', '.join(sorted(options))}")
        self.eos_token_ids: tuple[int, ...] = config.check_model(model)
        self.config = config  # as given; the rooms below get it with ``ssm_dtype`` resolved
        # the SSM state dtype (the option, else the checkpoint's mamba_ssm_cache_dtype, else fp32) and
        # the K/V page dtype (the option, else the model's: float8 for a checkpoint with K/V scales)
        self.ssm_dtype, self.ssm_dtype_source = ssm_state_dtype(model.cfg, config.ssm_dtype)
        config = dataclasses.replace(config, ssm_dtype=self.ssm_dtype)  # its checks again, with the dtype chosen
        self.kv_cache_note = set_kv_cache_dtype(model, config.kv_cache_dtype)
        self.tokenizer = config.tokenizer
        self.max_finished = config.finished_kept
        self.max_batch, self.prefill_chunk = config.max_batch, config.prefill_chunk
        self.speculate = config.speculate or 0
        self.capacity, kv_options = config.cache_plan(model)  # gpu_memory_utilization's plan, or None
        self.model = model
        self.device = model.lm_head.weight.device
        self.cache = model.new_cache(config.max_batch, ssm_dtype=config.ssm_dtype, speculate=self.speculate,
                                     **kv_options)
        # a paged KV cache (hybrid models): the scheduler grows it on the host before each decode
        # step (or checks the slots of an unpaged one), so the model (or its graph) runs with grow=False
        self._paged = self.cache.paged
        self.rounding = (StochasticRounding(model.cfg.n_layer, self.device, config.rounding_seed)
                         if config.stochastic_rounding else None)
        self.sampler = Sampler(model.cfg.vocab_size, self.device, config.max_batch)
        self.stats = {"steps": {"replay": 0, "legacy": 0, "plain": 0}, "drafts_proposed": 0, "drafts_accepted": 0,
                      "prefill_tokens": 0}
        self.scheduler = Scheduler(self.cache, config, model.cfg.chunk_size)
        graphs = self.device.type == "cuda" if config.cuda_graphs is None else config.cuda_graphs
        self.spec = Speculator(model, self.cache, config, seeds=self._rand_seed, stats=self.stats, graphs=graphs)
        self._seen: torch.Tensor | None = None  # [max_batch, V] bool: tokens of a slot's prompt + output, made
        # at the first request with a repetition penalty or min_tokens (``_emit_first``)
        self.decoder = None
        if graphs and not self.speculate:
            from fastmamba.generation.cuda_graphs import GraphedDecoder

            self.decoder = GraphedDecoder(model, self.cache, config.max_batch, pdl=config.pdl,
                                          rand_seed=self._rand_seed())
        self.prefiller = None
        # a drafter that drafts from the target's hidden states (MTP): prefill runs eagerly (its
        # graphs do not keep them)
        graph_prefill_tokens = None if self.spec.hidden_of is not None else config.graph_prefill_tokens
        if graphs and graph_prefill_tokens:
            from fastmamba.generation.prefill_graphs import GraphedPrefill

            # room for a whole chunk of prefill_chunk tokens plus the padding requests' tokens
            cap = max(graph_prefill_tokens, (config.prefill_chunk or 0) + config.max_batch + 1)
            self.prefiller = GraphedPrefill(model, self.cache, max_tokens=cap, max_requests=config.max_batch,
                                            pdl=config.pdl, rand_seed=self._rand_seed())
        self.finished: OrderedDict[int, Request] = OrderedDict()  # uncollected, oldest first
        self._ids = itertools.count()

    # the scheduler's and the speculator's state, read through the engine
    waiting = property(lambda self: self.scheduler.waiting, doc="Requests not yet holding a slot, oldest first.")
    prefilling = property(lambda self: self.scheduler.prefilling,
                          doc="Requests holding a slot whose prompt is partly fed (chunked prefill).")
    running = property(lambda self: self.scheduler.running, doc="Requests decoding.")
    prefix_block = property(lambda self: self.scheduler.prefix_block, doc="The prefix cache's snapshot interval.")
    drafter = _from_spec("drafter", "The drafter (None without speculation).")
    policy = _from_spec("policy", "The speculation policy (None: K drafts every step).")
    verify_path = _from_spec("verify_path", "The verify_path option.")
    verify_table = _from_spec("verify_table", "T -> crossover batch: the verify table in use.")
    verify_table_entry = _from_spec("verify_table_entry", "The table file's entry in use (None: no file).")
    legacy_max_batch = _from_spec("legacy_max_batch", "The largest batch a legacy verify step takes.")
    verifier = _from_spec("verifier", "The CUDA graphs of verify steps (None: eager, or no speculation).")

    prefix = property(lambda self: self.scheduler.prefix, lambda self, v: setattr(self.scheduler, "prefix", v),
                      doc="The ``PrefixCache`` (None: prefix caching is off).")
    max_request_tokens = property(lambda self: self.scheduler.max_request_tokens,
                                  doc="The most KV positions one request may use (``Scheduler.max_request_tokens``).")

    @property
    def prefix_stats(self) -> dict[str, int] | None:
        """The prefix cache's counters (lookups, hits, prompt_tokens, hit_tokens, saves, evictions), or None."""
        return None if self.prefix is None else dict(self.prefix.stats)

    @property
    def graph_captures(self) -> dict[str, float]:
        """CUDA graphs captured so far (decode, verify, prefill and the MTP drafter's) and the host seconds
        the captures took: {"count": n, "seconds": s}. Graphs are captured at a bucket's first use."""
        owners = [o for o in (self.decoder, self.verifier, self.prefiller) if o is not None]
        if getattr(self.drafter, "captured", None) is not None:
            owners.append(self.drafter)
        return {"count": sum(o.captured.count for o in owners), "seconds": sum(o.captured.seconds for o in owners)}

    def warm_up(self) -> None:
        """Run one request now, so that the first client's does not pay the lazy work: op registration
        and kernel compiles, and with CUDA graphs the graphs of a long prompt's prefill chunk (a whole
        ``prefill_chunk`` and one token more, so that the chunk takes a long prompt's snapshots when
        there is a prefix cache; else the largest graphed prefill) and of a batch-1 decode step.
        Nothing of it is kept: its output, the prefix cache's entries and counters, the prefill token
        count. Without graphs one token of prompt does.
        On an H200 (mamba2-2.7b, prefix cache, chunks of 2048, a fresh Triton cache) the first
        3000-token request took 11.6 s after a one-token warm-up (12.0 s), 0.54 s after this one
        (20.4 s), the next ones 36-37 ms either way."""
        if self.has_unfinished():
            raise RuntimeError("Engine.warm_up: requests are queued or running; warm up before adding any")
        length = 1
        if self.prefiller is not None:  # a whole chunk and one token more: the chunk takes every snapshot
            length = self.prefill_chunk + 1 if self.prefill_chunk else self.prefiller.token_buckets[-1]
        limit = self.max_request_tokens
        if limit is not None:
            length = max(1, min(length, limit - 1))
        self.generate([[0] * length], SamplingParams(max_new_tokens=2, ignore_eos=True))
        self.pop_finished()
        if self.prefix is not None:
            self.prefix.clear()
        self.stats["prefill_tokens"] = 0

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, prompt: Sequence[int] | torch.Tensor, params: SamplingParams = SamplingParams()) -> int:
        """Queue a request; returns its id.

        prompt  token ids: a sequence (list, tuple, 1-D numpy array) of ints, or a 1-D integer
                tensor; each in [0, V)
        params  a ``SamplingParams``; ``stop`` strings need the engine's tokenizer
        Raises TypeError (wrong type: params, the prompt, or the id at a given position) or
        ValueError (empty prompt, ids out of range, stop strings without a tokenizer) before
        anything is queued.
        """
        self._check_params(params, "Engine.add_request")
        ids = prompt_ids(prompt, self.model.cfg.vocab_size, "Engine.add_request: ")
        self.scheduler.check_fits(ids, params, "Engine.add_request: ")
        return self._queue(ids, params)

    def _check_params(self, params: SamplingParams, who: str) -> None:
        """What only the engine can say of ``params``: its kind, stop strings (they need the engine's
        tokenizer), penalties (not with speculation)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"{who}: params must be a SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"Engine.add_request: stop strings {list(params.stop)!r} need a tokenizer to decode the "
                             "output; build the engine with Engine(model, tokenizer=...)")
        if params.penalised and self.speculate:
            raise ValueError("Engine.add_request: min_tokens and repetition_penalty are not supported with "
                             f"speculative decoding (this engine has speculate={self.speculate})")

    def add_validated_request(self, ids: list[int], params: SamplingParams) -> int:
        """``add_request`` for a request its caller has checked where it entered, and that the engine
        trusts: ``ids`` a non-empty list of Python ints in [0, V) (kept, not copied), and prompt +
        ``params.max_new_tokens`` - 1 within ``max_request_tokens``. The serving loop takes this path
        (the server's ``ServerState`` checked both), so nothing is checked twice; only ``params``
        is checked here, for what only the engine knows (its tokenizer, speculation)."""
        self._check_params(params, "Engine.add_validated_request")
        return self._queue(ids, params)

    def _queue(self, ids: list[int], params: SamplingParams) -> int:
        req = Request(next(self._ids), ids, params)
        self.scheduler.add(req)
        return req.rid

    def _rand_seed(self, advance: bool = False) -> torch.Tensor | None:
        """The stochastic-rounding seeds (None: round to nearest); ``advance``: first move them on
        (in place, before a step that stores states)."""
        if self.rounding is None:
            return None
        if advance:
            self.rounding.advance()
        return self.rounding.seeds

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def pop_finished(self, rid: int | None = None) -> Request | list[Request]:
        """Collect finished requests: the one with id ``rid`` (KeyError if it is not among the
        uncollected finished ones), or with ``rid=None`` all of them, oldest first. Collected
        requests are no longer kept."""
        if rid is not None:
            return self.finished.pop(rid)
        out = list(self.finished.values())
        self.finished.clear()
        return out

    def abort(self, rid: int) -> bool:
        """Stop a waiting or running request (finish_reason "abort", its slot freed, kept in
        ``finished`` like any finished request). Returns False when no such request is unfinished."""
        r = self.scheduler.find(rid)
        if r is not None:
            self._finish(r, "abort")
            self.scheduler.remove(r)
        return r is not None

    def _finish(self, r: Request, reason: str, stop_reason: int | str | None = None,
                error: BaseException | None = None) -> None:
        """Mark ``r`` finished, free its slot, keep it in ``finished`` (the oldest beyond max_finished go)."""
        r.finished, r.finish_reason, r.stop_reason, r.error = True, reason, stop_reason, error
        if self.speculate:  # a drafter's per-request state (MTP pages), the slot's replay history
            self.spec.forget(r)
        self.scheduler.release(r)  # its slot (and its state into the prefix cache, when it ended by itself)
        self.finished[r.rid] = r
        while len(self.finished) > self.max_finished:
            self.finished.popitem(last=False)

    def _fail(self, reqs: list[Request], exc: BaseException, what: str) -> None:
        """Finish the step's unfinished requests with finish_reason "error", free their slots, and
        note on ``exc`` which requests failed."""
        failed = [r for r in reqs if not r.finished]
        for r in failed:
            self._finish(r, "error", error=exc)
        self.scheduler.drop_finished(prefilling=True)
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(f"Engine.step: the {what} failed; requests {[r.rid for r in failed]} are finished with "
                         "finish_reason 'error' (see Engine.finished) and their slots freed; the engine keeps serving")

    def _evict(self) -> None:
        """The K/V pool is out of pages and no request can advance: fail the scheduler's choice
        (finish_reason "error", no StepOutput) so that its pages go back."""
        victim, exc = self.scheduler.eviction()
        self._finish(victim, "error", error=exc)
        self.scheduler.remove(victim)

    # ------------------------------------------------------------------ emitting tokens

    def _emit(self, reqs: list[Request], logits: torch.Tensor) -> list[StepOutput]:
        """Sample one token per request from ``logits`` [B, V] and emit it."""
        params, steps = [r.params for r in reqs], [len(r.output) for r in reqs]
        if not any(p.penalised for p in params):
            tokens = self.sampler.sample(logits, params, steps).tolist()
            return self._emit_runs(reqs, [[t] for t in tokens], logits[:, None])
        # repetition penalty / min_tokens: the sampled logits change, the logprobs keep the model's
        slots = torch.tensor([r.slot for r in reqs], dtype=torch.int64, device=self.device)
        penalised = self.sampler.penalise(logits, params, steps, seen=self._seen[slots], eos_token_ids=self.eos_token_ids)
        tokens = self.sampler.sample(penalised, params, steps)
        self._seen[slots, tokens] = True  # the emitted tokens count as seen from the next step on
        return self._emit_runs(reqs, [[t] for t in tokens.tolist()], logits[:, None])

    def _emit_first(self, reqs: list[Request], logits: torch.Tensor) -> list[StepOutput]:
        """``_emit`` of requests whose prompt just completed: a penalised one's seen-token row
        (repetition penalty, min_tokens) starts from its prompt first."""
        for r in reqs:
            if r.params.penalised:
                if self._seen is None:
                    self._seen = torch.zeros(self.max_batch, self.model.cfg.vocab_size, dtype=torch.bool,
                                             device=self.device)
                self._seen[r.slot] = False
                self._seen[r.slot, torch.tensor(r.prompt, dtype=torch.int64, device=self.device)] = True
        return self._emit(reqs, logits)

    def _emit_runs(self, reqs: list[Request], runs: list[list[int]],
                   logits: torch.Tensor | None = None) -> list[StepOutput]:
        """Append each request's run of tokens, stopping (and freeing its slot) at a stop condition.
        ``logits`` [B, T, V]: the scores of each run's positions (for requests that want logprobs)."""
        lps = run_logprobs(reqs, runs, logits)
        out = []
        for i, (r, run) in enumerate(zip(reqs, runs)):
            for j, t in enumerate(run):
                r.output.append(t)
                lp, top = lps.get((i, j), (None, None))
                reason, why = stop_reason(r, t, self.eos_token_ids, self.tokenizer)
                if reason is not None:
                    self._finish(r, reason, why)
                    out.append(StepOutput(r.rid, t, True, reason, r, lp, top))
                    break
                out.append(StepOutput(r.rid, t, False, logprob=lp, top_logprobs=top))
        self.scheduler.drop_finished()
        return out

    # ------------------------------------------------------------------ prefill

    def _run_prefill(self, reqs: list[Request], chunks: list[list[int]]) -> torch.Tensor:
        """Feed each request its chunk of prompt tokens (continuing from its slot's state when part of
        its prompt is already in) in one packed call; returns the chunks' last-token logits [B, V].
        From a CUDA graph when the batch fits one (``GraphedPrefill``), else eagerly; either way the
        metadata go down from the host's own lists (no device-to-host read)."""
        slots = [r.slot for r in reqs]
        flags = [r.prefilled > 0 for r in reqs]
        seed = self._rand_seed(advance=True)
        lengths = [len(c) for c in chunks]
        self.stats["prefill_tokens"] += sum(lengths)
        plan, entries = self.scheduler.plan_snapshots(reqs, chunks)
        try:
            logits = self._run_packed(reqs, chunks, slots, flags, seed, lengths, plan)
        except BaseException:
            for e in entries:  # never written: forget them
                self.prefix.drop(e)
            raise
        if self._paged:  # the snapshots' K/V: the first positions of their slots' pages, written now
            for e, b in zip(entries, plan.seq if plan is not None else ()):
                self.prefix.copy_kv_in(e, self.cache, slots[b])
        return logits

    def _run_packed(self, reqs, chunks, slots, flags, seed, lengths, plan) -> torch.Tensor:
        """The packed prefill call: chunks back to back (T tokens), from a graph when one fits."""
        if self.prefiller is not None and self.prefiller.fits(lengths, 0 if plan is None else len(plan.seq)):
            return self.prefiller.prefill(chunks, slots, flags, snapshots=plan)
        cu = list(itertools.accumulate(lengths, initial=0))
        T = cu[-1]
        # one host-to-device copy: the chunks back to back, cu_seqlens, slots, flags
        packed = torch.tensor([t for c in chunks for t in c] + cu + slots + [int(f) for f in flags], dtype=torch.int64)
        packed = packed.to(self.device)
        n = len(reqs)
        has_initial = (packed[T + n + 1 + n:] != 0) if any(flags) else False  # all fresh: no slot is read
        return self.model.prefill_varlen(packed[:T], packed[T:T + n + 1], self.cache,
                                         packed[T + n + 1:T + 2 * n + 1].to(torch.int32), has_initial_state=has_initial,
                                         rand_seed=seed, cu_seqlens_host=cu, slots_host=slots,
                                         **({} if plan is None else {"snapshots": plan}))

    def _prefill(self, admitted: list[Request]) -> list[StepOutput]:
        """Whole prompts of freshly admitted requests in one call, then their first tokens."""
        chunks = [r.prompt[r.prefilled:] for r in admitted]
        logits = self._run_prefill(admitted, chunks)
        for r in admitted:
            r.prefilled = len(r.prompt)
        self.scheduler.start_running(admitted)
        out = self._emit_first(admitted, logits)
        if self.speculate:  # (a drafter that drafts from hidden states: every prompt position's)
            self.spec.observe_prefill(admitted, [len(c) for c in chunks], list(range(len(admitted))))
        return out

    def _prefill_chunk(self, reqs: list[Request], chunks: list[list[int]]) -> list[StepOutput]:
        """Feed the planned chunks; requests whose prompt is now complete emit their first token and
        decode from the next step on, the others keep their slot and continue next step."""
        logits = self._run_prefill(reqs, chunks)
        done = []
        for i, (r, c) in enumerate(zip(reqs, chunks)):
            r.prefilled += len(c)
            if r.prefilled == len(r.prompt):
                done.append(i)
        if not done:
            if self.speculate:  # (an MTP drafter runs its layer over the chunk's positions)
                self.spec.observe_prefill(reqs, [len(c) for c in chunks], [])
            # wait for the chunk now: the running requests' tokens of this step then come out after
            # one decode and one chunk, never after two chunks (without it, the chunk runs on into the
            # next step, and the step that completes a prompt waited for the chunk before and its own:
            # H100, 2.7b, 512-token chunks next to 8 decodes, 21.3 ms against 12.8 for the others)
            if logits.is_cuda:
                torch.cuda.current_stream(logits.device).synchronize()
            return []
        complete = [reqs[i] for i in done]
        self.scheduler.start_running(complete)
        rows = logits if len(done) == len(reqs) else logits[torch.tensor(done, device=logits.device)]
        out = self._emit_first(complete, rows)
        if self.speculate:
            self.spec.observe_prefill(reqs, [len(c) for c in chunks], done)
        return out

    # ------------------------------------------------------------------ the step

    def step(self) -> list[StepOutput]:
        """One engine step; returns one ``StepOutput`` per emitted token (finished requests' last
        ones carry the ``Request``).

        Without ``prefill_chunk``: admit waiting requests if any (their whole prompts in one packed
        prefill, then their first tokens), else decode one token for every running request. With
        it: decode every running request, then feed one prefill chunk of at most ``prefill_chunk``
        prompt tokens (partly fed prompts first), so a long prompt never stalls the running ones.
        When a part fails, its requests are finished with finish_reason "error" and their slots
        freed, then the exception propagates; the engine stays usable.
        """
        s = self.scheduler
        if self.prefill_chunk is None:
            n = s.admissible()
            if n:
                admitted = s.admit(n)
                return self._guarded(admitted, "prefill", lambda: self._prefill(admitted))
            if not s.running:
                return []
            return self._guarded(list(s.running), *self._decode_part())
        out = []
        if s.running:
            out += self._guarded(list(s.running), *self._decode_part())
        if s.prefilling or s.waiting:
            reqs, chunks = s.plan_chunk()
            if reqs:
                out += self._guarded(reqs, "prefill chunk", lambda: self._prefill_chunk(reqs, chunks))
            elif self._paged and not out and s.prefilling and not s.running:
                self._evict()  # partly fed prompts hold every page and none can go on
        return out

    def _decode_part(self):
        return ("verify step", self._verify_step) if self.speculate else ("decode step", self._decode_step)

    def _guarded(self, reqs: list[Request], what: str, run) -> list[StepOutput]:
        try:
            return run()
        except BaseException as exc:  # KeyboardInterrupt included: the bookkeeping, then the exception as it was
            self._fail(reqs, exc, what)
            raise

    def _decode_ready(self, ntok: int = 1, grow: bool = True) -> list[Request]:
        """The scheduler's requests that advance this step (``Scheduler.decode_ready``), failing
        the newest holder of pages while none can."""
        s = self.scheduler
        ready = s.decode_ready(ntok, grow)
        while not ready and s.running:
            self._evict()
            ready = s.decode_ready(ntok, grow)
        return ready

    def _decode_step(self) -> list[StepOutput]:
        reqs = self._decode_ready()
        if not reqs:
            return []
        tokens = torch.tensor([r.output[-1] for r in reqs], dtype=torch.int64, device=self.device)
        slots = torch.tensor([r.slot for r in reqs], dtype=torch.int32, device=self.device)
        seed = self._rand_seed(advance=True)  # the graphs read the advanced seeds at replay
        if self.decoder is not None:
            logits = self.decoder.decode(tokens, slots)
        else:
            logits = self.model.decode(tokens, self.cache, slots, rand_seed=seed, grow=False)
        return self._emit(reqs, logits)

    def _verify_step(self) -> list[StepOutput]:
        """One speculative step for every running request (``Speculator.step``: draft, verify,
        accept, commit), then its tokens emitted; with a policy, k drafts (0: a plain step) as it
        chooses for the batch, and the step timed for it."""
        reqs = self._decode_ready(self.speculate + 1, grow=False)
        if not reqs:
            return []
        policy = self.spec.policy
        if policy is None:
            return self._verify_reqs(reqs, self.speculate)
        k = policy.choose(len(reqs))
        t0, before = time.perf_counter(), (self.stats["drafts_proposed"], self.stats["drafts_accepted"])
        out = self._verify_reqs(reqs, k)
        policy.record(len(reqs), k, time.perf_counter() - t0, self.stats["drafts_proposed"] - before[0],
                      self.stats["drafts_accepted"] - before[1])
        self.stats["policy"] = policy.report()
        return out

    def _verify_reqs(self, reqs: list[Request], k: int) -> list[StepOutput]:
        v = self.spec.step(reqs, k, self.sampler)
        out = self._emit(reqs, v.logits) if v.runs is None else self._emit_runs(reqs, v.runs, v.logits)
        self.spec.observe(reqs, v.consumed, v.ntok)
        return out

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] = SamplingParams()) -> list[list[int]]:
        """Run every prompt to completion; returns the generated ids in prompt order.

        Every request is checked before any is queued. Requests queued earlier (``add_request``)
        run alongside and stay collectable in ``finished``. If a step fails, this call's other
        requests are aborted and the exception propagates; a request failed on its own (a hybrid's
        exhausted KV pool) raises its ``Request.error`` once the others are done.
        """
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"Engine.generate: {len(prompts)} prompts but {len(plist)} SamplingParams")
        for i, sp in enumerate(plist):  # before queueing anything
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"Engine.generate: params[{i}] must be a SamplingParams, got {type(sp).__name__}")
            if sp.stop and self.tokenizer is None:
                raise ValueError(f"Engine.generate: params[{i}] has stop strings {list(sp.stop)!r}, which need a "
                                 "tokenizer; build the engine with Engine(model, tokenizer=...)")
        V = self.model.cfg.vocab_size
        checked = [prompt_ids(p, V, f"Engine.generate: prompts[{i}]: ") for i, p in enumerate(prompts)]
        for i, (ids, sp) in enumerate(zip(checked, plist)):
            self.scheduler.check_fits(ids, sp, f"Engine.generate: prompts[{i}]: ")
        rids = [self.add_validated_request(p, sp) for p, sp in zip(checked, plist)]  # checked above: not again
        mine, done = set(rids), {}
        try:
            while len(done) < len(rids) and self.has_unfinished():
                for out in self.step():
                    if out.finished and out.rid in mine:
                        done[out.rid] = out.request
                        self.finished.pop(out.rid, None)
        except BaseException:
            for rid in mine.difference(done):
                self.abort(rid)
                self.finished.pop(rid, None)
            raise
        for rid in mine.difference(done):  # finished without a step output (aborted meanwhile)
            done[rid] = self.finished.pop(rid)
        failed = [done[rid] for rid in rids if done[rid].finish_reason == "error"]
        if failed:  # a request failed without its step failing (a hybrid's KV pool ran out): not a result
            raise failed[0].error
        return [done[rid].output for rid in rids]
