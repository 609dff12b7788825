"""Continuous batching: requests join and leave between steps, each with its own slot and sampling.

One ``step()`` either admits waiting requests (prefill, then their first token) or advances every
running request by one token (decode: one CUDA-graph replay on a GPU). Finished requests free
their slot at once, so a waiting request can take it at the next step.

All requests admitted in one step are prefilled together, whatever their prompt lengths: one
packed call (``Mamba2LM.prefill_varlen``) over their prompts laid back to back.

Intake, stopping, finished requests:
  * ``add_request`` checks the prompt (Python ints or an integer tensor, ids in [0, V)) and the
    ``SamplingParams`` before anything is queued; a refused request leaves no trace.
  * A request stops after the token that meets its first stop condition (``Request.finish_reason``):
    "eos" (one of the model's end-of-sequence ids, ``model.cfg.eos_token_ids``, unless
    ``params.ignore_eos``), "stop" (one of ``params.stop_token_ids``, or the decoded output now
    contains one of ``params.stop`` strings: needs ``tokenizer``), "length" (``max_new_tokens``).
    The token that stopped it is kept in the output. Its slot is freed at once.
  * Each finished request is handed out once: the ``StepOutput`` that carries its last token has
    ``finished=True``, its ``finish_reason`` and the ``Request`` itself. The engine also keeps it in
    ``finished`` (by id) until collected (``pop_finished``, or ``finished.pop(rid)``), but only the
    newest ``max_finished`` uncollected ones: a caller that reads the step outputs and never
    collects does not make the engine grow.
  * An exception inside a step (the model, the sampler, the drafter) fails the requests of that
    step: each is finished with finish_reason "error" (``Request.error`` holds the exception; it
    is kept in ``finished`` like any finished request) and its slot freed; then the exception
    propagates unchanged (on Python >= 3.11 with a note naming the failed requests). Other
    requests stay queued and later steps run as usual.

Hybrid models (``NemotronHLM``: Mamba-2, attention and MLP layers) run through the same calls;
their cache (``HybridCache``) adds paged K/V for the attention layers, which the engine manages in
a few ``_kv_*`` helpers (no-ops for a pure Mamba-2 model):
  * ``add_request`` refuses a request whose prompt plus ``max_new_tokens`` can never fit one
    request's KV (``max_seq_len``, or the whole pool if smaller);
  * a request is admitted (and a prefill chunk sized) only while free pages hold its tokens,
    keeping one free page per running request in reserve;
  * a decode step grows each request's KV by one token on the host before the model (or its CUDA
    graph) runs; a request whose next token needs a page when none is free waits (state and
    pages untouched) while the others advance. If no request can advance at all, the newest one
    holding pages is finished with finish_reason "error" (``Request.error``: a RuntimeError
    naming the exhausted pool; it gets no StepOutput, like an aborted one) and its pages freed.
Speculative decoding: a verify step grows each request's KV by its T inputs, the commit shortens
it to the accepted ones (``HybridCache.rollback``). A graphed prefill grows the pages on the host
before its replay (``GraphedPrefill``), as the eager one does in the model.

Speculative decoding (``speculate=K``): a decode step asks the drafter for K tokens per running
request and verifies them in one call (``Mamba2LM.verify``, T = K+1 inputs per request: the last
emitted token, then the drafts). Greedy acceptance keeps the longest prefix of drafts that equal
the argmax at the positions before them; the request emits those n drafts plus the argmax after
them (the bonus token), so 1..K+1 tokens per step, exactly the tokens plain greedy decoding emits.
Requests that sample (temperature > 0) use speculative (rejection) sampling instead
(``Sampler.speculative_sample``): with p_i the request's sampling distribution at position i,
draft d_{i+1} is accepted with probability p_i(d_{i+1}); at the first rejection the emitted token
is drawn from p_i without d_{i+1} (renormalised), and after K acceptances from p_K, so the tokens
are distributed as plain sampling from the target model (drafters propose point masses, q = 1).
The state is then committed over the n+1 inputs consumed (``Mamba2LM.commit``), and the bonus
token is the next step's first input. A request that meets a stop condition inside an accepted
run stops there: the rest of the run is dropped.

A drafter may propose fewer than K tokens for a request (none at all included): its row is padded
to K (repeating its last draft, or its last token) and its run is cut after its real drafts (any
prefix of an accepted run is a valid run). When no request of the step has a draft, the step is a
plain one (one input per request, ``path="plain"``). Otherwise the verify path is chosen per step
(``verify_path="auto"``: ``spec_policy.choose_verify_path`` with the batch, T and the crossover
table ``verify_table``): "replay" (replay-based rollback, large batches) or "legacy" (a state per
position, then a copy of the accepted one; small batches). A slot whose last step was a replay
step has its replay history flushed into its state before a legacy or plain step. ``stats``
counts steps per path and drafts proposed / accepted. With CUDA graphs (the default on a GPU) the
verify steps replay from graphs per (path, batch bucket) (``GraphedVerifier``).
"""
from __future__ import annotations

import dataclasses
import itertools
import numbers
import os
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence, Set
from typing import Protocol

import torch

from fastmamba.cache.prefix_cache import PrefixCache, SnapshotPlan
from fastmamba.generation.drafters import Drafter, NgramDrafter
from fastmamba.generation.rounding import StochasticRounding
from fastmamba.generation.sampling import Sampler, SamplingParams, finish_reason
from fastmamba.generation.spec_policy import SpeculationPolicy, TableEntry, choose_verify_path, lookup_table
from fastmamba.models.mamba2_lm import Mamba2LM

VERIFY_PATHS = ("auto", "replay", "legacy")
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


def _int_token(t: object) -> int | None:
    """``t`` as a Python int when it is an integer token id (int, numpy integer, 0-d integer tensor), else None."""
    if isinstance(t, numbers.Integral) and not isinstance(t, bool):
        return int(t)
    if isinstance(t, torch.Tensor) and t.dim() == 0 and not (t.is_floating_point() or t.is_complex()
                                                               or t.dtype == torch.bool):
        return int(t)
    return None


class Engine:
    """Generation over a ``Mamba2LM`` or a hybrid ``NemotronHLM`` with continuous batching.

    max_batch     requests decoded together (and slots in the state cache)
    cuda_graphs   replay decode (and verify) steps from CUDA graphs (GPU only; default: on when on a GPU)
    ssm_dtype     SSM state dtype (fp32 default; bf16/fp16 halve the state traffic)
    stochastic_rounding  with a 16-bit ``ssm_dtype``: every kernel that stores a state (prefill
                  scan, decode step, verify steps) rounds it stochastically, from per-layer device
                  seeds (``fastmamba.generation.rounding``) advanced in place before every step
                  (graph-safe); False (default): round to nearest. With an fp32 state: ValueError
    rounding_seed the stochastic rounding's seed (int in [0, 2**31)): the same seed and the same
                  requests give the same states
    pdl           programmatic dependent launch inside the graphs (Hopper+); None (default): on
                  where the GPU has it
    speculate     K >= 1: speculative decoding, verifying K drafts per request per step (greedy
                  acceptance at temperature 0, rejection sampling above); None or 0: plain decoding
    drafter       proposes the drafts (``fastmamba.generation.drafters``); default NgramDrafter();
                  "mtp": the model's own multi-token-prediction layer (``fastmamba.generation.mtp_drafter``;
                  a Nemotron-3 checkpoint with ``num_nextn_predict_layers: 1``), handed the target's
                  hidden states after every step; prefill then runs eagerly (its graphs do not keep
                  them), verify steps and the MTP's own steps from CUDA graphs where the engine has them
    spec_policy   None: K drafts every step; "adaptive" (the default with drafter "mtp") or a
                  ``spec_policy.SpeculationPolicy``: per step k in 0..K drafts (0: a plain step) as
                  the policy weighs the measured step cost against the acceptance seen so far;
                  ``stats["policy"]`` reports its last choice and the count of each k
    verify_path   "auto" (default): replay or legacy per step from ``verify_table``; "replay" or
                  "legacy": always that path (steps with no drafts at all are plain steps either way)
    verify_table  T -> crossover batch (replay from that batch up), as ``fastmamba bench spec``
                  reports it; or the path of a table file (``bench spec --write-table PATH``); None:
                  the package's table file. From a file, the entry for the model's shape (heads,
                  head dim, state size) and state dtype, measured on this GPU where it can, or the
                  nearest measured one (``spec_policy.lookup_table``); ``verify_table_entry`` says
                  which (None when a mapping was given, or with no file and no speculation)
    legacy_max_batch  the largest batch the legacy path may take (its per-position states cost
                  n_layer x batch x T states of memory); None: the largest batch that ``verify_path``
                  and the table send to legacy (max_batch when forced). "auto" uses replay above it.
    tokenizer     anything with ``decode(ids) -> str`` (``fastmamba.generation.tokenizer.load_tokenizer``);
                  needed only by requests with ``stop`` strings
    max_finished  finished requests kept in ``finished`` until collected (the oldest uncollected
                  ones are dropped beyond it; each was handed out in its last ``StepOutput``);
                  None: max(1024, 4 * max_batch)

    prefill_chunk prompt tokens fed per step (chunked prefill): every step decodes the running
                  requests and then feeds at most this many prompt tokens (partly fed prompts first,
                  each continuing from its slot's state), so a long prompt never stalls the running
                  ones; None (default): a step admits whole prompts or decodes, never both
    graph_prefill_tokens  on a GPU with CUDA graphs, packed prefills of up to this many tokens
                  (more when ``prefill_chunk`` needs it) replay from ``GraphedPrefill``'s graphs,
                  prefix-cache snapshots included (hybrid models too); None: prefill always
                  runs eagerly

    Paged KV (models with attention layers, ``NemotronHLM``; a ValueError for others):
    max_seq_len   the most tokens one request holds (prompt + generated - 1); None: the model's
                  default (4096)
    kv_page_size  tokens per KV page (a power of two); None: 16
    kv_num_pages  pages in the KV pool, or ``kv_budget_bytes``: as many as that many bytes hold;
                  neither: enough for max_batch requests at max_seq_len (the pool never runs out)

    prefix_cache_bytes / prefix_cache_entries  prefix caching of states (off when both are None):
                  a ``PrefixCache`` of that many bytes / snapshots. A new request starts from the
                  longest cached prefix of its prompt and prefills only the rest. Snapshots are
                  taken (1) while prompts are prefilled, at every multiple of ``prefix_block``
                  tokens short of the prompt's end, from the chunked scan's per-chunk states (no
                  second pass; a prefill that takes one runs eagerly, not from a graph), and (2) when a
                  request finishes (eos / stop / length), of its prompt and output but the last token
                  (what its state holds), so the next turn of a conversation continues where this
                  one ended. With speculation (2) is skipped: a verified slot's conv history is not
                  in prefill's layout. ``prefix_stats`` counts lookups, hits and tokens served.
                  Hybrid models (paged K/V): each snapshot keeps the K/V of its tokens as well, in
                  pages of the prefix cache's own (half of ``prefix_cache_bytes``), copied out of the
                  request's pages after the prefill that took it, and back into fresh pages of a
                  request that hits it.
    gpu_memory_utilization  None (default): the caches are sized as above. F in (0, 1]: plan them
                  (``fastmamba.generation.capacity.plan_capacity``) against F x the CUDA device's memory
                  (or ``FASTMAMBA_DEVICE_MEMORY_GIB``) less the weights, a reserve and the prefix cache:
                  a ``max_batch`` whose slots do not fit is a CapacityError (a ValueError naming the
                  numbers), and the K/V pool, unless ``kv_num_pages`` / ``kv_budget_bytes`` say, gets
                  the plan's pages (requests wait for pages rather than run out); ``capacity`` holds it
    prefix_block  the snapshot interval (tokens); a multiple of the model's ``chunk_size``; None:
                  the multiple of it nearest 512. A prompt whose prefill resumes off that grid (after
                  a hit on a finished request's snapshot) gets no block snapshots in that call.

    ``stats["prefill_tokens"]`` counts the prompt tokens actually run through prefill (a prefix-cache
    hit's tokens are not).

    End-of-sequence ids come from ``model.cfg.eos_token_ids`` (a tuple of ints; empty or absent:
    none, only the request's own stop conditions apply); ``eos_token_ids`` holds them.

    ``stats``: {"steps": {"replay": n, "legacy": n, "plain": n}, "drafts_proposed": n,
    "drafts_accepted": n} over the engine's verify steps (a draft is accepted when it is emitted).
    """

    def __init__(self, model: Mamba2LM, *, max_batch: int = 64, cuda_graphs: bool | None = None,
                 ssm_dtype: torch.dtype = torch.float32, pdl: bool | None = None, speculate: int | None = None,
                 drafter: Drafter | None = None, verify_path: str = "auto",
                 verify_table: Mapping[int | str, int | None] | str | os.PathLike | None = None,
                 legacy_max_batch: int | None = None, stochastic_rounding: bool = False, rounding_seed: int = 0,
                 tokenizer: Detokenizer | None = None, max_finished: int | None = None,
                 prefill_chunk: int | None = None, graph_prefill_tokens: int | None = 2048,
                 max_seq_len: int | None = None, kv_page_size: int | None = None, kv_num_pages: int | None = None,
                 kv_budget_bytes: int | None = None, prefix_cache_bytes: int | None = None,
                 prefix_cache_entries: int | None = None, prefix_block: int | None = None,
                 spec_policy: SpeculationPolicy | str | None = None, gpu_memory_utilization: float | None = None):
        if not isinstance(max_batch, numbers.Integral) or isinstance(max_batch, bool):
            raise TypeError(f"Engine: max_batch must be an int >= 1 (requests decoded together), got "
                            f"{type(max_batch).__name__} {max_batch!r}")
        if max_batch < 1:
            raise ValueError(f"Engine: max_batch must be an int >= 1 (requests decoded together), got {max_batch}")
        max_batch = int(max_batch)
        if prefill_chunk is not None and not (isinstance(prefill_chunk, int) and not isinstance(prefill_chunk, bool)
                                              and prefill_chunk >= 1):
            raise ValueError(f"Engine: prefill_chunk must be None or an int >= 1 (tokens per step), got {prefill_chunk!r}")
        if graph_prefill_tokens is not None and not (isinstance(graph_prefill_tokens, int)
                                                     and graph_prefill_tokens >= 16):
            raise ValueError(f"Engine: graph_prefill_tokens must be None or an int >= 16, got {graph_prefill_tokens!r}")
        self.prefill_chunk = prefill_chunk
        if not isinstance(stochastic_rounding, bool):
            raise TypeError(f"Engine: stochastic_rounding must be a bool, got {stochastic_rounding!r}")
        if stochastic_rounding and ssm_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"Engine: stochastic_rounding=True rounds 16-bit SSM states; it needs ssm_dtype="
                             f"torch.float16 or torch.bfloat16, got ssm_dtype={ssm_dtype} (fp32 states are stored "
                             "exactly)")
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"Engine: tokenizer must have a decode(ids) -> str method, got {type(tokenizer).__name__}")
        if max_finished is None:
            max_finished = max(1024, 4 * max_batch)
        if not (isinstance(max_finished, int) and not isinstance(max_finished, bool) and max_finished >= 0):
            raise ValueError(f"Engine: max_finished must be None or an int >= 0, got {max_finished!r}")
        eos = getattr(model.cfg, "eos_token_ids", None)
        eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        if not all(_int_token(t) is not None for t in eos):
            raise ValueError(f"Engine: model.cfg.eos_token_ids must be ints, got {eos!r}")
        self.eos_token_ids: tuple[int, ...] = tuple(int(t) for t in eos)
        self.tokenizer = tokenizer
        self.max_finished = max_finished
        if speculate is not None and not (isinstance(speculate, int) and speculate >= 0):
            raise ValueError(f"Engine: speculate must be None or an int >= 0 (number of drafts K), got {speculate!r}")
        self.speculate = speculate or 0
        if drafter is not None and not self.speculate:
            raise ValueError("Engine: a drafter needs speculate=K with K >= 1")
        if verify_path not in VERIFY_PATHS:
            raise ValueError(f"Engine: verify_path expected one of {VERIFY_PATHS}, got {verify_path!r}")
        if legacy_max_batch is not None and not (isinstance(legacy_max_batch, int) and legacy_max_batch >= 1):
            raise ValueError(f"Engine: legacy_max_batch must be None or an int >= 1, got {legacy_max_batch!r}")
        if verify_path == "legacy" and legacy_max_batch is not None and legacy_max_batch < max_batch:
            raise ValueError(f"Engine: verify_path='legacy' runs every batch up to max_batch={max_batch} on the legacy "
                             f"path, but legacy_max_batch={legacy_max_batch}; use verify_path='auto' to fall back "
                             "to replay above it")
        if self.speculate and not callable(getattr(model, "verify", None)):
            raise ValueError(f"Engine: speculate={self.speculate} needs a model with speculative verify / commit; "
                             f"{type(model).__name__} has none yet (use speculate=None)")
        self.capacity = None  # gpu_memory_utilization's plan (fastmamba.generation.capacity.CapacityPlan)
        if gpu_memory_utilization is not None:
            from fastmamba.generation.capacity import engine_plan

            self.capacity = engine_plan(model, gpu_memory_utilization=gpu_memory_utilization, max_batch=max_batch,
                                        max_seq_len=max_seq_len, page_size=kv_page_size, ssm_dtype=ssm_dtype,
                                        speculate=self.speculate, prefill_tokens=prefill_chunk,
                                        other_bytes=prefix_cache_bytes or 0,
                                        drafter=drafter if isinstance(drafter, str) else None)
            if self.capacity.page_bytes and kv_num_pages is None and kv_budget_bytes is None:
                kv_num_pages = self.capacity.kv_pages
        kv_options = self._kv_options(model, max_seq_len=max_seq_len, page_size=kv_page_size,
                                      num_pages=kv_num_pages, kv_budget_bytes=kv_budget_bytes)
        if isinstance(drafter, str):  # drafter="mtp": the checkpoint's MTP layer (fastmamba.generation.mtp_drafter)
            if drafter != "mtp":
                raise ValueError(f"Engine: drafter expected a Drafter object or 'mtp', got {drafter!r}")
            from fastmamba.generation.mtp_drafter import MTPDrafter

            on_gpu = model.lm_head.weight.device.type == "cuda"
            drafter = MTPDrafter(model, max_batch, max_seq_len=(max_seq_len or 4096) + self.speculate,
                                 cuda_graphs=on_gpu and cuda_graphs is not False)
        # a drafter that drafts from the target's hidden states (MTP): prefill runs eagerly (its graphs
        # do not keep them); each verify graph's hidden buffer is remembered (``_verify``)
        self._hidden_of: dict | None = None
        if getattr(drafter, "needs_hidden", False):
            graph_prefill_tokens = None
            self._hidden_of = {}
            spec_policy = "adaptive" if spec_policy is None else spec_policy
        self.drafter = (drafter or NgramDrafter()) if self.speculate else None
        # speculation per step: K drafts always (None), or as the policy weighs cost and acceptance
        if spec_policy == "adaptive":
            spec_policy = SpeculationPolicy(self.speculate)
        if spec_policy is not None and not (isinstance(spec_policy, SpeculationPolicy) and self.speculate):
            raise ValueError(f"Engine: spec_policy expected None, 'adaptive' or a SpeculationPolicy (with "
                             f"speculate=K), got {spec_policy!r}")
        self.policy = spec_policy
        self.verify_table_entry: TableEntry | None = None
        if isinstance(verify_table, (str, os.PathLike)) or (verify_table is None and self.speculate):
            # the measured entry for the model's shape and state dtype (or the nearest), this GPU's first
            state = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(ssm_dtype, "fp32")
            weight = model.lm_head.weight
            gpu = torch.cuda.get_device_name(weight.device) if weight.device.type == "cuda" else None
            shape = getattr(model.cfg, "mamba", model.cfg)  # a hybrid's Mamba layers
            self.verify_table_entry = lookup_table(shape.nheads, shape.headdim, shape.d_state, state,
                                                   device_name=gpu, path=verify_table)
            verify_table = self.verify_table_entry.table
        self.verify_path, self.verify_table = verify_path, verify_table
        self.model = model
        self.device = model.lm_head.weight.device
        self.max_batch = max_batch
        self.cache = model.new_cache(max_batch, ssm_dtype=ssm_dtype, speculate=self.speculate, **kv_options)
        # a paged KV cache (hybrid models): the engine grows it on the host before each decode or
        # verify step and shrinks it after a commit, so the model (or its graph) must do neither
        self._paged = self.cache.paged
        self._no_grow = {"grow": False} if self._paged else {}
        self._no_rollback = {"rollback": False} if self._paged else {}
        self.rounding = StochasticRounding(model.cfg.n_layer, self.device, rounding_seed) if stochastic_rounding else None
        self.sampler = Sampler(model.cfg.vocab_size, self.device, max_batch)
        self.stats = {"steps": {"replay": 0, "legacy": 0, "plain": 0}, "drafts_proposed": 0, "drafts_accepted": 0,
                      "prefill_tokens": 0}
        self.prefix, self.prefix_block = self._make_prefix_cache(prefix_cache_bytes, prefix_cache_entries,
                                                                 prefix_block)
        self._replay_slots: set[int] = set()  # slots whose SSM state lags their replay history
        self._seen: torch.Tensor | None = None  # [max_batch, V] bool: tokens of a slot's prompt + output, made
        # at the first request with a repetition penalty or min_tokens (``_mark_seen``)
        self.legacy_max_batch = 0
        if self.speculate:
            if legacy_max_batch is None:
                legacy_max_batch = max((b for b in range(1, max_batch + 1) if self._table_path(b) == "legacy"), default=0)
            self.legacy_max_batch = min(legacy_max_batch, max_batch)
            if self.legacy_max_batch:
                self.cache.reserve_legacy(self.legacy_max_batch)
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        self.decoder = self.verifier = None
        if cuda_graphs:
            from fastmamba.generation.cuda_graphs import GraphedDecoder, GraphedVerifier

            if self.speculate:
                self.verifier = GraphedVerifier(model, self.cache, max_batch, pdl=pdl, rand_seed=self._rand_seed())
            else:
                self.decoder = GraphedDecoder(model, self.cache, max_batch, pdl=pdl, rand_seed=self._rand_seed())
        self.prefiller = None
        if cuda_graphs and graph_prefill_tokens:
            from fastmamba.generation.prefill_graphs import GraphedPrefill

            # room for a whole chunk of prefill_chunk tokens plus the padding requests' tokens
            cap = max(graph_prefill_tokens, (prefill_chunk or 0) + max_batch + 1)
            self.prefiller = GraphedPrefill(model, self.cache, max_tokens=cap, max_requests=max_batch,
                                            pdl=pdl, rand_seed=self._rand_seed())
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # holding a slot, prompt partly fed (chunked prefill)
        self.running: list[Request] = []
        self.finished: OrderedDict[int, Request] = OrderedDict()  # uncollected, oldest first
        self._ids = itertools.count()

    def _make_prefix_cache(self, budget: int | None, entries: int | None,
                           block: int | None) -> tuple[PrefixCache | None, int]:
        chunk = self.model.cfg.chunk_size
        if block is None:
            block = max(chunk, round(512 / chunk) * chunk)
        if not (isinstance(block, int) and not isinstance(block, bool) and block >= chunk and block % chunk == 0):
            raise ValueError(f"Engine: prefix_block must be a positive multiple of the model's chunk_size {chunk} "
                             f"(snapshots come from the chunked scan's per-chunk states), got {block!r}")
        for name, v in (("prefix_cache_bytes", budget), ("prefix_cache_entries", entries)):
            if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                raise ValueError(f"Engine: {name} must be None or an int >= 0, got {v!r}")
        if not budget and not entries:
            return None, block
        state_len = self.cache.conv[0].shape[-1]
        if chunk < state_len:
            raise ValueError(f"Engine: prefix caching needs the model's chunk_size ({chunk}) to be at least the conv "
                             f"state's length ({state_len} columns)")
        return PrefixCache(self.cache, max_entries=entries or None, budget_bytes=budget or None), block

    @property
    def prefix_stats(self) -> dict[str, int] | None:
        """The prefix cache's counters (lookups, hits, prompt_tokens, hit_tokens, saves, evictions), or None."""
        return None if self.prefix is None else dict(self.prefix.stats)

    @property
    def graph_captures(self) -> dict[str, float]:
        """CUDA graphs captured so far (decode, verify and prefill) and the host seconds the captures
        took: {"count": n, "seconds": s}. Graphs are captured at a bucket's first use."""
        owners = [o for o in (self.decoder, self.verifier, self.prefiller) if o is not None]
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
        if not isinstance(params, SamplingParams):
            raise TypeError(f"Engine.add_request: params must be a SamplingParams, got {type(params).__name__}")
        self._check_stop_strings(params)
        ids = self._prompt_ids(prompt, "Engine.add_request: ")
        return self.add_validated_request(ids, params)

    def _check_stop_strings(self, params: SamplingParams) -> None:
        if params.stop and self.tokenizer is None:
            raise ValueError(f"Engine.add_request: stop strings {list(params.stop)!r} need a tokenizer to decode the "
                             "output; build the engine with Engine(model, tokenizer=...)")

    def add_validated_request(self, ids: list[int], params: SamplingParams) -> int:
        """``add_request`` for a prompt its caller has already checked: a list of Python ints in
        [0, V), which the engine keeps (not copied). The server's engine process takes this path:
        the HTTP side validated the request, and the 2k-token prompt's second check cost ~0.1 ms of
        a prefix-cache hit's time to first token. The KV-page fit is still checked here."""
        if type(ids) is not list or not ids:
            raise TypeError(f"Engine.add_validated_request: ids must be a non-empty list of ints, got "
                            f"{type(ids).__name__}{' (empty)' if isinstance(ids, list) else ''}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"Engine.add_validated_request: params must be a SamplingParams, got {type(params).__name__}")
        self._check_stop_strings(params)
        if params.penalised and self.speculate:
            raise ValueError("Engine.add_request: min_tokens and repetition_penalty are not supported with "
                             f"speculative decoding (this engine has speculate={self.speculate})")
        self._kv_check_fits(ids, params, "Engine.add_request: ")
        req = Request(next(self._ids), ids, params)
        self.waiting.append(req)
        return req.rid

    def _rand_seed(self, advance: bool = False) -> torch.Tensor | None:
        """The stochastic-rounding seeds (None: round to nearest); ``advance``: first move them on
        (in place, before a step that stores states)."""
        if self.rounding is None:
            return None
        if advance:
            self.rounding.advance()
        return self.rounding.seeds

    def _prompt_ids(self, prompt: object, who: str) -> list[int]:
        """The prompt as a list of Python ints in [0, V), or TypeError / ValueError starting with ``who``."""
        V = self.model.cfg.vocab_size
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
                v = _int_token(t)
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

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

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
        for r in itertools.chain(self.waiting, self.prefilling, self.running):
            if r.rid == rid:
                self._finish(r, "abort")
                self.waiting = deque(w for w in self.waiting if w is not r)
                self.prefilling = [x for x in self.prefilling if x is not r]
                self.running = [x for x in self.running if x is not r]
                return True
        return False

    def _finish(self, r: Request, reason: str, stop_reason: int | str | None = None,
                error: BaseException | None = None) -> None:
        """Mark ``r`` finished, free its slot, keep it in ``finished`` (the oldest beyond max_finished go)."""
        r.finished, r.finish_reason, r.stop_reason, r.error = True, reason, stop_reason, error
        if callable(getattr(self.drafter, "forget", None)):  # a drafter holding per-request state (MTP pages)
            self.drafter.forget(r)
        if (self.prefix is not None and r.slot >= 0 and reason in ("eos", "stop", "length") and not self.speculate
                and r.prefilled == len(r.prompt) and r.output):
            # the slot holds the state after the prompt and every output token but the last (not yet fed)
            self.prefix.save(r.prompt + r.output[:-1], self.cache, r.slot)
        if r.slot >= 0:
            slot, r.slot = r.slot, -1
            self._replay_slots.discard(slot)
            self.cache.free([slot])
        self.finished[r.rid] = r
        while len(self.finished) > self.max_finished:
            self.finished.popitem(last=False)

    def _stop(self, r: Request, token: int) -> tuple[str | None, int | str | None]:
        """(finish reason, stop reason) after ``token``, just appended to ``r.output``; (None, None): go on."""
        reason = finish_reason(token, len(r.output), r.params, self.eos_token_ids)
        if reason in ("eos", "stop"):
            return reason, token
        if r.params.stop and len(r.output) >= r.params.min_tokens:  # the whole output: a stop string may span tokens
            text = self.tokenizer.decode(r.output)
            for s in r.params.stop:
                if s in text:
                    return "stop", s
        return reason, None

    def _emit(self, reqs: list[Request], logits: torch.Tensor) -> list[StepOutput]:
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

    def _mark_seen(self, r: Request) -> None:
        """Start ``r``'s row of the seen-token table (repetition penalty) from its prompt."""
        if self._seen is None:
            self._seen = torch.zeros(self.max_batch, self.model.cfg.vocab_size, dtype=torch.bool, device=self.device)
        self._seen[r.slot] = False
        self._seen[r.slot, torch.tensor(r.prompt, dtype=torch.int64, device=self.device)] = True

    @staticmethod
    def _logprobs(reqs: list[Request], runs: list[list[int]], logits: torch.Tensor | None):
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

    def _emit_runs(self, reqs: list[Request], runs: list[list[int]],
                   logits: torch.Tensor | None = None) -> list[StepOutput]:
        """Append each request's run of tokens, stopping (and freeing its slot) at a stop condition.
        ``logits`` [B, T, V]: the scores of each run's positions (for requests that want logprobs)."""
        lps = self._logprobs(reqs, runs, logits)
        out = []
        for i, (r, run) in enumerate(zip(reqs, runs)):
            for j, t in enumerate(run):
                r.output.append(t)
                lp, top = lps.get((i, j), (None, None))
                reason, why = self._stop(r, t)
                if reason is not None:
                    self._finish(r, reason, why)
                    out.append(StepOutput(r.rid, t, True, reason, r, lp, top))
                    break
                out.append(StepOutput(r.rid, t, False, logprob=lp, top_logprobs=top))
        self.running = [r for r in self.running if not r.finished]
        return out

    def _fail(self, reqs: list[Request], exc: BaseException, what: str) -> None:
        """Finish the step's unfinished requests with finish_reason "error", free their slots, and
        note on ``exc`` which requests failed."""
        failed = [r for r in reqs if not r.finished]
        for r in failed:
            self._finish(r, "error", error=exc)
        self.running = [r for r in self.running if not r.finished]
        self.prefilling = [r for r in self.prefilling if not r.finished]
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(f"Engine.step: the {what} failed; requests {[r.rid for r in failed]} are finished with "
                         "finish_reason 'error' (see Engine.finished) and their slots freed; the engine keeps serving")

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
        plan, entries = self._plan_snapshots(reqs, chunks)
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

    def _plan_snapshots(self, reqs: list[Request], chunks: list[list[int]]) -> tuple[SnapshotPlan | None, list]:
        """The prefix-cache snapshots this prefill call takes: for each request, the absolute
        positions that are multiples of ``prefix_block`` inside its chunk and before the prompt's
        end (the state after the whole prompt is kept when the request finishes, with its output),
        on the scan's chunk grid of this call, not cached yet (each claims a pool row; rows claimed in this call are never
        evicted by a later claim of the same call)."""
        if self.prefix is None:
            return None, []
        chunk, block = self.model.cfg.chunk_size, self.prefix_block
        seq, ends, rows, entries = [], [], [], []
        for b, (r, c) in enumerate(zip(reqs, chunks)):
            start = r.prefilled
            for q in range((start // block + 1) * block, min(start + len(c), len(r.prompt) - 1) + 1, block):
                if (q - start) % chunk:
                    continue  # off this call's chunk grid: no per-chunk state there
                protect = {e.index for e in entries}
                entry = self.prefix.claim(r.prompt[:q], protect=protect)
                if entry is not None and self._paged and not self.prefix.claim_pages(entry, protect):
                    self.prefix.drop(entry)  # a hybrid's snapshot keeps its K/V too: no pages, no snapshot
                    entry = None
                if entry is not None:
                    seq.append(b)
                    ends.append(q - start)
                    rows.append(entry.index)
                    entries.append(entry)
        if not entries:
            return None, []
        return SnapshotPlan(tuple(seq), tuple(ends), tuple(rows), self.prefix.conv, self.prefix.ssm), entries

    def _run_packed(self, reqs, chunks, slots, flags, seed, lengths, plan) -> torch.Tensor:
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

    def _admit(self, n: int) -> list[Request]:
        """Move ``n`` waiting requests to fresh slots (one take: one zeroing pass, no host read)."""
        admitted = [self.waiting.popleft() for _ in range(n)]
        if self.prefix is None:
            slots = self.cache.take(n)
        else:  # start from the longest cached prefix: prefill only the rest (a restored slot needs no zeroing)
            entries = [self.prefix.match(req.prompt) for req in admitted]
            slots = self.cache.take(n, zero=[e is None for e in entries])
            for req, slot, entry in zip(admitted, slots, entries):
                if entry is not None:
                    self.prefix.restore(entry, self.cache, slot)
                    req.prefilled = req.cached_tokens = entry.length
        for req, slot in zip(admitted, slots):
            req.slot = slot
            self._replay_slots.discard(slot)  # prefill leaves nothing to replay
            if req.params.penalised:
                self._mark_seen(req)
        return admitted

    def _prefill(self, admitted: list[Request]) -> list[StepOutput]:
        """Whole prompts of freshly admitted requests in one call, then their first tokens."""
        logits = self._run_prefill(admitted, [r.prompt[r.prefilled:] for r in admitted])
        for r in admitted:
            r.prefilled = len(r.prompt)
        self.running.extend(admitted)
        out = self._emit(admitted, logits)
        self._observe(admitted, [1] * len(admitted))
        return out

    def _plan_chunk(self) -> tuple[list[Request], list[list[int]]]:
        """This step's prefill chunk: the partly fed prompts first, then new requests (each admitted
        to a fresh slot) while the ``prefill_chunk`` token budget and the batch's room last."""
        budget = self.prefill_chunk
        pages = self._kv_free_pages()
        reqs, chunks = [], []
        for r in self.prefilling:
            if budget <= 0:
                break
            take, pages = self._kv_take(r.slot, min(len(r.prompt) - r.prefilled, budget), pages)
            if not take:
                continue
            reqs.append(r)
            chunks.append(r.prompt[r.prefilled:r.prefilled + take])
            budget -= take
        room = min(self.max_batch - len(self.running) - len(self.prefilling), self.cache.free_slots)
        pages = self._kv_reserve(pages)  # new requests leave a page per running request free
        while budget > 0 and room > 0 and self.waiting:
            prompt = self.waiting[0].prompt
            # a hybrid's prefix-cache hit restores its prefix's K/V into pages of its own: count them
            hit = self.prefix.peek(prompt) if self._paged and self.prefix is not None else 0
            total, pages = self._kv_take(None, hit + min(len(prompt) - hit, budget), pages)
            take = total - hit
            if take <= 0:
                break
            r = self._admit(1)[0]
            take = min(take, len(r.prompt) - r.prefilled)  # a prefix-cache hit leaves fewer to feed
            self.prefilling.append(r)
            reqs.append(r)
            chunks.append(r.prompt[r.prefilled:r.prefilled + take])
            budget -= take
            room -= 1
        return reqs, chunks

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
            # wait for the chunk now: the running requests' tokens of this step then come out after
            # one decode and one chunk, never after two chunks (without it, the chunk runs on into the
            # next step, and the step that completes a prompt waited for the chunk before and its own:
            # H100, 2.7b, 512-token chunks next to 8 decodes, 21.3 ms against 12.8 for the others)
            if logits.is_cuda:
                torch.cuda.current_stream(logits.device).synchronize()
            return []
        complete = [reqs[i] for i in done]
        self.prefilling = [r for r in self.prefilling if r.prefilled < len(r.prompt)]
        self.running.extend(complete)
        rows = logits if len(done) == len(reqs) else logits[torch.tensor(done, device=logits.device)]
        out = self._emit(complete, rows)
        if self._hidden_of is not None:
            self.drafter.observe(complete, self.model.last_hidden[done], [1] * len(complete))
        return out

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
        if self.prefill_chunk is None:
            if self.waiting and len(self.running) < self.max_batch and self.cache.free_slots:
                n = min(len(self.waiting), self.max_batch - len(self.running), self.cache.free_slots)
                n = self._kv_admissible(n)
                if n:
                    admitted = self._admit(n)
                    return self._guarded(admitted, "prefill", lambda: self._prefill(admitted))
            if not self.running:
                return []
            return self._guarded(list(self.running), *self._decode_part())
        out = []
        if self.running:
            out += self._guarded(list(self.running), *self._decode_part())
        if self.prefilling or self.waiting:
            reqs, chunks = self._plan_chunk()
            if reqs:
                out += self._guarded(reqs, "prefill chunk", lambda: self._prefill_chunk(reqs, chunks))
            elif self._paged and not out and self.prefilling and not self.running:
                self._kv_evict()  # partly fed prompts hold every page and none can go on
        return out

    def _decode_part(self):
        return ("verify step", self._verify_step) if self.speculate else ("decode step", self._decode_step)

    def _guarded(self, reqs: list[Request], what: str, run) -> list[StepOutput]:
        try:
            return run()
        except BaseException as exc:  # KeyboardInterrupt included: the bookkeeping, then the exception as it was
            self._fail(reqs, exc, what)
            raise

    def _decode_step(self) -> list[StepOutput]:
        reqs = self._kv_decode_ready()
        if not reqs:
            return []
        tokens = torch.tensor([r.output[-1] for r in reqs], dtype=torch.int64, device=self.device)
        slots = torch.tensor([r.slot for r in reqs], dtype=torch.int32, device=self.device)
        seed = self._rand_seed(advance=True)  # the graphs read the advanced seeds at replay
        if self.decoder is not None:
            logits = self.decoder.decode(tokens, slots)
        else:
            logits = self.model.decode(tokens, self.cache, slots, rand_seed=seed, **self._no_grow)
        return self._emit(reqs, logits)

    def _table_path(self, batch: int) -> str:
        """``verify_path`` when forced, else the table's choice for ``batch`` requests with drafts."""
        if self.verify_path != "auto":
            return self.verify_path
        return choose_verify_path(batch, self.speculate + 1, self.verify_table)

    def _choose_path(self, batch: int) -> str:
        """The verify path of a step of ``batch`` requests with drafts: ``_table_path``, but
        replay where "auto" would exceed ``legacy_max_batch``."""
        path = self._table_path(batch)
        return "replay" if path == "legacy" and batch > self.legacy_max_batch else path

    def _observe(self, reqs: list[Request], counts: list[int], ntok: int = 1) -> None:
        """Hand a drafter that drafts from the target's hidden states (MTP) those of the positions
        each request consumed in the call just run (``model.last_hidden``: its first B*ntok rows, [B*T, M]
        after a verify of T tokens per request, [B, M] after a prefill or plain step; a graph's bucket
        may hold pad rows after them)."""
        if self._hidden_of is not None and reqs:
            hidden = self.model.last_hidden[:len(reqs) * ntok].view(len(reqs), ntok, self.model.cfg.d_model)
            self.drafter.observe(reqs, hidden, counts)

    def _drafts(self, reqs: list[Request], k: int | None = None) -> list[list[int]]:
        """The drafter's proposals, checked: 0..k token ids in [0, V) per request (k: default K)."""
        K, V = self.speculate if k is None else k, self.model.cfg.vocab_size
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

    def _verify(self, tokens: torch.Tensor, slots: torch.Tensor, path: str) -> torch.Tensor:
        seed = self._rand_seed(advance=True)
        if self.verifier is not None:
            if self._hidden_of is None:
                return self.verifier.verify(tokens, slots, path)
            captures = self.verifier.captured.count
            logits = self.verifier.verify(tokens, slots, path)
            # the hidden states a graph writes live in its own buffer, the one ``model.last_hidden``
            # pointed to when it was captured: remember it per (path, bucket), point to it after a replay
            key = (path, next(b for b in self.verifier.buckets(path) if b >= tokens.shape[0]))
            if self.verifier.captured.count != captures:
                self._hidden_of[key] = self.model.last_hidden
            self.model.last_hidden = self._hidden_of[key]
            return logits
        return self.model.verify(tokens, self.cache, slots, path=path, rand_seed=seed, **self._no_grow)

    def _commit(self, reqs: list[Request], slots: torch.Tensor, consumed: list[int], path: str) -> None:
        accepted = torch.tensor(consumed, dtype=torch.int32, device=self.device)
        if self.verifier is not None:
            self.verifier.commit(slots, accepted, path)
        else:
            self.model.commit(self.cache, slots, accepted, path=path, **self._no_rollback)
        ids = [r.slot for r in reqs]
        if self._paged:  # the rejected drafts' K/V go (the pages past each request's new length too)
            ntok = 1 if path == "plain" else self.speculate + 1
            self.cache.rollback(ids, [ntok - c for c in consumed])
        if path == "replay":
            self._replay_slots.update(ids)
        else:
            self._replay_slots.difference_update(ids)

    def _verify_step(self) -> list[StepOutput]:
        """One speculative step for every running request: draft, verify, accept, commit, emit;
        with a policy, k drafts (0: a plain step) as it chooses for the batch, and the step timed for it."""
        reqs = self._kv_decode_ready(self.speculate + 1, grow=False)
        if not reqs:
            return []
        if self.policy is None:
            return self._verify_reqs(reqs, self.speculate)
        k = self.policy.choose(len(reqs))
        t0, before = time.perf_counter(), (self.stats["drafts_proposed"], self.stats["drafts_accepted"])
        out = self._verify_reqs(reqs, k)
        self.policy.record(len(reqs), k, time.perf_counter() - t0, self.stats["drafts_proposed"] - before[0],
                           self.stats["drafts_accepted"] - before[1])
        self.stats["policy"] = self.policy.report()
        return out

    def _verify_reqs(self, reqs: list[Request], k: int) -> list[StepOutput]:
        K = self.speculate
        drafts = self._drafts(reqs, k) if k else [[] for _ in reqs]
        real = [len(d) for d in drafts]
        path = self._choose_path(len(reqs)) if any(real) else "plain"
        if self._paged:  # room for this step's tokens: 1 (plain) or K+1 (verify), shortened at the commit
            self.cache.grow([r.slot for r in reqs], [1 if path == "plain" else K + 1] * len(reqs))
        self.stats["steps"][path] += 1
        slots = torch.tensor([r.slot for r in reqs], dtype=torch.int32, device=self.device)
        if path != "replay":  # legacy and plain read the SSM state: materialise pending replay histories
            lagging = [r.slot for r in reqs if r.slot in self._replay_slots]
            if lagging:
                self.cache.flush(torch.tensor(lagging, dtype=torch.int32, device=self.device))
        if path == "plain":
            tokens = torch.tensor([[r.output[-1]] for r in reqs], dtype=torch.int64, device=self.device)
            logits = self._verify(tokens, slots, path)[:, 0]
            self._commit(reqs, slots, [1] * len(reqs), path)
            out = self._emit(reqs, logits)
            self._observe(reqs, [1] * len(reqs))
            return out

        inputs = [[r.output[-1]] + d + [(d or [r.output[-1]])[-1]] * (K - len(d)) for r, d in zip(reqs, drafts)]
        tokens = torch.tensor(inputs, dtype=torch.int64, device=self.device)
        logits = self._verify(tokens, slots, path)  # [B, T, V']
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
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
            # padding drafts are not drafts: cut the run after the real ones (a prefix of a valid
            # run is valid: each emitted token follows the target given the tokens before it)
            n = min(n, real[i])
            run = run[:n + 1]
            r.accepted.append(n)
            runs.append(run)
            consumed.append(n + 1)
        self.stats["drafts_proposed"] += sum(real)
        self.stats["drafts_accepted"] += sum(len(run) - 1 for run in runs)
        # commit before emitting: a request finishing in this step frees its slot, which a new
        # request may then take (its prefill resets the slot's speculation counters anyway)
        self._commit(reqs, slots, consumed, path)
        out = self._emit_runs(reqs, runs, logits)
        self._observe(reqs, consumed, K + 1)
        return out

    # ------------------------------------------------------------------ paged KV (hybrid models)
    # A model with attention layers keeps its K/V in pages (``HybridCache``); these helpers are all
    # the engine knows of them. With a ``StateCache`` (no ``grow``) each one is a no-op.

    @staticmethod
    def _kv_options(model, **given) -> dict:
        """The cache's KV options that were set (checked); ValueError when the model has no paged KV."""
        names = {"max_seq_len": "max_seq_len", "page_size": "kv_page_size", "num_pages": "kv_num_pages",
                 "kv_budget_bytes": "kv_budget_bytes"}
        given = {k: v for k, v in given.items() if v is not None}
        for k, v in given.items():
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValueError(f"Engine: {names[k]} must be None or an int >= 1, got {v!r}")
        if given:
            missing = [] if model.cfg.paged_cache else [names[k] for k in given]
            if missing:
                raise ValueError(f"Engine: {', '.join(missing)} configure a paged KV cache (models with attention "
                                 f"layers); {type(model).__name__} has none")
        return given

    @property
    def max_request_tokens(self) -> int | None:
        """The most KV positions one request may use (a model with attention layers): its prompt
        plus max_new_tokens - 1 must not exceed it (verify steps hold the drafts too). None: no
        limit (a pure Mamba-2 model keeps a fixed-size state per request)."""
        limit = self.cache.max_len if self._paged else None
        return None if limit is None else limit - self.speculate

    def _kv_check_fits(self, ids: list[int], params: SamplingParams, who: str) -> None:
        """ValueError when the request can never fit one request's KV (its last token is never fed)."""
        limit = self.cache.max_len if self._paged else None
        need = len(ids) + params.max_new_tokens - 1 + self.speculate  # a verify step holds K drafts more
        if limit is not None and need > limit:
            kv = self.cache.kv
            raise ValueError(f"{who}the prompt ({len(ids)} tokens) with max_new_tokens={params.max_new_tokens} needs "
                             f"{need} KV positions, more than one request can hold: {limit} (max_seq_len="
                             f"{kv.max_len}, a pool of {kv.num_pages} pages of {kv.page_size} tokens); shorten the "
                             "prompt, lower max_new_tokens, or build the engine with a larger max_seq_len / KV pool")

    def _kv_free_pages(self) -> int | None:
        return self.cache.free_pages if self._paged else None

    def _kv_reserve(self, pages: int | None) -> int | None:
        """``pages`` less one per running request (their next decode steps' pages)."""
        return None if pages is None else pages - len(self.running)

    def _kv_take(self, slot: int | None, n: int, pages: int | None) -> tuple[int, int | None]:
        """How many of ``n`` new tokens ``slot`` (None: a request not yet admitted) can take with
        ``pages`` free pages, and the pages left after them."""
        if pages is None:
            return n, None
        n = min(n, self.cache.room(slot, max(pages, 0)))
        return n, pages - self.cache.pages_for(slot, n)

    def _kv_admissible(self, n: int) -> int:
        """How many of the first ``n`` waiting requests the free pages hold (whole prompts), with
        a page per running request kept in reserve."""
        pages = self._kv_reserve(self._kv_free_pages())
        if pages is None:
            return n
        k = 0
        for r in itertools.islice(self.waiting, n):
            need = self.cache.pages_for(None, len(r.prompt))
            if need > pages:
                break
            pages -= need
            k += 1
        return k

    def _kv_decode_ready(self, ntok: int = 1, grow: bool = True) -> list[Request]:
        """The running requests that advance this step (``grow``: each one's KV already grown by
        ``ntok`` tokens; a verify step reserves K+1). One whose tokens need a page when none is free
        waits; when none can advance, the newest request holding pages is failed to free them
        (``_kv_evict``)."""
        if not self._paged:
            return list(self.running)
        while self.running:
            pages = self._kv_free_pages()
            ready = []
            for r in self.running:
                need = self.cache.pages_for(r.slot, ntok)
                if pages is None or need <= pages:
                    ready.append(r)
                    pages = None if pages is None else pages - need
            if ready:
                if grow:
                    self.cache.grow([r.slot for r in ready], [ntok] * len(ready))
                return ready
            self._kv_evict()
        return []

    def _kv_evict(self) -> None:
        """Finish the newest request holding a slot with finish_reason "error" (its pages go back)."""
        victim = max(self.running + self.prefilling, key=lambda r: r.rid)
        kv = self.cache.kv
        exc = RuntimeError(f"Engine: the KV cache is out of pages ({kv.num_pages} pages of {kv.page_size} tokens) "
                           f"and no request can advance; request {victim.rid}, the newest, is finished with "
                           f"finish_reason 'error' to free its {len(kv.pages_of(victim.slot))} pages. Give the engine "
                           "more pages (kv_num_pages / kv_budget_bytes) or a smaller max_batch")
        self._finish(victim, "error", error=exc)
        self.running = [r for r in self.running if r is not victim]
        self.prefilling = [r for r in self.prefilling if r is not victim]

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
        checked = [self._prompt_ids(p, f"Engine.generate: prompts[{i}]: ") for i, p in enumerate(prompts)]
        for i, (ids, sp) in enumerate(zip(checked, plist)):
            self._kv_check_fits(ids, sp, f"Engine.generate: prompts[{i}]: ")
        rids = [self.add_request(p, sp) for p, sp in zip(checked, plist)]
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
