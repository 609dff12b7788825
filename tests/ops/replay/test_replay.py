"""replay_selective_state_update vs the fp32 reference and vs plain token-by-token decoding
(CPU: Triton interpreter; GPU: the mamba2-2.7b shape)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
import dataclasses
import doctest
import re

import pytest
import torch
import torch.nn.functional as F

from fastmamba.ops import (
    ReplayCache,
    allocate_replay_cache,
    commit_accepted,
    flush_replay_cache,
    replay_selective_state_update,
    selective_state_update,
)
from fastmamba.ops.replay import cache as replay_cache
from fastmamba.ops.replay import configs as replay_configs
from fastmamba.ops.replay import default_history
from fastmamba.ops.replay.ref import commit_accepted_ref, flush_ref, replay_selective_state_update_ref
from tests.helpers import nan_like, tol


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    batch: int = 3
    tokens: int = 3
    heads: int = 4
    headdim: int = 12  # not a power of two: masked P rows
    dstate: int = 10  # below tl.dot's 16: masked N columns
    groups: int = 2
    act: torch.dtype = torch.float32
    state_dtype: torch.dtype = torch.float32
    history: int = 8  # C_h, the cache's history capacity
    accepted: tuple[int, ...] = (1, 3, 2)  # prev_accepted of each request's slot
    hist: tuple[int, ...] = (0, 4, 2)  # hist_len of each request's slot (k = hist + accepted)
    bufs: tuple[int, ...] = (0, 1, 1)  # buf_idx of each request's slot
    slots: str = "shuffled-pad"  # "shuffled-pad" (last request is padding) | "shuffled" | "none"
    has_z: bool = True
    has_D: bool = True
    has_dt_bias: bool = True
    strided_x: bool = False


# BASE: request 0 replays 1 token and appends (1 + 3 <= 8), request 1 replays 7 and stores its
# state (7 + 3 > 8: a checkpoint, new history in the other buffer), request 2 is padding
BASE = Case("B3-T3-C8-H4-P12-N10-G2-fp32")
CASES = [
    BASE,
    dataclasses.replace(BASE, id="no-pad", slots="shuffled"),  # request 2: replays 4, appends
    dataclasses.replace(BASE, id="k0", accepted=(0, 0, 0), hist=(0, 0, 0)),
    dataclasses.replace(BASE, id="history-only", accepted=(0, 0, 0), hist=(3, 5, 1), slots="shuffled"),
    dataclasses.replace(BASE, id="C=T-store-every-step", history=3, accepted=(1, 3, 2), hist=(0, 0, 0),
                        slots="shuffled"),
    dataclasses.replace(BASE, id="C40-chunks", history=40, accepted=(3, 3, 2), hist=(20, 36, 0), slots="shuffled"),
    dataclasses.replace(BASE, id="kT-buf0", accepted=(3, 3, 3), hist=(5, 5, 0), bufs=(0, 0, 0)),
    dataclasses.replace(BASE, id="B1-T1", batch=1, tokens=1, accepted=(1,), hist=(7,), bufs=(1,), slots="shuffled"),
    dataclasses.replace(BASE, id="T4", tokens=4, accepted=(2, 4, 0), hist=(2, 0, 4), bufs=(1, 0, 0), slots="shuffled"),
    dataclasses.replace(BASE, id="no-slots", slots="none", accepted=(0, 1, 3), hist=(1, 0, 2)),
    dataclasses.replace(BASE, id="H3-G1", heads=3, groups=1),
    dataclasses.replace(BASE, id="P16-N16", headdim=16, dstate=16),
    dataclasses.replace(BASE, id="bf16-act", act=torch.bfloat16),
    dataclasses.replace(BASE, id="fp16-act-fp16-state", act=torch.float16, state_dtype=torch.float16),
    dataclasses.replace(BASE, id="bf16-act-bf16-state", act=torch.bfloat16, state_dtype=torch.bfloat16),
    dataclasses.replace(BASE, id="no-z-no-D-no-dt_bias", has_z=False, has_D=False, has_dt_bias=False),
    dataclasses.replace(BASE, id="strided-x", strided_x=True),
]


def _checkpoints(c: Case, b: int) -> bool:
    """Whether request b's call stores its slot's state."""
    return c.hist[b] + c.accepted[b] + c.tokens > c.history


def _slots(c: Case, g: torch.Generator) -> tuple[int, torch.Tensor | None]:
    nslots = 2 * c.batch + 1
    perm = torch.randperm(nslots, generator=g)[: c.batch].to(torch.int32)
    if c.slots == "none":
        return nslots, None
    if c.slots == "shuffled-pad":
        perm[-1] = -1
    return nslots, perm


def make_cache(c: Case, A: torch.Tensor, slots: list[int], g: torch.Generator) -> ReplayCache:
    """A cache with plausible random contents; whatever the call must not read is NaN: the
    positions >= k = hist + accepted of the read buffer and of old_x, and the whole other buffer."""
    nslots, T, H, P, G, N = 2 * c.batch + 1, c.tokens, c.heads, c.headdim, c.groups, c.dstate
    cache = allocate_replay_cache(nslots, T, H, P, G, N, c.state_dtype, c.act, "cpu", history=c.history)
    Ch = c.history
    cache.state.copy_(torch.randn(nslots, H, P, N, generator=g))
    cache.old_x.copy_(torch.randn(nslots, Ch, H, P, generator=g))
    cache.old_B.copy_(torch.randn(2, nslots, Ch, G, N, generator=g) * 0.3)
    cache.old_dt.copy_(F.softplus(torch.randn(2, nslots, Ch, H, generator=g) - 2.0))
    cache.old_cumA.copy_(torch.cumsum(cache.old_dt * A, dim=2))
    cache.buf_idx.copy_(torch.randint(0, 2, (nslots,), generator=g))
    cache.prev_accepted.copy_(torch.randint(0, T + 1, (nslots,), generator=g))
    cache.hist_len.copy_(torch.randint(0, Ch - T + 1, (nslots,), generator=g))
    for b, slot in enumerate(slots):
        if slot < 0:
            continue
        k, r = c.hist[b] + c.accepted[b], c.bufs[b]
        assert c.hist[b] + T <= Ch and c.accepted[b] <= T, "the case must be reachable"
        cache.buf_idx[slot], cache.prev_accepted[slot], cache.hist_len[slot] = r, c.accepted[b], c.hist[b]
        cache.old_x[slot, k:] = float("nan")
        for buf in (cache.old_B, cache.old_dt, cache.old_cumA):
            buf[r, slot, k:] = float("nan")
            buf[1 - r, slot] = float("nan")
    return cache


def make_inputs(c: Case, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T, H, P, G, N = c.batch, c.tokens, c.heads, c.headdim, c.groups, c.dstate
    A = -torch.exp(torch.randn(H, generator=g) * 0.5)
    nslots, idx = _slots(c, g)
    slots = idx.tolist() if idx is not None else list(range(B))
    cache = make_cache(c, A, slots, g)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    x = rnd(B, T, H, 2 * P)[..., :P] if c.strided_x else rnd(B, T, H, P)
    inputs = dict(
        x=x.to(c.act),
        dt=rnd(B, T, H) - 3.0,  # raw: softplus(dt + dt_bias) is small, as in a trained model
        A=A,
        B=rnd(B, T, G, N, scale=0.3).to(c.act),
        C=rnd(B, T, G, N, scale=0.3).to(c.act),
        D=rnd(H) if c.has_D else None,
        z=rnd(B, T, H, P).to(c.act) if c.has_z else None,
        dt_bias=rnd(H, scale=0.5) if c.has_dt_bias else None,
        dt_softplus=True,
        state_batch_indices=idx,
    )
    cache = ReplayCache(*(t.to(device) for t in cache))
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    return cache, inputs, slots


PATHS = ["auto", "split", "split-nopdl", "split-notma"]


@contextlib.contextmanager
def kernel_path(path: str, device) -> Iterator[None]:
    """"auto": the launcher's own choice (one main kernel at these sizes); "split": the output
    kernel for every request plus the checkpoint kernel for those that store their state (forced;
    on the GPU with the table's split-path tiles, its three kernels chained by PDL on sm_90+);
    "split-nopdl": the same launched plainly (GPU only: the CPU never chains them); "split-notma":
    chained, with the pointer-load output and checkpoint kernels where the TMA variants would run
    (an fp32 state's output kernel; every bf16-activation checkpoint kernel) (GPU only: the CPU
    never runs the TMA variants)."""
    if path == "auto":
        yield
        return
    if torch.device(device).type == "cpu":
        if path in ("split-nopdl", "split-notma"):
            pytest.skip("the split path's PDL chain and TMA kernels exist only on sm_90+ GPUs; on the CPU "
                        "'split' covers the path")
        with replay_configs.forced_config(16, 1, 4, 1, split=True, out_block_p=16, out_warps=1):
            yield
        return
    previous = replay_configs.CHAIN_PDL, replay_configs.OUT_TMA, replay_configs.CKPT_TMA
    replay_configs.CHAIN_PDL = path != "split-nopdl"
    if path == "split-notma":
        replay_configs.OUT_TMA = replay_configs.CKPT_TMA = None
    try:
        with replay_configs.forced_config(64, 4, 16, 2, split=True):  # the output tile of OUT_TILES
            yield
    finally:
        replay_configs.CHAIN_PDL, replay_configs.OUT_TMA, replay_configs.CKPT_TMA = previous


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern view, so NaN-poisoned buffers compare exactly with torch.equal."""
    return t.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _clone(cache: ReplayCache) -> ReplayCache:
    return ReplayCache(*(t.clone() for t in cache))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_matches_reference(c: Case, path, device):
    cache, inp, slots = make_inputs(c, device)
    before, ref = _clone(cache), _clone(cache)
    out = nan_like(inp["x"])
    with kernel_path(path, device):
        y = replay_selective_state_update(*cache, **inp, out=out)
    y_ref = replay_selective_state_update_ref(*ref, **inp)
    assert y.data_ptr() == out.data_ptr()
    t = tol(c.act, c.state_dtype)
    torch.testing.assert_close(y.float(), y_ref.float(), **t)
    torch.testing.assert_close(cache.state.float(), ref.state.float(), **t)
    # recorded inputs: x and B are copies (exact); dt' and cumA are computed (fp32)
    assert torch.equal(_bits(cache.old_x), _bits(ref.old_x))
    assert torch.equal(_bits(cache.old_B), _bits(ref.old_B))
    torch.testing.assert_close(cache.old_dt, ref.old_dt, atol=1e-5, rtol=1e-5, equal_nan=True)
    torch.testing.assert_close(cache.old_cumA, ref.old_cumA, atol=1e-5, rtol=1e-5, equal_nan=True)
    # the caller commits: the op leaves the integers alone
    for name in ("buf_idx", "prev_accepted", "hist_len"):
        assert torch.equal(getattr(cache, name), getattr(before, name)), name

    live = [s for s in slots if s >= 0]
    for b, slot in enumerate(slots):
        if slot >= 0 and not _checkpoints(c, b):  # no checkpoint: the state row is not rewritten
            assert torch.equal(cache.state[slot], before.state[slot])
    untouched = [s for s in range(cache.state.shape[0]) if s not in live]
    for name, now, then in zip(ReplayCache._fields, cache, before):
        rows = (slice(None), untouched) if now.dim() == 5 or name in ("old_dt", "old_cumA") else (untouched,)
        assert torch.equal(_bits(now[rows]), _bits(then[rows])), f"{name}: a row outside the batch changed"
    if c.slots == "shuffled-pad":
        assert torch.equal(y[-1], torch.zeros_like(y[-1]))


@pytest.mark.parametrize("path", ["auto", "split"])
def test_A_is_log_equals_minus_exp(path, device):
    """A_is_log=True with A = A_log gives what A = -exp(A_log) gives (kernel and reference)."""
    cache, inp, _ = make_inputs(BASE, device, seed=12)
    A_log = torch.log(-inp["A"])
    c_log, c_exp, c_ref = _clone(cache), _clone(cache), _clone(cache)
    with kernel_path(path, device):
        y_log = replay_selective_state_update(*c_log, **dict(inp, A=A_log), A_is_log=True)
        y_exp = replay_selective_state_update(*c_exp, **dict(inp, A=-torch.exp(A_log)))
    y_ref = replay_selective_state_update_ref(*c_ref, **dict(inp, A=A_log), A_is_log=True)
    for y in (y_log, y_ref):
        torch.testing.assert_close(y, y_exp, **tol(BASE.act))
    for c in (c_log, c_ref):
        torch.testing.assert_close(c.state, c_exp.state, **tol(BASE.act))
        torch.testing.assert_close(c.old_cumA, c_exp.old_cumA, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_accepts_broadcast_per_head_forms(device):
    """A as an (H, P, N) stride-0 view, dt as (B, T, H, P) stride 0 over P, D / dt_bias as (H, P)."""
    c = BASE
    cache, inp, _ = make_inputs(c, device, seed=1)
    ref = _clone(cache)
    y_ref = replay_selective_state_update_ref(*ref, **inp)
    H, P, N = c.heads, c.headdim, c.dstate
    wide = dict(inp, A=inp["A"][:, None, None].expand(H, P, N), dt=inp["dt"].unsqueeze(-1).expand(*inp["dt"].shape, P),
                D=inp["D"][:, None].expand(H, P), dt_bias=inp["dt_bias"][:, None].expand(H, P))
    y = replay_selective_state_update(*cache, **wide)
    torch.testing.assert_close(y, y_ref, **tol(c.act))
    torch.testing.assert_close(cache.state, ref.state, **tol(c.act))


# ---- the key property: replay + commit == plain decoding of the accepted tokens ---------------

def _equivalence(c: Case, accepted_per_step: list[list[int]], device, seed: int, path: str = "auto"):
    """Run speculative steps with the given accepted counts (commit between steps) and, beside
    them, plain token-by-token selective_state_update over the accepted tokens only. Every
    accepted token's output and, after a final step and a flush, the state must agree."""
    g = torch.Generator().manual_seed(seed)
    B, T, H, P, G, N = c.batch, c.tokens, c.heads, c.headdim, c.groups, c.dstate
    nslots = 2 * B + 1
    slots = torch.randperm(nslots, generator=g)[:B].to(torch.int32).to(device)
    A = (-torch.exp(torch.randn(H, generator=g) * 0.5)).to(device)
    D, dt_bias = torch.randn(H, generator=g).to(device), (torch.randn(H, generator=g) * 0.5).to(device)
    cache = allocate_replay_cache(nslots, T, H, P, G, N, c.state_dtype, c.act, device, history=c.history)
    cache.state.copy_(torch.randn(nslots, H, P, N, generator=g))  # as a prefill left it
    plain_state = cache.state.float().clone()  # fp32 throughout (a copy even for an fp32 state)

    def step_inputs():
        return dict(
            x=torch.randn(B, T, H, P, generator=g).to(c.act).to(device),
            dt=(torch.randn(B, T, H, generator=g) - 3.0).to(device),
            B=(torch.randn(B, T, G, N, generator=g) * 0.3).to(c.act).to(device),
            C=(torch.randn(B, T, G, N, generator=g) * 0.3).to(c.act).to(device),
            z=torch.randn(B, T, H, P, generator=g).to(c.act).to(device),
        )

    t_out, t_state = tol(c.act), tol(c.act, c.state_dtype)
    stored = 0  # checkpoints seen (the state rows changed by a call)
    for accepted in accepted_per_step + [None]:  # None: a last step whose tokens are all rejected
        inp = step_inputs()
        before = cache.state.clone()
        with kernel_path(path, device):
            y = replay_selective_state_update(*cache, inp["x"], inp["dt"], A, inp["B"], inp["C"], D, inp["z"],
                                              dt_bias, True, slots)
        stored += int(not torch.equal(before, cache.state))
        if accepted is None:
            cache.commit(slots, torch.zeros_like(slots), T)
            break
        acc = torch.tensor(accepted, dtype=torch.int32, device=device)
        for t in range(T):
            rows = torch.where(acc > t, slots, torch.full_like(slots, -1))  # the others: pad
            y_t = selective_state_update(plain_state, inp["x"][:, t], inp["dt"][:, t], A, inp["B"][:, t],
                                         inp["C"][:, t], D, inp["z"][:, t], dt_bias, True, rows)
            keep = acc > t
            torch.testing.assert_close(y[keep, t].float(), y_t[keep].float(), **t_out)
        cache.commit(slots, acc, T)
        assert torch.equal(cache.prev_accepted[slots.long()], acc)
    cache.flush(slots)
    rows = slots.long()
    assert not cache.hist_len.any() and not cache.prev_accepted.any()
    torch.testing.assert_close(cache.state[rows].float(), plain_state[rows], **t_state)
    return stored


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("history", [4, 8, 16], ids=["C=T", "C8", "C16"])
def test_replay_equals_plain_decoding_of_accepted_tokens(history, path, device):
    c = Case("equivalence-T4", batch=3, tokens=4, slots="shuffled", history=history)
    # every count 0..T appears; a request may accept nothing and then everything
    stored = _equivalence(c, [[1, 4, 2], [4, 0, 3], [0, 2, 4], [3, 1, 1]], device, seed=20, path=path)
    assert stored >= (1 if history < 16 else 0)  # C=T and C8 store the state along the way


def test_replay_equals_plain_decoding_bf16(device):
    # bf16 activations, fp32 state: the plain run sees the same bf16 inputs; tolerances are bf16's
    c = Case("equivalence-bf16", batch=1, tokens=3, heads=2, headdim=8, dstate=16, groups=1, act=torch.bfloat16,
             slots="shuffled")
    _equivalence(c, [[2], [3], [1], [3], [3]], device, seed=21)


# ---- 16-bit state: stochastic rounding of the stored (replayed) state ------------------------

@pytest.mark.parametrize("path", ["auto", "split", "split-notma"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_stochastic_rounding_of_the_committed_state(state_dtype, path, device):
    """With rand_seed, each stored element is one of the two neighbours of the fp32 replay result,
    not always the nearest one, and the seed changes the choice; the outputs do not depend on it.
    On the GPU the split paths store through the TMA checkpoint kernel ('split', P = 64) and the
    pointer one ('split-notma')."""
    on_gpu = torch.device(device).type == "cuda"
    c = dataclasses.replace(BASE, id="sr", accepted=(3, 2, 1), hist=(5, 4, 5), slots="shuffled",
                            headdim=64 if on_gpu and path != "auto" else 16, dstate=16,
                            state_dtype=state_dtype)  # every request stores its state
    with kernel_path(path, device):
        _check_stochastic_rounding(c, state_dtype, device, same_outputs=path == "auto")


def _check_stochastic_rounding(c, state_dtype, device, same_outputs: bool):
    """``same_outputs``: the outputs also equal an fp32-state run's (true where both states take
    the same kernel; the split path's output kernel meets a 16-bit state on 16-bit tensor cores,
    so there they are compared with the same run without rand_seed instead)."""
    cache, inp, slots = make_inputs(c, device, seed=3)
    exact = ReplayCache(*(t.clone() for t in cache))._replace(state=cache.state.float())
    y_exact = replay_selective_state_update(*exact, **inp)
    if not same_outputs:
        y_exact = replay_selective_state_update(*_clone(cache), **inp)
    rows = torch.tensor(slots).long()
    v = exact.state[rows].cpu()
    rn = v.to(state_dtype).float()
    neighbour = torch.nextafter(v.to(state_dtype), torch.where(v > rn, 1.0, -1.0).to(state_dtype) * float("inf")).float()
    results = []
    for seed in (5, 6):
        trial = _clone(cache)
        y = replay_selective_state_update(*trial, **inp, rand_seed=torch.tensor([seed], device=device))
        torch.testing.assert_close(y, y_exact, atol=1e-6, rtol=1e-6)  # outputs use the unrounded state
        sr = trial.state[rows].float().cpu()
        assert torch.all((sr == rn) | (sr == neighbour)), "stochastic result must be a neighbour of the exact value"
        results.append(sr)
    assert not torch.equal(results[0], rn), "some elements must round away from the nearest value"
    assert not torch.equal(results[0], results[1]), "a different seed must give different roundings"


# ---- cache helpers -----------------------------------------------------------------------------

def test_allocate_and_commit():
    cache = allocate_replay_cache(5, 3, 4, 8, 2, 16, torch.bfloat16, torch.float16, "cpu", history=8)
    assert cache.history == 8
    assert [tuple(t.shape) for t in cache] == [(5, 4, 8, 16), (5, 8, 4, 8), (2, 5, 8, 2, 16), (2, 5, 8, 4),
                                               (2, 5, 8, 4), (5,), (5,), (5,)]
    assert [t.dtype for t in cache] == [torch.bfloat16, torch.float16, torch.float16, torch.float32,
                                        torch.float32, torch.int32, torch.int32, torch.int32]
    assert all(not t.any() for t in cache)
    assert allocate_replay_cache(2, 6, 1, 4, 1, 4, torch.float32, torch.float32, "cpu").history == default_history(6) == 32
    slots = torch.tensor([3, -1, 0], dtype=torch.int32)
    cache.commit(slots, torch.tensor([2, 3, 0]), 3)  # k = 0: nothing stored, hist_len = 0
    assert cache.buf_idx.tolist() == [0] * 5 and cache.prev_accepted.tolist() == [0, 0, 0, 2, 0]
    cache.commit(slots, torch.tensor([3, 1, 1]), 3)  # slot 3: k = 2, 2 + 3 <= 8: appended
    assert cache.hist_len.tolist() == [0, 0, 0, 2, 0] and cache.prev_accepted.tolist() == [1, 0, 0, 3, 0]
    commit_accepted(cache.buf_idx, cache.prev_accepted, cache.hist_len, slots, torch.tensor([1, 0, 2], dtype=torch.int32),
                    tokens=3, history=8)  # slot 3: k = 5, 5 + 3 <= 8: appended; slot 0: k = 1
    assert cache.hist_len.tolist() == [1, 0, 0, 5, 0] and cache.buf_idx.tolist() == [0] * 5
    cache.commit(slots, torch.tensor([2, 0, 3]), 3)  # slot 3: k = 6, 6 + 3 > 8: stored, new history
    assert cache.hist_len.tolist() == [3, 0, 0, 0, 0] and cache.buf_idx.tolist() == [0, 0, 0, 1, 0]
    assert cache.prev_accepted.tolist() == [3, 0, 0, 2, 0]
    before = _clone(cache)
    with pytest.raises(ValueError, match=r"`accepted` values must lie in \[0, 3\]; got \[4\]"):
        cache.commit(slots, torch.tensor([4, 0, 0]), 3)
    with pytest.raises(ValueError, match=r"`slots` values must lie in \[0, 5\)"):
        cache.commit(torch.tensor([7, 0, 1], dtype=torch.int32), torch.tensor([1, 1, 1]), 3)
    with pytest.raises(TypeError, match="`accepted` expected an integer dtype"):
        cache.commit(slots, torch.tensor([1.0, 1.0, 1.0]), 3)
    with pytest.raises(ValueError, match="need 1 <= tokens <= history, got tokens=9, history=8"):
        cache.commit(slots, torch.tensor([1, 1, 1]), 9)
    with pytest.raises(ValueError, match="history=2 must be >= T=3"):
        allocate_replay_cache(5, 3, 4, 8, 2, 16, torch.float32, torch.float32, "cpu", history=2)
    assert all(torch.equal(a, b) for a, b in zip(cache, before))


def test_commit_kernel_matches_reference(device):
    """The commit (one kernel on a GPU / the interpreter) against the plain-Python bookkeeping,
    random counters, pad rows, int64 slots."""
    g = torch.Generator().manual_seed(11)
    S, T, Ch = 40, 4, 12
    buf = torch.randint(0, 2, (S,), generator=g, dtype=torch.int32)
    hist = torch.randint(0, Ch - T + 1, (S,), generator=g, dtype=torch.int32)
    prev = torch.randint(0, T + 1, (S,), generator=g, dtype=torch.int32)
    slots = torch.randperm(S, generator=g)[:33]
    slots[[3, 17]] = -1
    accepted = torch.randint(0, T + 1, (33,), generator=g)
    mine = [t.clone().to(device) for t in (buf, prev, hist)]
    commit_accepted(*mine, slots.to(device), accepted.to(device), tokens=T, history=Ch)
    theirs = [t.clone() for t in (buf, prev, hist)]
    commit_accepted_ref(*theirs, slots, accepted, tokens=T, history=Ch)
    for name, a, b in zip(("buf_idx", "prev_accepted", "hist_len"), mine, theirs):
        assert torch.equal(a.cpu(), b), name
    assert not all(torch.equal(a.cpu(), b) for a, b in zip(mine, (buf, prev, hist)))


FLUSH_CASES = [
    dataclasses.replace(BASE, id="flush", accepted=(2, 0, 3), hist=(3, 0, 5), slots="shuffled"),
    # k = 23 and 39: the kernel's history loop takes 16 tokens per trip
    dataclasses.replace(BASE, id="flush-C40", history=40, accepted=(3, 3, 2), hist=(20, 36, 0), slots="shuffled"),
    dataclasses.replace(BASE, id="flush-bf16-act-G1", act=torch.bfloat16, heads=3, groups=1, accepted=(1, 2, 3),
                        hist=(4, 0, 5), slots="shuffled"),
    dataclasses.replace(BASE, id="flush-P40-N16", headdim=40, dstate=16, accepted=(3, 1, 0), hist=(5, 2, 0),
                        slots="shuffled"),  # two P blocks
]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", FLUSH_CASES, ids=lambda c: c.id)
def test_flush_matches_reference(case, state_dtype, device):
    """flush stores the replayed states of the given slots (pad rows skipped, other slots untouched)
    and empties their histories; NaN in unused history positions is never read."""
    c = dataclasses.replace(case, state_dtype=state_dtype)
    cache, _, slots = make_inputs(c, device, seed=9)
    ref = _clone(cache)
    idx = torch.tensor(slots + [-1], dtype=torch.int32, device=device)
    flush_replay_cache(cache, idx)
    flush_ref(*ref, idx)
    torch.testing.assert_close(cache.state.float(), ref.state.float(), **tol(torch.float32, state_dtype))
    for name in ("buf_idx", "prev_accepted", "hist_len"):
        assert torch.equal(getattr(cache, name), getattr(ref, name)), name
    assert cache.hist_len[idx[:-1].long()].tolist() == [0, 0, 0]
    others = [s for s in range(cache.state.shape[0]) if s not in slots]
    assert torch.equal(cache.prev_accepted[others], ref.prev_accepted[others])


def test_commit_and_flush_bad_input():
    cache, _, slots = make_inputs(BASE, "cpu", seed=10)
    before = _clone(cache)
    idx = torch.tensor(slots, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"commit_accepted: `tokens` expected an int, got float"):
        cache.commit(idx, torch.ones(3, dtype=torch.int32), 2.5)
    with pytest.raises(TypeError, match=r"commit_accepted: `accepted` expected a torch.Tensor, got list"):
        cache.commit(idx, [1, 1, 1], 3)
    with pytest.raises(TypeError, match=r"flush_replay_cache: `slots` expected a torch.Tensor, got list"):
        cache.flush(slots)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(cache, before))


def test_docstring_examples():
    assert doctest.testmod(replay_cache, raise_on_error=False).failed == 0


def test_registered_as_mutating_op():
    schema = str(torch.ops.fastmamba.replay_selective_state_update_.default._schema)
    for name in ("state", "old_x", "old_B", "old_dt", "old_cumA", "out"):
        assert re.search(rf"Tensor\(\w+!\) {name}\b", schema), f"`{name}` must be declared mutated: {schema}"


# ---- bad input: clear errors, nothing written ------------------------------------------------

def _bad(mutate, match, exc):
    cache, inp, _ = make_inputs(BASE, "cpu", seed=5)
    before = _clone(cache)
    args = dict(zip(ReplayCache._fields, cache), **inp)
    mutate(args)
    with pytest.raises(exc, match=match):
        replay_selective_state_update(**args)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(cache, before))


@pytest.mark.parametrize("mutate,match,exc", [
    (lambda a: a.update(x=a["x"][:, 0]), r"`x` expected shape \(B, T, H, P\)", ValueError),
    (lambda a: a.update(x=torch.randn(3, 9, 4, 12), z=None, B=torch.randn(3, 9, 2, 10), C=torch.randn(3, 9, 2, 10),
                        dt=torch.randn(3, 9, 4)), r"`x` has T=9 tokens .* history holds C_h=8", ValueError),
    (lambda a: a.update(old_B=a["old_B"][:, :, :, :1]), r"`old_B` expected shape \(buffers=2, S=7, C_h=8, G=2, N=10\)",
     ValueError),
    (lambda a: a.update(hist_len=a["hist_len"].float()), r"`hist_len` expected dtype", TypeError),
    (lambda a: a.update(old_dt=a["old_dt"].bfloat16()), r"`old_dt` expected dtype in \(float32\)", TypeError),
    (lambda a: a.update(prev_accepted=a["prev_accepted"].float()), r"`prev_accepted` expected dtype", TypeError),
    (lambda a: a.update(buf_idx=a["buf_idx"][:3]), r"`buf_idx` expected shape \(S=7\)", ValueError),
    (lambda a: a.update(old_x=a["old_x"].half()), r"`old_x` has dtype float16", TypeError),
    (lambda a: a.update(B=a["B"].half()), r"`B` has dtype float16", TypeError),
    (lambda a: a.update(B=torch.randn(3, 3, 3, 10), C=torch.randn(3, 3, 3, 10)), r"G=3 .* must divide .* H=4",
     ValueError),
    (lambda a: a.update(state_batch_indices=torch.tensor([0, 9, -1], dtype=torch.int32)), r"\[0, 7\).*\[9\]",
     ValueError),
    (lambda a: a.update(A=torch.randn(4, 12, 10)), r"`A` must hold one value per head \(tie-hdim", ValueError),
    (lambda a: a.update(dt=torch.randn(3, 3, 4, 12)), r"`dt` must hold one value per head \(tie-hdim", ValueError),
    (lambda a: a.update(D=torch.randn(4, 12)), r"`D` must hold one value per head", ValueError),
    (lambda a: a.update(z=a["z"][:1]), r"`z` expected shape", ValueError),
    (lambda a: a.update(out=torch.empty(3, 3, 4, 12, dtype=torch.float16)), r"`out` has dtype float16", TypeError),
    (lambda a: a.update(rand_seed=torch.tensor([1, 2])), r"`rand_seed` must hold one element", ValueError),
    (lambda a: a.update(dt=a["dt"].to("meta")), r"`dt` is on meta", ValueError),
    (lambda a: a.update(x=None), r"`x` expected a torch.Tensor, got NoneType", TypeError),
    (lambda a: a.update(D=a["D"].long()), r"`D` expected dtype", TypeError),
    (lambda a: a.update(dt_bias=a["dt_bias"].int()), r"`dt_bias` expected dtype", TypeError),
    (lambda a: a.update(pad_slot_id=0.5), r"`pad_slot_id` expected an int, got float", TypeError),
    (lambda a: a.update(dt_softplus="yes"), r"`dt_softplus` expected a bool, got str", TypeError),
], ids=["x-rank", "T-over-history", "old_B-G", "hist_len-dtype", "old_dt-dtype", "prev_accepted-dtype", "buf_idx-shape", "old_x-dtype",
        "B-dtype", "G-divides-H", "slot-range", "A-untied", "dt-untied", "D-untied", "z-shape", "out-dtype", "seed",
        "device", "x-None", "D-int", "dt_bias-int", "pad-float", "softplus-str"])
def test_bad_input(mutate, match, exc):
    _bad(mutate, match, exc)


# ---- GPU: the mamba2-2.7b shape -------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_gpu_mamba2_2p7b(state_dtype, path):
    c = Case("mamba2-2.7b-T6", batch=8, tokens=6, heads=80, headdim=64, dstate=128, groups=1, act=torch.bfloat16,
             state_dtype=state_dtype, history=32, accepted=(0, 1, 6, 3, 2, 6, 5, 4), hist=(0, 25, 20, 26, 8, 0, 21, 10),
             bufs=(0, 1, 0, 1, 1, 0, 0, 1))  # requests 1, 3, 6 store their state (k + 6 > 32)
    cache, inp, _ = make_inputs(c, "cuda", seed=7)
    ref = _clone(cache)
    out = nan_like(inp["x"])
    seed = torch.tensor([3], device="cuda") if state_dtype != torch.float32 else None
    with kernel_path(path, "cuda"):
        replay_selective_state_update(*cache, **inp, out=out, rand_seed=seed)
    y_ref = replay_selective_state_update_ref(*ref, **inp)
    torch.testing.assert_close(out.float(), y_ref.float(), **tol(torch.bfloat16))
    torch.testing.assert_close(cache.state.float(), ref.state.float(), **tol(torch.bfloat16, state_dtype))
    assert torch.equal(_bits(cache.old_x), _bits(ref.old_x)) and torch.equal(_bits(cache.old_B), _bits(ref.old_B))
    torch.testing.assert_close(cache.old_cumA, ref.old_cumA, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_gpu_mamba2_2p7b_equals_plain_decoding(path):
    c = Case("mamba2-2.7b-equivalence", batch=8, tokens=6, heads=80, headdim=64, dstate=128, groups=1,
             act=torch.bfloat16, slots="shuffled", history=16)
    steps = [[1, 6, 2, 0, 3, 5, 4, 6], [6, 1, 1, 2, 0, 3, 6, 5], [2, 3, 6, 6, 1, 0, 2, 1]]
    _equivalence(c, steps, "cuda", seed=22, path=path)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_gpu_bf16_outputs_round_like_plain_decoding(path):
    """bf16 activations: the replay's outputs (split bf16 tensor-core dots, ~16 mantissa bits per
    operand) round to the same bf16 values as plain token-by-token decoding (fp32 CUDA-core math)
    for nearly every element, so greedy speculative decoding follows plain greedy decoding."""
    g = torch.Generator().manual_seed(23)
    B, T, H, P, G, N, S = 8, 6, 80, 64, 1, 128, 17
    dev = "cuda"
    slots = torch.randperm(S, generator=g)[:B].to(torch.int32).to(dev)
    A = (-torch.exp(torch.randn(H, generator=g) * 0.5)).to(dev)
    D, dt_bias = torch.randn(H, generator=g).to(dev), (torch.randn(H, generator=g) * 0.5).to(dev)
    cache = allocate_replay_cache(S, T, H, P, G, N, torch.float32, torch.bfloat16, dev)
    cache.state.copy_(torch.randn(S, H, P, N, generator=g) * 0.3)
    plain_state = cache.state.clone()
    equal = total = 0
    for step in range(6):
        x = torch.randn(B, T, H, P, generator=g).bfloat16().to(dev)
        dt = (torch.randn(B, T, H, generator=g) - 3.0).to(dev)
        Bm = (torch.randn(B, T, G, N, generator=g) * 0.3).bfloat16().to(dev)
        Cm = (torch.randn(B, T, G, N, generator=g) * 0.3).bfloat16().to(dev)
        z = torch.randn(B, T, H, P, generator=g).bfloat16().to(dev)
        acc = torch.randint(1, T + 1, (B,), generator=g, dtype=torch.int32).to(dev)
        with kernel_path(path, dev):
            y = replay_selective_state_update(*cache, x, dt, A, Bm, Cm, D, z, dt_bias, True, slots)
        for t in range(T):
            rows = torch.where(acc > t, slots, torch.full_like(slots, -1))
            y_t = selective_state_update(plain_state, x[:, t], dt[:, t], A, Bm[:, t], Cm[:, t], D, z[:, t], dt_bias,
                                         True, rows)
            keep = acc > t
            equal += int((y[keep, t] == y_t[keep]).sum())
            total += y_t[keep].numel()
            torch.testing.assert_close(y[keep, t].float(), y_t[keep].float(), **tol(torch.bfloat16))
        cache.commit(slots, acc, T)
    print(f"{equal / total:.2%} of the outputs round like plain decoding")  # shown with pytest -s
    assert equal / total >= 0.97, f"only {equal / total:.2%} of the outputs round like plain decoding"


@pytest.mark.gpu
def test_gpu_fp32_state_takes_the_tma_output_kernel():
    """The split-path tests above run the TMA output kernel for their fp32-state cases (and
    'split-notma' the other): it applies to contiguous tensors with P a multiple of the tile and a
    power-of-two N, and not to a strided x."""
    from fastmamba.ops.replay.out_kernel import out_tma_usable

    S, B, T, H, P, G, N, Ch = 17, 8, 6, 80, 64, 1, 128, 32
    state = torch.zeros(S, H, P, N, device="cuda")
    old_x = torch.zeros(S, Ch, H, P, device="cuda", dtype=torch.bfloat16)
    x = torch.zeros(B, T, H, P, device="cuda", dtype=torch.bfloat16)
    C = torch.zeros(B, T, G, N, device="cuda", dtype=torch.bfloat16)
    assert replay_configs.OUT_TMA is not None
    assert out_tma_usable(state, old_x, x, x, C, 64)
    assert not out_tma_usable(state, old_x, torch.zeros(B, T, H, 2 * P, device="cuda", dtype=torch.bfloat16)[..., :P],
                              None, C, 64)
    assert not out_tma_usable(state.half(), old_x, x, x, C, 64)


@pytest.mark.gpu
def test_gpu_bf16_activations_take_the_tma_checkpoint_kernel():
    """The split-path tests above run the TMA checkpoint kernel for their bf16-activation cases
    ('split-notma' the pointer one): it applies to contiguous tensors with P a multiple of its
    tile, a power-of-two N and a history of up to 64 positions, for every state dtype."""
    from fastmamba.ops.replay.checkpoint_kernel import checkpoint_tma_usable

    S, B, T, H, P, G, N, Ch = 17, 8, 6, 80, 64, 1, 128, 32
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    old_x = torch.zeros(S, Ch, H, P, **bf16)
    old_B = torch.zeros(2, S, Ch, G, N, **bf16)
    x = torch.zeros(B, T, H, P, **bf16)
    assert replay_configs.CKPT_TMA is not None
    block_p = replay_configs.CKPT_TMA["block_p"]
    for state_dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert checkpoint_tma_usable(torch.zeros(S, H, P, N, device="cuda", dtype=state_dtype), old_x, old_B, x, block_p)
    state = torch.zeros(S, H, P, N, device="cuda")
    strided_x = torch.zeros(B, T, H, 2 * P, **bf16)[..., :P]
    assert not checkpoint_tma_usable(state, old_x, old_B, strided_x, block_p)
    assert not checkpoint_tma_usable(state, old_x, old_B, x.float(), block_p)  # fp32 activations
    long_x, long_B = torch.zeros(S, 128, H, P, **bf16), torch.zeros(2, S, 128, G, N, **bf16)
    assert not checkpoint_tma_usable(state, long_x, long_B, x, block_p)  # history past 64
    assert replay_configs.checkpoint_tma_programs_per_sm(24) == replay_configs.CKPT_TMA_PROGRAMS[32]


@pytest.mark.parametrize("case", FLUSH_CASES[:2], ids=lambda c: c.id)
def test_flush_torch_path_matches_reference(case, monkeypatch):
    """The plain-torch flush (a CPU without the interpreter) against the reference."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cache, _, slots = make_inputs(case, "cpu", seed=12)
    ref = _clone(cache)
    idx = torch.tensor(slots + [-1], dtype=torch.int32)
    flush_replay_cache(cache, idx)
    flush_ref(*ref, idx)
    torch.testing.assert_close(cache.state, ref.state, **tol(torch.float32))
    assert torch.equal(cache.hist_len, ref.hist_len) and torch.equal(cache.prev_accepted, ref.prev_accepted)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_reset_history_zeroes_listed_slots_only(slot_dtype, device):
    """hist_len = prev_accepted = 0 at the live listed slots (one kernel on a GPU / the
    interpreter); pad rows and slots outside [0, S) write nothing, other slots keep their counters."""
    g = torch.Generator().manual_seed(13)
    S = 37
    cache = allocate_replay_cache(S, 2, 2, 16, 1, 16, torch.float32, torch.float32, device)
    cache.hist_len.copy_(torch.randint(1, 9, (S,), generator=g, dtype=torch.int32))
    cache.prev_accepted.copy_(torch.randint(1, 4, (S,), generator=g, dtype=torch.int32))
    hist0, prev0 = cache.hist_len.clone(), cache.prev_accepted.clone()
    listed = [5, -1, 0, 36, 40, 17]  # a pad row and a slot past the end
    replay_cache.reset_history(cache, torch.tensor(listed, dtype=slot_dtype, device=device))
    live = [5, 0, 36, 17]
    others = [s for s in range(S) if s not in live]
    assert cache.hist_len[live].tolist() == [0] * 4 and cache.prev_accepted[live].tolist() == [0] * 4
    assert torch.equal(cache.hist_len[others], hist0[others]) and torch.equal(cache.prev_accepted[others], prev0[others])
