"""Speculative verification of T = K+1 tokens per request: the replay kernels, the per-position
("legacy") path, and plain single-token decode as the nothing-drafted baseline.

Providers, all on the same input set (a state cache of 2*B slots, B of them a random permutation,
int32; bf16 x, z, B, C and raw dt [B, T, H]; fp32 per-head A, D, dt_bias; dt_softplus):

- ``replay``: ``replay_selective_state_update`` with a ``ReplayCache`` whose slots replay T//2 old
  tokens (prev_accepted = T//2) before computing the T new outputs. Commit is one integer per
  slot and not timed (buf_idx / prev_accepted are left as they are, so every call replays the same
  number of tokens from the same buffer).
- ``legacy``: the complete per-position step: multi-token ``selective_state_update`` writing every
  position's state into ``intermediate_states`` [B, T, H, P, N] (state dtype), then the accepted
  position's state (T//2 accepted tokens: position T//2 - 1) gathered per request and copied back
  into its slot (``state.index_copy_(0, slots, inter[arange(B), accepted - 1])``).
- ``legacy-no-copy``: the kernel alone, without the copy (PEERS.md's legacy column).
- ``plain``: single-token ``selective_state_update`` on x [B, H, P] (the first of the T tokens):
  the cost of a decode step with nothing drafted.

Each provider has its own byte model (``bytes.spec_replay_bytes``, ``bytes.spec_legacy_bytes``,
``bytes.ssu_bytes``); the case's ``nbytes`` is the smallest of them, so the input rotation is
sized for a cold L2 for every provider. Timing mutates the state, the replay cache and
``intermediate_states`` in place; the values do not change the time.

Check: each provider against the PyTorch reference of its own op, from clean copies of every
buffer it mutates (``intermediate_states``, write-only, NaN-filled instead of copied): ``replay`` against ``fastmamba.ops.replay.ref`` with the same prev_accepted =
T//2 as timed (y, the stored state, and the recorded old_x / old_B / old_dt / old_cumA), the other
three against ``fastmamba.ops.state_update.ref`` (y; intermediate_states; the slot's state: the
last position's, or the accepted position's after the copy). bf16 tolerance (atol 5e-2, rtol 1e-2):
the inputs are bf16 and a 16-bit state is rounded once per token. Checking replay against its own
reference (rather than against legacy's y with nothing to replay) covers the replay itself; that
the two paths agree is the op's test (tests/ops/replay: replay equals plain token-by-token decoding).

Without a GPU: H2 P16 N16 G1, batch 1-2, through the Triton interpreter.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fastmamba.bench import bytes as byte_models
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
    "mamba2-2.7b": (80, 64, 128, 1),
    "nemotron-h": (128, 64, 128, 8),
}
CPU_SHAPES = {"tiny": (2, 16, 16, 1)}
GPU_BATCHES = (1, 8, 32, 128, 256)
CPU_BATCHES = (1, 2)
TOKENS = (6,)  # T = K+1 verified per step; --tokens 2,6,16 for the sweep
STATE_DTYPES = (torch.float32, torch.float16)
ACT_DTYPE = torch.bfloat16
DT_DTYPE = ACT_DTYPE  # raw dt from in_proj, per head

REPLAY, LEGACY, LEGACY_NO_COPY, PLAIN = "replay", "legacy", "legacy-no-copy", "plain"
PROVIDERS = (REPLAY, LEGACY, LEGACY_NO_COPY, PLAIN)
REPLAY_CACHE = ("old_x", "old_B", "old_dt", "old_cumA", "buf_idx", "prev_accepted")
# what each provider writes in place (compared by the check; the union is OpBench.mutated)
MUTATED_BY = {
    REPLAY: ("state", "old_x", "old_B", "old_dt", "old_cumA"),
    LEGACY: ("state", "inter"),
    LEGACY_NO_COPY: ("state", "inter"),
    PLAIN: ("state",),
}


def accepted_tokens(T: int) -> int:
    """Tokens accepted per request in every case: T//2 (replayed by ``replay``, copied by ``legacy``)."""
    return T // 2


class SpecVerifyBench(OpBench):
    key = "spec"
    title = "speculative verification"
    mutated = ("state", "old_x", "old_B", "old_dt", "old_cumA", "inter")

    def __init__(self, tokens: Sequence[int] = TOKENS) -> None:
        self.tokens = tuple(tokens)

    def configure(self, args: object) -> "SpecVerifyBench":
        return SpecVerifyBench(getattr(args, "tokens", None) or TOKENS)

    # --- cases and bytes --------------------------------------------------------------------------
    def cases(self, device: torch.device, batches: Sequence[int]) -> list[Case]:
        shapes = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
        out = []
        for shape, (H, P, N, G) in shapes.items():
            for state_dtype in STATE_DTYPES:
                for T in self.tokens:
                    for B in batches:
                        params = dict(H=H, P=P, N=N, G=G, T=T, S=2 * B, accepted=accepted_tokens(T),
                                      state_dtype=state_dtype, act_dtype=ACT_DTYPE)
                        nbytes = min(_bytes(name, B, params) for name in PROVIDERS)
                        out.append(Case(
                            op=self.key,
                            shape=shape,
                            dims=f"H{H} P{P} N{N} G{G} T{T}",
                            dtype=f"{DTYPE_NAMES[state_dtype]}/{DTYPE_NAMES[ACT_DTYPE]}",
                            batch=B,
                            nbytes=nbytes,
                            params=params,
                            variant=f"T{T}",
                        ))
        return out

    def provider_bytes(self, prov: Provider, case: Case) -> int:
        return _bytes(prov.name, case.batch, case.params)

    def header_notes(self, device: torch.device) -> list[str]:
        return [
            f"cases [spec]: T = K+1 tokens per step in {','.join(map(str, self.tokens))}; T//2 tokens accepted per "
            "request (replay replays them, legacy copies position T//2-1 back); state cache of 2*B slots, random "
            "permutation (int32); bf16 x/z/B/C/dt, fp32 per-head A/D/dt_bias, dt_softplus; plain = one token, "
            "x [B, H, P]",
            "vs best peer [spec]: replay against the faster of legacy and legacy-no-copy; the choice summary "
            "below the table gives both ratios",
            "GB/s [spec] uses each provider's own byte model (fastmamba/bench/bytes.py): replay spec_replay_bytes, "
            "legacy spec_legacy_bytes (T+1 states written, + one state read and written by the copy), plain ssu_bytes",
        ]

    def row_note(self, prov: Provider, case: Case) -> str:
        T, k = case.params["T"], case.params["accepted"]
        return {
            REPLAY: f"replays {k} of the previous step's tokens",
            LEGACY: f"writes {T} states, copies position {k - 1} back",
            LEGACY_NO_COPY: f"writes {T} states, no copy",
            PLAIN: "one token (nothing drafted)",
        }.get(prov.name, "")

    # --- providers and oracle ---------------------------------------------------------------------
    def providers(self, device: torch.device) -> list[Provider]:
        version = _fastmamba_version()
        try:
            replay = load_fastmamba("replay", "replay_selective_state_update")
        except Exception as exc:  # noqa: BLE001
            replay_prov = Provider(REPLAY, "ours", version, None, reason=describe(exc))
        else:
            replay_prov = Provider(REPLAY, "ours", version, replay)
        try:
            ssu = load_fastmamba("state_update", "selective_state_update")
        except Exception as exc:  # noqa: BLE001
            ssu, reason = None, describe(exc)
        # legacy is what replay replaces ("peer" for the ratio column); plain answers another question
        return [
            replay_prov,
            Provider(LEGACY, "peer", version, ssu, reason="" if ssu else reason),
            Provider(LEGACY_NO_COPY, "peer", version, ssu, reason="" if ssu else reason),
            Provider(PLAIN, "baseline", version, ssu, reason="" if ssu else reason),
        ]

    def oracle(self, device: torch.device, providers: Sequence[Provider], mode: str = "auto") -> Provider | None:
        version = f"torch {torch.__version__}"
        try:
            fns = {
                REPLAY: load_fastmamba("replay", "replay_selective_state_update_ref", module="ref"),
                "ssu": load_fastmamba("state_update", "selective_state_update_ref", module="ref"),
            }
        except Exception as exc:  # noqa: BLE001
            return Provider("torch-ref", "ref", version, None, reason=describe(exc))
        return Provider("torch-ref", "ref", version, fns,
                        note="each provider's own op reference (fastmamba.ops.replay.ref, fastmamba.ops.state_update.ref) "
                        "from clean copies of every mutated buffer; bf16 tolerance")

    # --- inputs and calls -------------------------------------------------------------------------
    def make_set(self, case: Case, device: torch.device, seed: int) -> dict:
        p = case.params
        B, T, H, P, N, G, S = case.batch, p["T"], p["H"], p["P"], p["N"], p["G"], p["S"]
        act, sdt, k = p["act_dtype"], p["state_dtype"], p["accepted"]
        g = torch.Generator(device=device).manual_seed(seed)
        cpu_g = torch.Generator().manual_seed(seed)

        def randn(*shape, dtype=torch.float32, scale=1.0):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

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
            "inter": torch.empty(B, T, H, P, N, device=device, dtype=sdt),
        }
        # the previous step, as the replay cache holds it: k accepted tokens in buffer buf_idx
        buf = torch.randint(0, 2, (S,), generator=cpu_g, dtype=torch.int32).to(device)
        old_dt = torch.nn.functional.softplus(randn(2, S, T, H, scale=0.5) + dt_bias)
        inp.update(
            old_x=randn(S, T, H, P, dtype=act),
            old_B=randn(2, S, T, G, N, dtype=act, scale=0.25),
            old_dt=old_dt,
            old_cumA=torch.cumsum(old_dt * A, dim=2),
            buf_idx=buf,
            prev_accepted=torch.full((S,), k, dtype=torch.int32, device=device),
        )
        # the legacy copy's gather: request b's accepted position, and its slot (int64 for index_copy_)
        inp["rows"] = torch.arange(B, device=device)
        inp["accepted_pos"] = torch.full((B,), k - 1, dtype=torch.int64, device=device)
        inp["slots64"] = inp["idx"].long()
        # plain decode: the first token, contiguous as a decode step has it
        for name in ("x", "dt", "B", "C", "z"):
            inp[f"{name}1"] = inp[name][:, 0].contiguous()
        return inp

    def bind(self, prov: Provider, case: Case, inp: dict) -> Callable[[], object]:
        return _call(prov.name, prov.fn, inp)

    def check(self, prov: Provider, ref: Provider, case: Case, inp: dict) -> str:
        """``prov`` and its op's reference, each from clean copies of the buffers it mutates.

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
            out = _call(prov.name, prov.fn, mine)()
        except Exception as exc:  # noqa: BLE001
            return f"FAIL raised {describe(exc)}"
        try:
            expected = _call(prov.name, ref_fn, theirs)()
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
        return byte_models.spec_replay_bytes(B, T, H, P, N, G, accepted=p["accepted"], dt_dtype=DT_DTYPE, **dtypes)
    if provider in (LEGACY, LEGACY_NO_COPY):
        return byte_models.spec_legacy_bytes(B, T, H, P, N, G, dt_dtype=DT_DTYPE, copy=provider == LEGACY, **dtypes)
    return byte_models.ssu_bytes(B, H, P, N, G, **dtypes)  # plain (and anything unknown): one token


def _call(provider: str, fn: Callable, i: dict) -> Callable[[], object]:
    """The call ``provider`` times, with ``fn`` its op (or the op's reference, same signature).

    replay takes the per-head vectors as they are; selective_state_update (and its reference, which
    expects the op's normalised layout) gets their stride-0 broadcasts, as a Mamba-2 layer passes them.
    """
    if provider == REPLAY:
        cache = [i[name] for name in REPLAY_CACHE]
        return lambda: fn(i["state"], *cache, i["x"], i["dt"], i["A"], i["B"], i["C"], D=i["D"], z=i["z"],
                          dt_bias=i["dt_bias"], dt_softplus=True, state_batch_indices=i["idx"])
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
