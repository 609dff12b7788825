"""Speculative verification of T = K+1 tokens per request: the replay kernels, the per-position
("legacy") path, and plain single-token decode as the nothing-drafted baseline.

Providers, all on the same input set (a state cache of 2*B slots, B of them a random permutation,
int32; bf16 x, z, B, C and raw dt [B, T, H]; fp32 per-head A, D, dt_bias; dt_softplus; and a
per-request ``accepted`` [B] int32 drawn uniformly from 1..T with the set's seed):

- ``replay``: a complete replay step, ``replay_selective_state_update`` on a replay cache whose
  history holds up to C = ``default_history(T)`` tokens, then ``commit_accepted(..., accepted,
  tokens=T, history=C)``. Both are timed: the cache evolves across the timed calls as it does in
  decoding (the history fills, the state is stored when it would overflow, at its natural rate).
  The set's cache starts mid-flight: random history contents (a proper cumulative A dt'), hist_len
  uniform in 0..C-T, prev_accepted uniform in 1..T, buf_idx random.
- ``legacy``: the complete per-position step: multi-token ``selective_state_update`` writing every
  position's state into ``intermediate_states`` [B, T, H, P, N] (state dtype), then each request's
  accepted position (accepted[b] - 1) gathered and copied back into its slot
  (``state.index_copy_(0, slots, inter[arange(B), accepted - 1])``).
- ``legacy-no-copy``: the kernel alone, without the copy (PEERS.md's legacy column).
- ``plain``: single-token ``selective_state_update`` on x [B, H, P] (the first of the T tokens):
  the cost of a decode step with nothing drafted.

Each provider has its own byte model (``bytes.spec_replay_bytes``: expected bytes per call in
steady state; ``bytes.spec_legacy_bytes``; ``bytes.ssu_bytes``); the case's ``nbytes`` is the
smallest of them, so the input rotation is sized for a cold L2 for every provider. Timing mutates
the state, the replay cache and ``intermediate_states`` in place.

Check: each provider against the PyTorch reference of its own op, ONE call from clean copies of
every buffer it mutates (``intermediate_states``, write-only, NaN-filled instead of copied):
``replay`` = op + commit against ``replay_selective_state_update_ref`` + ``commit_accepted_ref``
(y, the state, the history buffers, buf_idx / prev_accepted / hist_len), from the cache as timing
left it; the other three against ``fastmamba.ops.state_update.ref`` (y; intermediate_states; the
slot's state: the last position's, or the accepted position's after the copy). bf16 tolerance
(atol 5e-2, rtol 1e-2): the inputs are bf16 and a 16-bit state is rounded once per store. That the
two paths agree is the op's test (tests/ops/replay: replay equals plain token-by-token decoding).

``tune --ops replay`` sweeps the replay kernels' launch configs over this bench's cases
(``tune_cases``: the replay provider only, no ``intermediate_states`` allocated).

State dtypes fp32 and fp16 unless configured (``bench spec --state``, also bf16); the providers
all four unless configured (``bench spec --providers``; the input sets then hold only what those
need: ``bench spec --write-table`` times replay and legacy alone).

Without a GPU: H2 P16 N16 G1, batch 1-2, T 2 and 3, through the Triton interpreter.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from fastmamba.bench import bytes as byte_models
from fastmamba.bench.timing import TimingConfig
from fastmamba.bench.ops._base import (
    DTYPE_NAMES,
    Case,
    OpBench,
    Provider,
    _compare,
    _fastmamba_version,
    describe,
    load_fastmamba,
)

# name -> (H, P, N, G)
GPU_SHAPES = {
    "nemotron-h": (128, 64, 128, 8),
    "nemotron-h-tp8": (16, 64, 128, 1),  # Nemotron-H's per-GPU slice at tensor parallelism 8
    "mamba2-2.7b": (80, 64, 128, 1),
}
DEFAULT_SHAPES = ("nemotron-h", "nemotron-h-tp8")
CPU_SHAPES = {"tiny": (2, 16, 16, 1)}
SHAPES = {**GPU_SHAPES, **CPU_SHAPES}  # what --shapes accepts
GPU_BATCHES = (1, 8, 32, 128, 256)
CPU_BATCHES = (1, 2)
GPU_TOKENS = (2, 4, 6, 8, 16)  # T = K+1 verified per step
CPU_TOKENS = (2, 3)
CPU_TUNE_TOKENS = (2,)  # the CPU smoke of `tune --ops replay`
STATE_DTYPES = (torch.float32, torch.float16)  # default --state
STATE_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}  # what --state accepts
ACT_DTYPE = torch.bfloat16
DT_DTYPE = ACT_DTYPE  # raw dt from in_proj, per head

REPLAY, LEGACY, LEGACY_NO_COPY, PLAIN = "replay", "legacy", "legacy-no-copy", "plain"
PROVIDERS = (REPLAY, LEGACY, LEGACY_NO_COPY, PLAIN)
# the replay cache in the op's argument order (ReplayCache's fields)
REPLAY_CACHE = ("state", "old_x", "old_B", "old_dt", "old_cumA", "buf_idx", "prev_accepted", "hist_len")
# what each provider writes in place (compared by the check; the union is OpBench.mutated)
MUTATED_BY = {
    REPLAY: REPLAY_CACHE,
    LEGACY: ("state", "inter"),
    LEGACY_NO_COPY: ("state", "inter"),
    PLAIN: ("state",),
}


class ReplayFns(NamedTuple):
    """The replay provider's two calls: the op and the commit (or their references), with the
    signatures of ``replay_selective_state_update`` and ``commit_accepted``."""

    op: Callable
    commit: Callable


def history_for(T: int) -> int:
    """The replay cache's history capacity C for T tokens per step: the op's ``default_history``
    (fastmamba.ops.replay); where that cannot be imported, the same rule (the smallest multiple
    of 16 that is >= 4T), so the cases and byte models exist even when the op does not load."""
    try:
        return int(importlib.import_module("fastmamba.ops.replay").default_history(T))
    except (ImportError, AttributeError):
        return max(16, -(-4 * T // 16) * 16)


class SpecVerifyBench(OpBench):
    key = "spec"
    title = "speculative verification"
    mutated = ("state", "old_x", "old_B", "old_dt", "old_cumA", "buf_idx", "prev_accepted", "hist_len", "inter")

    def __init__(self, tokens: Sequence[int] | None = None, shapes: Sequence[str] | None = None, *,
                 states: Sequence[torch.dtype] | None = None, providers: Sequence[str] | None = None,
                 timing: TimingConfig | None = None) -> None:
        self.tokens = tuple(tokens) if tokens else None  # None: GPU_TOKENS / CPU_TOKENS by device
        self.shapes = tuple(shapes) if shapes else None  # None: DEFAULT_SHAPES / CPU_SHAPES by device
        self.states = tuple(states) if states else STATE_DTYPES
        bad = [p for p in providers or () if p not in PROVIDERS]
        if bad:
            raise ValueError(f"SpecVerifyBench: unknown provider(s) {bad}; expected a subset of {PROVIDERS}")
        self.provider_names = tuple(p for p in PROVIDERS if p in providers) if providers else PROVIDERS
        if timing is not None:  # e.g. `bench spec --write-table`'s shorter timing (the class default otherwise)
            self.timing = timing

    def configure(self, args: object) -> "SpecVerifyBench":
        """``--tokens``, ``--shapes``, ``--state`` (names of STATE_NAMES), ``--providers`` and the
        timing ``args.spec_timing`` (set by ``bench spec --write-table``) of one run."""
        states = getattr(args, "state", None)
        return SpecVerifyBench(getattr(args, "tokens", None), getattr(args, "shapes", None),
                               states=[STATE_NAMES[s] for s in states] if states else None,
                               providers=getattr(args, "providers", None), timing=getattr(args, "spec_timing", None))

    def _tokens(self, device: torch.device) -> tuple[int, ...]:
        return self.tokens or (GPU_TOKENS if device.type == "cuda" else CPU_TOKENS)

    def _shapes(self, device: torch.device) -> dict[str, tuple[int, int, int, int]]:
        if self.shapes:
            return {name: SHAPES[name] for name in self.shapes}
        return {name: GPU_SHAPES[name] for name in DEFAULT_SHAPES} if device.type == "cuda" else dict(CPU_SHAPES)

    # --- cases and bytes --------------------------------------------------------------------------
    def cases(self, device: torch.device, batches: Sequence[int], *, tokens: Sequence[int] | None = None,
              providers: Sequence[str] | None = None) -> list[Case]:
        """Every (shape, state dtype, T, batch); ``providers`` the ones the input sets must serve
        (default: the bench's)."""
        providers = tuple(providers or self.provider_names)
        out = []
        for shape, (H, P, N, G) in self._shapes(device).items():
            for state_dtype in self.states:
                for T in tokens or self._tokens(device):
                    for B in batches:
                        params = dict(H=H, P=P, N=N, G=G, T=T, S=2 * B, history=history_for(T),
                                      state_dtype=state_dtype, act_dtype=ACT_DTYPE, providers=tuple(providers))
                        out.append(Case(
                            op=self.key,
                            shape=shape,
                            dims=f"H{H} P{P} N{N} G{G} T{T}",
                            dtype=f"{DTYPE_NAMES[state_dtype]}/{DTYPE_NAMES[ACT_DTYPE]}",
                            batch=B,
                            nbytes=min(_bytes(name, B, params) for name in providers),
                            params=params,
                            variant=f"T{T}",
                        ))
        return out

    def tune_cases(self, device: torch.device, batches: Sequence[int]) -> list[Case]:
        """``tune --ops replay``: the replay provider's cases (GPU: the default shapes and T
        2,4,6,8,16 unless configured; CPU smoke: the tiny shape at T=2)."""
        tokens = self.tokens or (GPU_TOKENS if device.type == "cuda" else CPU_TUNE_TOKENS)
        return self.cases(device, batches, tokens=tokens, providers=(REPLAY,))

    def tune_candidates(self, configs: object, case: Case) -> list[dict]:
        """All of ``configs.CANDIDATES`` on a GPU; on the CPU (interpreter smoke run) the first and
        the last, which is enough to show every field reaches the launcher."""
        candidates = list(configs.CANDIDATES)
        if case.shape not in CPU_SHAPES or len(candidates) <= 2:
            return candidates
        return [candidates[0], candidates[-1]]

    def tune_table_key(self, configs: object, case: Case) -> object:
        """The key of ``configs.TABLE`` that ``case`` looks up (``tune`` prints the table)."""
        p = case.params
        return configs.table_key(programs_per_block=case.batch * p["H"], t_pad=configs.padded_tokens(p["T"]))

    def provider_bytes(self, prov: Provider, case: Case) -> int:
        return _bytes(prov.name, case.batch, case.params)

    def header_notes(self, device: torch.device) -> list[str]:
        tokens = self._tokens(device)
        steady = "; ".join(
            f"T={T} C={history_for(T)}: {s.checkpoint_rate:.1%} stored, {s.replayed:.1f} replayed "
            f"(redrawn every step: {r.checkpoint_rate:.1%}, {r.replayed:.1f})"
            for T in tokens
            for s, r in [(byte_models.spec_replay_steady_state(T, history_for(T)),
                          byte_models.spec_replay_steady_state(T, history_for(T), redraw=True))]
        )
        return [
            f"cases [spec]: shapes {','.join(self._shapes(device))}; state "
            f"{','.join(DTYPE_NAMES[d] for d in self.states)}; providers {','.join(self.provider_names)}; "
            "T = K+1 tokens per step in "
            f"{','.join(map(str, tokens))}; per request an accepted count uniform in 1..T (fixed per input set); "
            "state cache of 2*B slots, random permutation (int32); bf16 x/z/B/C/dt, fp32 per-head A/D/dt_bias, "
            "dt_softplus; plain = one token, x [B, H, P]",
            "replay [spec]: op + commit_accepted per timed call, the cache evolving through its steady state "
            f"(history C = default_history(T)); expected per call: {steady}",
            "vs best peer [spec]: replay against the faster of legacy and legacy-no-copy; the summary below the "
            "table gives both ratios",
            "GB/s [spec] uses each provider's own byte model (fastmamba/bench/bytes.py): replay spec_replay_bytes "
            "(expected bytes per call in steady state), legacy spec_legacy_bytes (T+1 states written, + one state "
            "read and written by the copy), plain ssu_bytes",
        ]

    def row_note(self, prov: Provider, case: Case) -> str:
        T, C = case.params["T"], case.params["history"]
        if prov.name == REPLAY:
            s = byte_models.spec_replay_steady_state(T, C)
            return f"+ commit; C={C}: stores the state in {s.checkpoint_rate:.0%} of calls, replays {s.replayed:.1f} tokens"
        return {
            LEGACY: f"writes {T} states, copies position accepted-1 back",
            LEGACY_NO_COPY: f"writes {T} states, no copy",
            PLAIN: "one token (nothing drafted)",
        }.get(prov.name, "")

    # --- providers and oracle ---------------------------------------------------------------------
    def providers(self, device: torch.device) -> list[Provider]:
        version = _fastmamba_version()
        try:
            replay = ReplayFns(load_fastmamba("replay", "replay_selective_state_update"),
                               load_fastmamba("replay", "commit_accepted"))
        except Exception as exc:  # noqa: BLE001
            replay_prov = Provider(REPLAY, "ours", version, None, reason=describe(exc))
        else:
            replay_prov = Provider(REPLAY, "ours", version, replay)
        try:
            ssu = load_fastmamba("state_update", "selective_state_update")
        except Exception as exc:  # noqa: BLE001
            ssu, reason = None, describe(exc)
        # legacy is what replay replaces ("peer" for the ratio column); plain answers another question
        provs = [
            replay_prov,
            Provider(LEGACY, "peer", version, ssu, reason="" if ssu else reason),
            Provider(LEGACY_NO_COPY, "peer", version, ssu, reason="" if ssu else reason),
            Provider(PLAIN, "baseline", version, ssu, reason="" if ssu else reason),
        ]
        return [p for p in provs if p.name in self.provider_names]

    def oracle(self, device: torch.device, providers: Sequence[Provider], mode: str = "auto") -> Provider | None:
        version = f"torch {torch.__version__}"
        try:
            fns = {
                REPLAY: ReplayFns(load_fastmamba("replay", "replay_selective_state_update_ref", module="ref"),
                                  load_fastmamba("replay", "commit_accepted_ref", module="ref")),
                "ssu": load_fastmamba("state_update", "selective_state_update_ref", module="ref"),
            }
        except Exception as exc:  # noqa: BLE001
            return Provider("torch-ref", "ref", version, None, reason=describe(exc))
        return Provider("torch-ref", "ref", version, fns,
                        note="each provider's own op reference (fastmamba.ops.replay.ref with commit_accepted_ref, "
                        "fastmamba.ops.state_update.ref), one call from clean copies of every mutated buffer; "
                        "bf16 tolerance")

    # --- inputs and calls -------------------------------------------------------------------------
    def make_set(self, case: Case, device: torch.device, seed: int) -> dict:
        p = case.params
        B, T, H, P, N, G, S, C = case.batch, p["T"], p["H"], p["P"], p["N"], p["G"], p["S"], p["history"]
        act, sdt = p["act_dtype"], p["state_dtype"]
        providers = p.get("providers", PROVIDERS)
        g = torch.Generator(device=device).manual_seed(seed)
        cpu_g = torch.Generator().manual_seed(seed)

        def randn(*shape, dtype=torch.float32, scale=1.0):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

        def randint(low, high, size):  # int32 in [low, high), drawn on the CPU (the same on every device)
            return torch.randint(low, high, size, generator=cpu_g, dtype=torch.int32).to(device)

        dt0 = torch.rand(H, generator=g, device=device) * (0.1 - 0.001) + 0.001  # softplus(dt_bias) in [1e-3, 1e-1]
        dt_bias = dt0 + torch.log(-torch.expm1(-dt0))  # inverse softplus, as Mamba-2 initialises it
        A = -torch.exp(torch.rand(H, generator=g, device=device))
        inp = {
            "state": randn(S, H, P, N, dtype=sdt, scale=0.5),
            "x": randn(B, T, H, P, dtype=act),
            "dt": randn(B, T, H, dtype=DT_DTYPE, scale=0.5),
            "A": A,
            "B": randn(B, T, G, N, dtype=act, scale=0.25),
            "C": randn(B, T, G, N, dtype=act, scale=0.25),
            "D": randn(H),
            "z": randn(B, T, H, P, dtype=act),
            "dt_bias": dt_bias,
            "idx": torch.randperm(S, generator=cpu_g)[:B].to(device=device, dtype=torch.int32),
            "accepted": randint(1, T + 1, (B,)),  # this step's accepted count per request, 1..T
        }
        if REPLAY in providers:
            # a cache mid-flight: a history of hist_len earlier tokens + the previous step's T (random
            # contents; old_cumA a proper cumulative A dt', so every replay decay exp(cA[k-1] - cA[s]) <= 1)
            old_dt = torch.nn.functional.softplus(randn(2, S, C, H, scale=0.5) + dt_bias)
            inp.update(
                old_x=randn(S, C, H, P, dtype=act),
                old_B=randn(2, S, C, G, N, dtype=act, scale=0.25),
                old_dt=old_dt,
                old_cumA=torch.cumsum(old_dt * A, dim=2),
                buf_idx=randint(0, 2, (S,)),
                prev_accepted=randint(1, T + 1, (S,)),
                hist_len=randint(0, C - T + 1, (S,)),
            )
        if LEGACY in providers or LEGACY_NO_COPY in providers:
            inp["inter"] = torch.empty(B, T, H, P, N, device=device, dtype=sdt)
            # the legacy copy's gather: request b's accepted position, and its slot (int64 for index_copy_)
            inp["rows"] = torch.arange(B, device=device)
            inp["accepted_pos"] = inp["accepted"].long() - 1
            inp["slots64"] = inp["idx"].long()
        if PLAIN in providers:  # plain decode: the first token, contiguous as a decode step has it
            for name in ("x", "dt", "B", "C", "z"):
                inp[f"{name}1"] = inp[name][:, 0].contiguous()
        return inp

    def bind(self, prov: Provider, case: Case, inp: dict) -> Callable[[], object]:
        return _call(prov.name, prov.fn, inp, case.params)

    def check(self, prov: Provider, ref: Provider, case: Case, inp: dict) -> str:
        """``prov`` and its op's reference, one call each from clean copies of the buffers it mutates.

        ``intermediate_states`` is write-only: instead of two copies of it (17 GB each at Nemotron-H,
        fp32, B=256, T=16) the set's own buffer and one new one are both filled with NaN, so a
        position left unwritten fails the comparison.
        """
        writes = MUTATED_BY[prov.name]
        mine = {k: (v.clone() if k in writes and k != "inter" else v) for k, v in inp.items()}
        theirs = {k: (v.clone() if k in writes and k != "inter" else v) for k, v in inp.items()}
        if "inter" in writes:
            mine["inter"] = inp["inter"].fill_(float("nan"))
            theirs["inter"] = torch.full_like(inp["inter"], float("nan"))
        ref_fn = ref.fn[REPLAY] if prov.name == REPLAY else ref.fn["ssu"]
        try:
            out = _call(prov.name, prov.fn, mine, case.params)()
        except Exception as exc:  # noqa: BLE001
            return f"FAIL raised {describe(exc)}"
        try:
            expected = _call(prov.name, ref_fn, theirs, case.params)()
        except Exception as exc:  # noqa: BLE001
            return f"ref error: {describe(exc)}"
        problems = [_compare("y", out, expected, self.out_tol)]
        problems += [_compare(name, mine[name], theirs[name], self.state_tol) for name in writes]
        problems = [p for p in problems if p]
        return "ok" if not problems else "FAIL " + "; ".join(problems)


def _bytes(provider: str, B: int, p: dict) -> int:
    H, P, N, G, T = p["H"], p["P"], p["N"], p["G"], p["T"]
    dtypes = dict(state_dtype=p["state_dtype"], act_dtype=p["act_dtype"])
    if provider == REPLAY:
        return byte_models.spec_replay_bytes(B, T, H, P, N, G, history=p["history"], dt_dtype=DT_DTYPE, **dtypes)
    if provider in (LEGACY, LEGACY_NO_COPY):
        return byte_models.spec_legacy_bytes(B, T, H, P, N, G, dt_dtype=DT_DTYPE, copy=provider == LEGACY, **dtypes)
    return byte_models.ssu_bytes(B, H, P, N, G, **dtypes)  # plain (and anything unknown): one token


def _call(provider: str, fn: Callable | ReplayFns, i: dict, params: dict) -> Callable[[], object]:
    """The call ``provider`` times, with ``fn`` its op (or the op's reference, same signature).

    replay takes the per-head vectors as they are, then commits the set's accepted counts;
    selective_state_update (and its reference, which expects the op's normalised layout) gets
    their stride-0 broadcasts, as a Mamba-2 layer passes them.
    """
    if provider == REPLAY:
        op, commit = fn
        cache = [i[name] for name in REPLAY_CACHE]
        T, C = params["T"], params["history"]

        def replay_step() -> torch.Tensor:
            y = op(*cache, i["x"], i["dt"], i["A"], i["B"], i["C"], D=i["D"], z=i["z"], dt_bias=i["dt_bias"],
                   dt_softplus=True, state_batch_indices=i["idx"])
            commit(i["buf_idx"], i["prev_accepted"], i["hist_len"], i["idx"], i["accepted"], tokens=T, history=C)
            return y

        return replay_step
    H, P, N = i["state"].shape[1:]
    A = i["A"][:, None, None].expand(H, P, N)
    D = i["D"][:, None].expand(H, P)
    dt_bias = i["dt_bias"][:, None].expand(H, P)
    if provider == PLAIN:
        dt1 = i["dt1"][..., None].expand(*i["dt1"].shape, P)
        return lambda: fn(i["state"], i["x1"], dt1, A, i["B1"], i["C1"], D, i["z1"], dt_bias, True, i["idx"])
    dt = i["dt"][..., None].expand(*i["dt"].shape, P)

    def legacy() -> torch.Tensor:
        y = fn(i["state"], i["x"], dt, A, i["B"], i["C"], D, i["z"], dt_bias, True, i["idx"],
               intermediate_states=i["inter"])
        if provider == LEGACY:
            i["state"].index_copy_(0, i["slots64"], i["inter"][i["rows"], i["accepted_pos"]])
        return y

    return legacy


BENCH = SpecVerifyBench()
