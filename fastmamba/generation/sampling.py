"""Per-request sampling for a batch of next-token logits, without host synchronisation.

Each request carries its own ``SamplingParams``; one ``Sampler.sample`` call draws one token for
every row of a ``[B, V]`` logits tensor:

    temperature < GREEDY_BELOW   argmax(logits)                  (top_k / top_p are ignored)
    otherwise          l = (logits - max(logits)) / temperature  (shifting by the row's max changes
                              nothing mathematically; it keeps l <= 0, so a tiny temperature gives
                              -inf for the other tokens, never inf - inf = NaN)
                       top-k: keep the k largest l (k = 0: all)  exactly k; ties broken by sort order
                       top-p: keep the smallest prefix of the top-k tokens, by descending probability
                              under softmax(top-k-masked l), whose probability sum reaches top_p;
                              the most probable token is always kept
                       token = argmax(softmax(masked l) / E),  E ~ Exp(1) iid per token

The last line is the exponential race (Gumbel-max in probability space): it draws from the
renormalised masked distribution with one elementwise divide and one argmax, so no
``torch.multinomial`` (which synchronises on CUDA) and no data-dependent shapes.

Randomness: a row whose params have a ``seed`` draws its ``[V]`` noise from a generator seeded with
``_mix_seed(seed, step)``, where ``step`` is the request's token index. Its token is therefore
reproducible and does not depend on the other rows of the batch or on its position in it (for a
given device type: CPU and CUDA generators produce different streams). Rows without a seed share
the sampler's own generator.

Host work per call is a loop over the B ``SamplingParams`` (and over seeded rows, to seed their
noise); per-row parameters reach the device through one pinned, non-blocking copy, cached while
the batch's params stay the same. Nothing in ``sample`` waits for the device.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["GREEDY_BELOW", "SamplingParams", "Sampler", "finish_reason", "speculative_accept", "stop_reached"]

# Temperatures below this (the smallest normal fp32, ~1.2e-38) sample greedily: the per-row
# temperature travels to the device as fp32, where a smaller one is subnormal or 0.
GREEDY_BELOW = float(torch.finfo(torch.float32).tiny)

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


MAX_LOGPROBS = 20  # the most alternatives a request may ask for per token
DEFAULT_MAX_NEW_TOKENS = 128


class _DefaultMax(int):
    """The default of ``max_new_tokens``: 128, marked so that ``__post_init__`` knows it was not given
    (then ``max_tokens``, vLLM's name, may set it)."""

    def __repr__(self) -> str:
        return f"{int(self)}"


_DEFAULT_MAX = _DefaultMax(DEFAULT_MAX_NEW_TOKENS)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops (immutable and hashable).

    temperature     finite, >= 0; 0 (or anything below ``GREEDY_BELOW``, ~1.2e-38) means greedy
                    (argmax), which ignores top_k, top_p and seed
    top_k           int >= 0; keep the k most likely tokens, 0 = off
    top_p           in (0, 1]; nucleus sampling over the top-k tokens, 1 = off
    seed            None: draw from the engine's generator; an int: the request's tokens are
                    reproducible (token t depends only on the logits, these params, seed and t)
    max_new_tokens  int >= 1; generation stops after this many tokens (finish reason "length")
    stop_token_ids  ints >= 0; generation stops after emitting any of these (finish reason "stop";
                    the stop token is kept in the output)
    stop            strings (one string is taken as a list of one); generation stops once the
                    decoded output contains any of them (finish reason "stop"). Needs an engine
                    with a tokenizer. The output keeps every token up to and including the one that
                    completed the match (so the text may run past the stop string by the rest of
                    that token)
    ignore_eos      False (default): generation stops at the model's end-of-sequence token(s)
                    (``model.cfg.eos_token_ids``; finish reason "eos", the token kept); True: run on
                    (benchmarks). ``stop_token_ids`` and ``stop`` apply either way
    logprobs        None (default): none; an int k in [0, MAX_LOGPROBS]: every emitted token comes with
                    its log-probability and the k most likely tokens' (``StepOutput.logprob``,
                    ``top_logprobs``), under the model's distribution (the logits' log-softmax, before
                    temperature, top-k and top-p)
    min_tokens      int in [0, max_new_tokens]: no stop condition but "length" applies before this
                    many tokens are out (the end-of-sequence and ``stop_token_ids`` tokens get
                    probability 0 until then; stop strings are not looked for), as in vLLM
    repetition_penalty  finite > 0, 1 = off: the logit of every token already in the prompt or the
                    output is divided by it when positive, multiplied by it when not (CTRL's rule,
                    as transformers and vLLM apply it), before temperature, top-k and top-p
    max_tokens      vLLM's name of ``max_new_tokens`` (either may be given; both only if equal)

    Raises ValueError naming the field and the value when a field has the wrong type or is out of range.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = _DEFAULT_MAX  # not given: max_tokens, else DEFAULT_MAX_NEW_TOKENS
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None  # after __post_init__: equal to max_new_tokens

    def __post_init__(self) -> None:
        n, alias = self.max_new_tokens, self.max_tokens
        given = n is not _DEFAULT_MAX
        if given and alias is not None and n != alias:
            raise ValueError(f"SamplingParams: max_tokens is another name of max_new_tokens; got both, and they "
                             f"differ ({alias!r} and {n!r})")
        object.__setattr__(self, "max_new_tokens", n if given or alias is None else alias)
        t = self.temperature
        if not (_is_real(t) and math.isfinite(t) and t >= 0):
            raise ValueError(f"SamplingParams: temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not (_is_int(self.top_k) and self.top_k >= 0):
            raise ValueError(f"SamplingParams: top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if not (_is_real(p) and 0 < p <= 1):
            raise ValueError(f"SamplingParams: top_p must be in (0, 1] (1 = off), got {p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"SamplingParams: seed must be None or an int, got {self.seed!r}")
        if not (_is_int(self.max_new_tokens) and self.max_new_tokens >= 1):
            raise ValueError(f"SamplingParams: max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not (_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_new_tokens):
            raise ValueError(f"SamplingParams: min_tokens must be an int in [0, max_new_tokens={self.max_new_tokens}], "
                             f"got {self.min_tokens!r}")
        rp = self.repetition_penalty
        if not (_is_real(rp) and math.isfinite(rp) and rp > 0):
            raise ValueError(f"SamplingParams: repetition_penalty must be a finite number > 0 (1 = off), got {rp!r}")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"SamplingParams: logprobs must be None or an int in [0, {MAX_LOGPROBS}], "
                             f"got {self.logprobs!r}")
        bad_stops = f"SamplingParams: stop_token_ids must be a sequence of ints >= 0, got {self.stop_token_ids!r}"
        try:
            stops = tuple(self.stop_token_ids)
        except TypeError:
            raise ValueError(bad_stops) from None
        if not all(_is_int(s) and s >= 0 for s in stops):
            raise ValueError(bad_stops)
        strings = (self.stop,) if isinstance(self.stop, str) else self.stop
        bad_strings = f"SamplingParams: stop must be a string or a sequence of non-empty strings, got {self.stop!r}"
        try:
            strings = tuple(strings)
        except TypeError:
            raise ValueError(bad_strings) from None
        if not all(isinstance(s, str) and s for s in strings):
            raise ValueError(bad_strings)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams: ignore_eos must be a bool, got {self.ignore_eos!r}")
        # normalise so that equal params hash equally (a list of stop ids would not hash at all)
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "seed", None if self.seed is None else int(self.seed))
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        object.__setattr__(self, "max_tokens", self.max_new_tokens)
        object.__setattr__(self, "min_tokens", int(self.min_tokens))
        object.__setattr__(self, "repetition_penalty", float(rp))
        object.__setattr__(self, "stop_token_ids", tuple(int(s) for s in stops))
        object.__setattr__(self, "stop", strings)

    @property
    def greedy(self) -> bool:
        """True when tokens are picked by argmax (temperature below ``GREEDY_BELOW``)."""
        return self.temperature < GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        """True when the logits are changed before sampling: a repetition penalty or a ``min_tokens``."""
        return self.repetition_penalty != 1.0 or self.min_tokens > 0


def finish_reason(token: int, produced: int, params: SamplingParams,
                  eos_token_ids: Sequence[int] = ()) -> str | None:
    """Host-side stop test on token ids, after the token has been copied to the host.

    token          the token just emitted (a Python int)
    produced       tokens generated for this request so far, ``token`` included
    eos_token_ids  the model's end-of-sequence tokens (ignored when ``params.ignore_eos``)
    Returns "eos" when ``token`` is an end-of-sequence token, "stop" when it is one of
    ``params.stop_token_ids``, "length" when ``produced >= params.max_new_tokens``, else None
    (the first that applies, in that order); before ``params.min_tokens`` tokens only "length".
    Stop strings need the decoded text: the engine checks them (``Engine``).
    """
    if produced < params.min_tokens:
        return "length" if produced >= params.max_new_tokens else None
    if not params.ignore_eos and token in eos_token_ids:
        return "eos"
    if token in params.stop_token_ids:
        return "stop"
    if produced >= params.max_new_tokens:
        return "length"
    return None


def stop_reached(token: int, produced: int, params: SamplingParams, eos_token_ids: Sequence[int] = ()) -> bool:
    """``finish_reason(...) is not None``: the request stops after ``token``."""
    return finish_reason(token, produced, params, eos_token_ids) is not None


def _mix_seed(seed: int, step: int) -> int:
    """Generator seed for token ``step`` of a request seeded with ``seed``: a 63-bit integer.

    ``seed * golden + step`` (mod 2**64) then the splitmix64 finaliser (a bijection), so for one
    seed every step gets a distinct, well-scrambled generator seed, and nearby seeds do not give
    overlapping streams the way ``seed + step`` would.
    """
    z = (seed * 0x9E3779B97F4A7C15 + step) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & _MASK63


def speculative_accept(probs: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor,
                       noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept/reject point-mass drafts (q(d) = 1) against target distributions: standard
    speculative sampling, so the emitted tokens are distributed as sampling from the target.

    probs  [B, K+1, V] fp32  target distribution p_i at each verify position (rows sum to 1)
    drafts [B, K] int64      d_1..d_K; draft d_{i+1} is judged by p_i
    u      [B, K] in [0, 1)  uniforms: d_{i+1} is accepted when u_i < p_i(d_{i+1})
    noise  [B, V] > 0        Exp(1) noise for the emitted token (exponential race)
    Returns (n [B] int64, token [B] int64): n = drafts accepted before the first rejection; token
    is drawn from the residual max(p_n - q, 0) (p_n without d_{n+1}, renormalised) when n < K,
    else from p_K (the bonus token).
    """
    B, T, V = probs.shape
    K = T - 1
    rows = torch.arange(B, device=probs.device)
    if K == 0:
        return torch.zeros(B, dtype=torch.int64, device=probs.device), (probs[:, 0] / noise).argmax(dim=-1)
    p_draft = probs[:, :K].gather(-1, drafts[..., None]).squeeze(-1)  # [B, K]
    n = (u < p_draft).to(torch.int64).cumprod(dim=-1).sum(dim=-1)    # accepted prefix length
    p_n = probs[rows, n]                                               # [B, V]
    d_n = drafts[rows, n.clamp(max=K - 1)]                             # the rejected draft (if n < K)
    drop = (torch.arange(V, device=probs.device)[None, :] == d_n[:, None]) & (n < K)[:, None]
    resid = p_n.masked_fill(drop, 0.0)
    # a draft can only be rejected if p_n(d) < 1, so the residual has mass; rounding (a one-hot
    # softmax summing to 1 - eps) could still leave none: then d itself is the only choice
    resid = torch.where(resid.sum(dim=-1, keepdim=True) > 0, resid, p_n)
    return n, (resid / noise).argmax(dim=-1)  # argmax(p / E): a draw from p renormalised


class _Plan(NamedTuple):
    """What one batch of params asks for: host-side decisions plus per-row device tensors."""

    all_greedy: bool
    any_greedy: bool
    any_unseeded: bool            # a sampled row without a seed (needs the shared generator)
    seeded_rows: tuple[int, ...]  # sampled rows with a seed, in batch order
    k_cand: int                   # candidate width for top-k/top-p (max k over filtered rows); 0: no row filters
    any_top_p: bool
    temperature: torch.Tensor | None  # [B] fp32; greedy rows hold 1.0 (their result is replaced)
    top_k: torch.Tensor | None        # [B] int64; effective k in [1, V] (V = off)
    top_p: torch.Tensor | None        # [B] fp32
    greedy: torch.Tensor | None       # [B] bool
    unfiltered: torch.Tensor | None   # [B] bool; rows that keep the whole vocabulary


class Sampler:
    """Draws one token per row of a logits batch; built once per engine.

    vocab_size  tokens that may be sampled; logits may carry more columns (vocabulary padding),
                which are never returned
    device      where logits live; the returned tokens and the generators live there too
    max_batch   largest B accepted by ``sample``
    seed        seed of the shared generator used by rows without their own seed
                (None: a non-deterministic seed)
    """

    def __init__(self, vocab_size: int, device: torch.device | str, max_batch: int, *, seed: int | None = None):
        if not (_is_int(vocab_size) and vocab_size >= 1):
            raise ValueError(f"Sampler: vocab_size must be an int >= 1, got {vocab_size!r}")
        if not (_is_int(max_batch) and max_batch >= 1):
            raise ValueError(f"Sampler: max_batch must be an int >= 1, got {max_batch!r}")
        if vocab_size >= 1 << 24:
            # per-row k travels as fp32 in the packed parameter copy: exact below 2**24
            raise ValueError(f"Sampler: vocab_size must be < 2**24, got {vocab_size}")
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.vocab_size = int(vocab_size)
        self.device = dev
        self.max_batch = int(max_batch)
        self._gen = torch.Generator(device=dev)
        if seed is None:
            self._gen.seed()
        else:
            self._gen.manual_seed(int(seed) & _MASK63)
        # re-seeded once per seeded row: on CUDA the seed and offset are read when the kernel is
        # launched, so one generator object serves every seeded row of a call in turn
        self._row_gen = torch.Generator(device=dev)
        self._cache: tuple[tuple[SamplingParams, ...], _Plan] | None = None

    # ------------------------------------------------------------------ public

    def sample_greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """argmax over the first ``vocab_size`` columns.

        logits  [B, V]  any float dtype, V >= vocab_size; read only
        Returns tokens [B] int64 on logits.device.
        """
        self._check_logits(logits, "sample_greedy")
        return logits[:, : self.vocab_size].argmax(dim=-1)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int]) -> torch.Tensor:
        """Draw one token per row, each row with its own temperature / top-k / top-p / seed.

        logits  [B, V]  fp32 (bf16/fp16 are upcast: one [B, vocab_size] fp32 copy), V >= vocab_size,
                        on the sampler's device; read only (a static CUDA-graph buffer is fine);
                        columns >= vocab_size are never sampled
        params  B SamplingParams, one per row
        steps   B ints: the token index of each row's request (0 for its first generated token);
                only rows with a seed use it
        Returns tokens [B] int64 on logits.device. Nothing waits for the device (the gpu-marked
        test runs this under ``torch.cuda.set_sync_debug_mode("error")``); see the module
        docstring for the definition of each mode.
        """
        B = self._check_logits(logits, "sample")
        if len(params) != B or len(steps) != B:
            raise ValueError(
                f"Sampler.sample: logits has B={B} rows but got {len(params)} params and {len(steps)} steps"
            )
        if B > self.max_batch:
            raise ValueError(f"Sampler.sample: B={B} rows exceed max_batch={self.max_batch}")
        if B == 0:
            return torch.empty(0, dtype=torch.int64, device=logits.device)
        plan = self._plan(params)
        if plan.all_greedy:
            return self.sample_greedy(logits)

        x = logits[:, : self.vocab_size].float()
        probs = self._masked_probs(x, plan)
        tokens = probs.div_(self._noise(B, params, steps, plan, x.device)).argmax(dim=-1)
        if plan.any_greedy:
            tokens = torch.where(plan.greedy, x.argmax(dim=-1), tokens)
        return tokens

    def penalise(self, logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int], *,
                 seen: torch.Tensor | None = None, eos_token_ids: Sequence[int] = ()) -> torch.Tensor:
        """The logits each row samples from after its repetition penalty and ``min_tokens`` ban.

        logits  [B, V]  any float dtype, V >= vocab_size; read only
        params  B SamplingParams; steps  B ints (each row's token index: 0 for its first token)
        seen    [B, >= vocab_size] bool: the tokens of each row's prompt and output so far (needed
                when a row has ``repetition_penalty != 1``; other rows' are not read)
        eos_token_ids  banned with the row's ``stop_token_ids`` while ``steps[b] < min_tokens``
                (unless ``ignore_eos``)
        Returns [B, vocab_size] fp32, a new tensor: a penalised row's seen logits divided by the
        penalty where > 0, multiplied where <= 0; a banned token's logit -inf. Rows without either
        are copied unchanged. Nothing waits for the device (the per-row values go down in one
        pinned, non-blocking copy).
        """
        B = self._check_logits(logits, "penalise")
        if len(params) != B or len(steps) != B:
            raise ValueError(f"Sampler.penalise: logits has B={B} rows but got {len(params)} params and "
                             f"{len(steps)} steps")
        V = self.vocab_size
        x = logits[:, :V].float().clone()
        penalty = [p.repetition_penalty for p in params]
        banned: list[tuple[int, int]] = []
        for b, (p, t) in enumerate(zip(params, steps)):
            if t < p.min_tokens:
                ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
                banned += [(b, i) for i in sorted(ids) if 0 <= i < V]
        any_penalty = any(v != 1.0 for v in penalty)
        if not any_penalty and not banned:
            return x
        if any_penalty and (seen is None or seen.shape[0] != B or seen.shape[-1] < V):
            raise ValueError("Sampler.penalise: a repetition penalty needs `seen` [B, >= vocab_size] bool")
        pin = self.device.type == "cuda"
        host = torch.tensor(penalty + [float(i) for pair in zip(*banned) for i in pair] if banned else penalty,
                            dtype=torch.float32, pin_memory=pin)
        dev = host.to(self.device, non_blocking=pin)
        if any_penalty:
            pen = dev[:B, None]
            hit = seen[:, :V]
            x = torch.where(hit, torch.where(x > 0, x / pen, x * pen), x)
        if banned:
            n = len(banned)
            rows, cols = dev[B:B + n].long(), dev[B + n:].long()
            x.index_put_((rows, cols), torch.full((), -math.inf, device=self.device))  # a fill: no copy
        return x

    def probs(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """The distribution each row's token is drawn from, after temperature / top-k / top-p.

        logits  [B, V] as for ``sample``; params  B SamplingParams, one per row
        Returns probs [B, vocab_size] fp32 on logits.device: ``softmax(masked logits / temperature)``
        with exact zeros outside the top-k / top-p set (the distribution ``sample`` draws from);
        greedy rows (temperature 0) are one-hot at their argmax. Nothing waits for the device.
        """
        B = self._check_logits(logits, "probs")
        if len(params) != B:
            raise ValueError(f"Sampler.probs: logits has B={B} rows but got {len(params)} params")
        V = self.vocab_size
        if B == 0:
            return torch.empty(0, V, dtype=torch.float32, device=logits.device)
        plan = self._plan(params)
        x = logits[:, :V].float()
        if plan.all_greedy:
            return torch.nn.functional.one_hot(x.argmax(dim=-1), V).float()
        probs = self._masked_probs(x, plan)
        if plan.any_greedy:
            one_hot = torch.nn.functional.one_hot(x.argmax(dim=-1), V).float()
            probs = torch.where(plan.greedy[:, None], one_hot, probs)
        return probs

    def speculative_sample(self, logits: torch.Tensor, drafts: torch.Tensor, params: Sequence[SamplingParams],
                           steps: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Speculative (rejection) sampling of point-mass drafts against the target model.

        logits  [B, K+1, V] the target's logits at the K+1 verify positions (V >= vocab_size)
        drafts  [B, K] int64 the drafted tokens (position i's logits predict draft i)
        params  B SamplingParams; steps  B ints, each request's token index at the verify step
                (the first token this step emits); seeded rows draw from ``_mix_seed(seed, step)``
        Returns (accepted [B] int64 in 0..K, token [B] int64: the token emitted after the accepted
        drafts), from ``speculative_accept`` over ``probs`` at each position. Greedy rows come out
        as greedy acceptance (their distributions are one-hot).
        """
        if logits.dim() != 3 or drafts.dim() != 2 or drafts.shape[0] != logits.shape[0] \
                or drafts.shape[1] + 1 != logits.shape[1]:
            raise ValueError(f"Sampler.speculative_sample: need logits [B, K+1, V] and drafts [B, K], got "
                             f"{tuple(logits.shape)} and {tuple(drafts.shape)}")
        B, T = logits.shape[:2]
        if len(params) != B or len(steps) != B:
            raise ValueError(f"Sampler.speculative_sample: logits has B={B} rows but got {len(params)} params "
                             f"and {len(steps)} steps")
        V = self.vocab_size
        probs = self.probs(logits.flatten(0, 1), [p for p in params for _ in range(T)]).view(B, T, V)
        u = torch.empty(B, T - 1, dtype=torch.float32, device=logits.device)
        noise = torch.empty(B, V, dtype=torch.float32, device=logits.device)
        seeded = [b for b, p in enumerate(params) if p.seed is not None]
        if len(seeded) < B:
            u.uniform_(generator=self._gen)
            noise.exponential_(generator=self._gen)
        for b in seeded:
            self._row_gen.manual_seed(_mix_seed(params[b].seed, int(steps[b])))
            u[b].uniform_(generator=self._row_gen)
            noise[b].exponential_(generator=self._row_gen)
        noise.clamp_min_(torch.finfo(torch.float32).tiny)
        return speculative_accept(probs, drafts.to(torch.int64), u, noise)

    # ------------------------------------------------------------------ helpers

    def _masked_probs(self, x: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """softmax of the temperature-scaled, top-k/top-p-masked logits x [B, vocab_size] fp32 (a new tensor)."""
        B, V = x.shape
        # [B, V] fp32, a new tensor (logits stay untouched); <= 0, so a tiny temperature sends the
        # other tokens to -inf and keeps the maximum at 0: no inf / inf, no NaN
        scaled = (x - x.amax(dim=-1, keepdim=True)) / plan.temperature[:, None]
        if plan.k_cand:
            # candidates in descending order: topk when every filtered row has k < V, else a full sort
            if plan.k_cand < V:
                vals, idx = scaled.topk(plan.k_cand, dim=-1, largest=True, sorted=True)
            else:
                vals, idx = scaled.sort(dim=-1, descending=True)
            pos = torch.arange(vals.shape[1], device=x.device)
            keep = pos[None, :] < plan.top_k[:, None]  # [B, k_cand] top-k by rank
            if plan.any_top_p:
                p = vals.masked_fill(~keep, -math.inf).softmax(dim=-1)
                mass_before = p.cumsum(dim=-1) - p  # exclusive cumsum; exactly 0 at rank 0
                keep &= mass_before < plan.top_p[:, None]
            keep_v = torch.zeros(B, V, dtype=torch.bool, device=x.device).scatter_(-1, idx, keep)
            keep_v |= plan.unfiltered[:, None]
            scaled = scaled.masked_fill_(~keep_v, -math.inf)
        return scaled.softmax(dim=-1)  # masked tokens: exactly 0

    def _check_logits(self, logits: torch.Tensor, who: str) -> int:
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
            if isinstance(logits, torch.Tensor):
                desc = f"{tuple(logits.shape)} {logits.dtype}"
            else:
                desc = type(logits).__name__
            raise ValueError(f"Sampler.{who}: logits must be a float tensor [B, V], got {desc}")
        B, V = logits.shape
        if V < self.vocab_size:
            raise ValueError(f"Sampler.{who}: logits has V={V} columns, fewer than vocab_size={self.vocab_size}")
        if logits.device != self.device:
            raise ValueError(f"Sampler.{who}: logits are on {logits.device}, the sampler on {self.device}")
        return B

    def _noise(self, B: int, params: Sequence[SamplingParams], steps: Sequence[int], plan: _Plan,
               device: torch.device) -> torch.Tensor:
        """E [B, vocab_size] fp32 ~ Exp(1): seeded rows from their own stream, the rest shared."""
        noise = torch.empty(B, self.vocab_size, dtype=torch.float32, device=device)
        if plan.any_unseeded:
            noise.exponential_(generator=self._gen)
        for b in plan.seeded_rows:
            self._row_gen.manual_seed(_mix_seed(params[b].seed, int(steps[b])))
            noise[b].exponential_(generator=self._row_gen)  # a contiguous [V] view: same draw as a lone row
        # E == 0 would turn a masked token's 0/0 into NaN, which argmax prefers
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)

    def _plan(self, params: Sequence[SamplingParams]) -> _Plan:
        key = tuple(params)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        plan = self._build_plan(key)
        self._cache = (key, plan)
        return plan

    def _build_plan(self, params: tuple[SamplingParams, ...]) -> _Plan:
        V = self.vocab_size
        cols: list[list[float]] = [[], [], [], [], []]  # temperature, k, top_p, greedy, unfiltered
        seeded: list[int] = []
        any_greedy = any_unseeded = any_top_p = False
        k_cand = 0
        for b, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"Sampler.sample: params[{b}] is a {type(p).__name__}, not SamplingParams")
            if p.greedy:
                any_greedy = True
                row = (1.0, V, 1.0, 1.0, 1.0)
            else:
                k = V if p.top_k == 0 else min(p.top_k, V)
                filtered = k < V or p.top_p < 1.0
                if filtered:
                    k_cand = max(k_cand, k)
                    any_top_p |= p.top_p < 1.0
                if p.seed is None:
                    any_unseeded = True
                else:
                    seeded.append(b)
                row = (p.temperature, k, p.top_p, 0.0, 0.0 if filtered else 1.0)
            for col, v in zip(cols, row):
                col.append(v)
        if all(g == 1.0 for g in cols[3]):
            return _Plan(True, True, False, (), 0, False, None, None, None, None, None)
        # one host-to-device copy; from pinned memory it is asynchronous (a pageable source
        # would make the copy wait for the device)
        pin = self.device.type == "cuda"
        packed = torch.tensor(cols, dtype=torch.float32, pin_memory=pin).to(self.device, non_blocking=pin)
        return _Plan(
            all_greedy=False,
            any_greedy=any_greedy,
            any_unseeded=any_unseeded,
            seeded_rows=tuple(seeded),
            k_cand=k_cand,
            any_top_p=any_top_p,
            temperature=packed[0],
            top_k=packed[1].long(),
            top_p=packed[2],
            greedy=packed[3] > 0,
            unfiltered=packed[4] > 0,
        )
