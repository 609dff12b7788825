"""``EngineConfig``: every option of ``Engine``, its default and its check, in one place.

``Engine(model, **options)`` builds one (``Engine(model, config=EngineConfig(...))`` passes it
whole). A bad option is refused when the config is made, before the engine allocates anything:
the error names the option, what was expected and what came. The few checks that need the model
(does it have paged K/V, a verify step, which chunk size) are ``check_model``, which the engine
calls first thing.
"""
from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Mapping

import torch

from fastmamba.generation.drafters import Drafter
from fastmamba.generation.requests import Detokenizer, int_token
from fastmamba.generation.spec_policy import SpeculationPolicy
from fastmamba.models.quantization import KV_CACHE_DTYPES

VERIFY_PATHS = ("auto", "replay", "legacy")
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the option names of the cache's paged K/V (Engine option -> ``model.new_cache`` keyword)
KV_OPTIONS = {"max_seq_len": "max_seq_len", "kv_page_size": "page_size", "kv_num_pages": "num_pages",
              "kv_budget_bytes": "kv_budget_bytes"}


def _is_int(v: object, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _optional_int(name: str, v: object, low: int, what: str = "") -> None:
    if v is not None and not _is_int(v, low):
        raise ValueError(f"Engine: {name} must be None or an int >= {low}{what}, got {v!r}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The options of an ``Engine`` (all checked when the config is made; see the module docstring).

    max_batch     requests decoded together (and slots in the state cache)
    cuda_graphs   replay decode (and verify) steps from CUDA graphs (GPU only; default: on when on a GPU)
    ssm_dtype     SSM state dtype (bf16/fp16 halve the state traffic); None (default): the
                  checkpoint's ``mamba_ssm_cache_dtype``, else fp32 (``Engine.ssm_dtype_source`` says which)
    kv_cache_dtype  K/V page dtype: None (default): the model's setting (float8_e4m3fn for a checkpoint
                  that ships k_scale / v_scale, else the model's dtype); "auto", "fp8" (scale 1.0
                  without checkpoint scales), "bf16" / "fp16" / "fp32" (the model's dtype):
                  ``fastmamba.models.quantization.set_kv_cache_dtype`` (``Engine.kv_cache_note`` says which)
    pdl           programmatic dependent launch inside the graphs (Hopper+); None (default): on
                  where the GPU has it
    stochastic_rounding  with a 16-bit ``ssm_dtype``: every kernel that stores a state (prefill
                  scan, decode step, verify steps) rounds it stochastically, from per-layer device
                  seeds (``fastmamba.generation.rounding``) advanced in place before every step
                  (graph-safe); False (default): round to nearest. With an fp32 state: ValueError
    rounding_seed the stochastic rounding's seed (int in [0, 2**31)): the same seed and the same
                  requests give the same states

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
                  nearest measured one (``spec_policy.lookup_table``); ``Engine.verify_table_entry``
                  says which (None when a mapping was given, or with no file and no speculation)
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
                  in prefill's layout. ``Engine.prefix_stats`` counts lookups, hits and tokens served.
                  Hybrid models (paged K/V): each snapshot keeps the K/V of its tokens as well, in
                  pages of the prefix cache's own (half of ``prefix_cache_bytes``), copied out of the
                  request's pages after the prefill that took it, and back into fresh pages of a
                  request that hits it.
    prefix_block  the snapshot interval (tokens); a multiple of the model's ``chunk_size``; None:
                  the multiple of it nearest 512. A prompt whose prefill resumes off that grid (after
                  a hit on a finished request's snapshot) gets no block snapshots in that call.
    gpu_memory_utilization  None (default): the caches are sized as above. F in (0, 1]: plan them
                  (``fastmamba.generation.capacity.plan_capacity``) against F x the CUDA device's memory
                  (or ``FASTMAMBA_DEVICE_MEMORY_GIB``) less the weights, a reserve and the prefix cache:
                  a ``max_batch`` whose slots do not fit is a CapacityError (a ValueError naming the
                  numbers), and the K/V pool, unless ``kv_num_pages`` / ``kv_budget_bytes`` say, gets
                  the plan's pages (requests wait for pages rather than run out); ``Engine.capacity`` holds it
    """

    max_batch: int = 64
    cuda_graphs: bool | None = None
    ssm_dtype: torch.dtype | None = None
    kv_cache_dtype: str | None = None
    pdl: bool | None = None
    stochastic_rounding: bool = False
    rounding_seed: int = 0
    speculate: int | None = None
    drafter: Drafter | str | None = None
    spec_policy: SpeculationPolicy | str | None = None
    verify_path: str = "auto"
    verify_table: Mapping[int | str, int | None] | str | os.PathLike | None = None
    legacy_max_batch: int | None = None
    tokenizer: Detokenizer | None = None
    max_finished: int | None = None
    prefill_chunk: int | None = None
    graph_prefill_tokens: int | None = 2048
    max_seq_len: int | None = None
    kv_page_size: int | None = None
    kv_num_pages: int | None = None
    kv_budget_bytes: int | None = None
    prefix_cache_bytes: int | None = None
    prefix_cache_entries: int | None = None
    prefix_block: int | None = None
    gpu_memory_utilization: float | None = None

    def __post_init__(self) -> None:
        max_batch = self.max_batch
        if not isinstance(max_batch, numbers.Integral) or isinstance(max_batch, bool):
            raise TypeError(f"Engine: max_batch must be an int >= 1 (requests decoded together), got "
                            f"{type(max_batch).__name__} {max_batch!r}")
        if max_batch < 1:
            raise ValueError(f"Engine: max_batch must be an int >= 1 (requests decoded together), got {max_batch}")
        object.__setattr__(self, "max_batch", int(max_batch))  # a numpy int becomes a Python one
        for name in ("cuda_graphs", "pdl"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise TypeError(f"Engine: {name} must be None or a bool, got {type(v).__name__} {v!r}")
        if self.ssm_dtype is not None and self.ssm_dtype not in STATE_DTYPES:
            raise TypeError(f"Engine: ssm_dtype must be torch.float32, torch.bfloat16 or torch.float16, "
                            f"got {self.ssm_dtype!r} (or None: the checkpoint's mamba_ssm_cache_dtype)")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"Engine: kv_cache_dtype must be None or one of {KV_CACHE_DTYPES}, got "
                             f"{self.kv_cache_dtype!r}")
        _optional_int("prefill_chunk", self.prefill_chunk, 1, " (tokens per step)")
        _optional_int("graph_prefill_tokens", self.graph_prefill_tokens, 16)
        if not isinstance(self.stochastic_rounding, bool):
            raise TypeError(f"Engine: stochastic_rounding must be a bool, got {self.stochastic_rounding!r}")
        # (ssm_dtype None: checked once the engine has read the checkpoint's, ``Engine.__init__``)
        if self.stochastic_rounding and self.ssm_dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError(f"Engine: stochastic_rounding=True rounds 16-bit SSM states; it needs ssm_dtype="
                             f"torch.float16 or torch.bfloat16, got ssm_dtype={self.ssm_dtype} (fp32 states are "
                             "stored exactly)")
        if self.stochastic_rounding and not (_is_int(self.rounding_seed, 0) and self.rounding_seed < 2**31):
            raise ValueError(f"Engine: rounding_seed must be an int in [0, 2**31), got {self.rounding_seed!r}")
        if self.tokenizer is not None and not callable(getattr(self.tokenizer, "decode", None)):
            raise TypeError(f"Engine: tokenizer must have a decode(ids) -> str method, got "
                            f"{type(self.tokenizer).__name__}")
        _optional_int("max_finished", self.max_finished, 0)
        self._check_speculation()
        if self.gpu_memory_utilization is not None:
            from fastmamba.generation.capacity import check_utilization

            check_utilization(self.gpu_memory_utilization)
        for name in KV_OPTIONS:
            _optional_int(name, getattr(self, name), 1)
        for name in ("prefix_cache_bytes", "prefix_cache_entries"):
            _optional_int(name, getattr(self, name), 0)

    def _check_speculation(self) -> None:
        _optional_int("speculate", self.speculate, 0, " (number of drafts K)")
        K = self.speculate or 0
        if self.drafter is not None and not K:
            raise ValueError("Engine: a drafter needs speculate=K with K >= 1")
        if isinstance(self.drafter, str) and self.drafter != "mtp":
            raise ValueError(f"Engine: drafter expected a Drafter object or 'mtp', got {self.drafter!r}")
        if self.verify_path not in VERIFY_PATHS:
            raise ValueError(f"Engine: verify_path expected one of {VERIFY_PATHS}, got {self.verify_path!r}")
        if not (self.verify_table is None or isinstance(self.verify_table, (Mapping, str, os.PathLike))):
            raise TypeError(f"Engine: verify_table expected a mapping T -> crossover batch, a table file's path or "
                            f"None, got {type(self.verify_table).__name__}")
        _optional_int("legacy_max_batch", self.legacy_max_batch, 1)
        if (self.verify_path == "legacy" and self.legacy_max_batch is not None
                and self.legacy_max_batch < self.max_batch):
            raise ValueError(f"Engine: verify_path='legacy' runs every batch up to max_batch={self.max_batch} on the "
                             f"legacy path, but legacy_max_batch={self.legacy_max_batch}; use verify_path='auto' to "
                             "fall back to replay above it")
        policy = self.spec_policy
        if policy is not None and not ((policy == "adaptive" or isinstance(policy, SpeculationPolicy)) and K):
            raise ValueError(f"Engine: spec_policy expected None, 'adaptive' or a SpeculationPolicy (with "
                             f"speculate=K), got {policy!r}")

    @property
    def finished_kept(self) -> int:
        """``max_finished``, its default resolved."""
        return max(1024, 4 * self.max_batch) if self.max_finished is None else self.max_finished

    def kv_options(self) -> dict[str, int]:
        """The paged-KV options that were set, as ``model.new_cache`` keywords."""
        return {key: getattr(self, name) for name, key in KV_OPTIONS.items() if getattr(self, name) is not None}

    def cache_plan(self, model) -> tuple[object, dict[str, int]]:
        """``gpu_memory_utilization``'s plan (``capacity.CapacityPlan``; None without it) and the
        ``model.new_cache`` K/V keywords: the options set, and the plan's pages when neither
        ``kv_num_pages`` nor ``kv_budget_bytes`` says."""
        kv = self.kv_options()
        if self.gpu_memory_utilization is None:
            return None, kv
        from fastmamba.generation.capacity import engine_plan

        plan = engine_plan(model, gpu_memory_utilization=self.gpu_memory_utilization, max_batch=self.max_batch,
                           max_seq_len=self.max_seq_len, page_size=self.kv_page_size, ssm_dtype=self.ssm_dtype,
                           speculate=self.speculate or 0, prefill_tokens=self.prefill_chunk,
                           other_bytes=self.prefix_cache_bytes or 0,
                           drafter=self.drafter if isinstance(self.drafter, str) else None)
        if plan.page_bytes and self.kv_num_pages is None and self.kv_budget_bytes is None:
            kv["num_pages"] = plan.kv_pages
        return plan, kv

    def check_model(self, model) -> tuple[int, ...]:
        """The checks that need the model, before anything is built; returns its end-of-sequence ids
        (``model.cfg.eos_token_ids``: an int, ints, or None / absent for none)."""
        eos = getattr(model.cfg, "eos_token_ids", None)
        eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        if not all(int_token(t) is not None for t in eos):
            raise ValueError(f"Engine: model.cfg.eos_token_ids must be ints, got {eos!r}")
        if self.speculate and not callable(getattr(model, "verify", None)):
            raise ValueError(f"Engine: speculate={self.speculate} needs a model with speculative verify / commit; "
                             f"{type(model).__name__} has none yet (use speculate=None)")
        given = [name for name in KV_OPTIONS if getattr(self, name) is not None]
        if given and not model.cfg.paged_cache:
            raise ValueError(f"Engine: {', '.join(given)} configure a paged KV cache (models with attention "
                             f"layers); {type(model).__name__} has none")
        chunk, block = model.cfg.chunk_size, self.prefix_block
        if block is not None and not (_is_int(block, chunk) and block % chunk == 0):
            raise ValueError(f"Engine: prefix_block must be a positive multiple of the model's chunk_size {chunk} "
                             f"(snapshots come from the chunked scan's per-chunk states), got {block!r}")
        return tuple(int(t) for t in eos)
