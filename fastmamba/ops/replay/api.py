"""Public entry of the replay state update: the per-slot cache, checks, the registered op, commit."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from fastmamba.ops._common.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    capturing,
    check_dtype,
    check_indices,
    check_same_device,
    check_same_dtype,
    check_shape,
)
from fastmamba.ops._common.dispatch import interpreter_enabled, use_triton
from fastmamba.ops.replay.configs import pick_config
from fastmamba.ops.replay.kernel import launch_replay_main, launch_replay_precompute
from fastmamba.ops.replay.ref import replay_selective_state_update_ref

OP = "replay_selective_state_update"


class ReplayCache(NamedTuple):
    """The per-slot buffers of replay-based speculative verification, in the op's argument order
    (``replay_selective_state_update(*cache, x, dt, ...)``).

    state          [S, H, P, N]     committed state as of the start of the previous step
    old_x          [S, T, H, P]     the previous step's x (activation dtype)
    old_B          [2, S, T, G, N]  its B (activation dtype), double-buffered
    old_dt         [2, S, T, H]     its dt' = softplus(dt + dt_bias), fp32, double-buffered
    old_cumA       [2, S, T, H]     its cumulative sum of A dt', fp32, double-buffered
    buf_idx        [S] int32        which buffer holds the previous step's B / dt' / cumA
    prev_accepted  [S] int32        how many of the previous step's T tokens were accepted (0..T)
    """

    state: torch.Tensor
    old_x: torch.Tensor
    old_B: torch.Tensor
    old_dt: torch.Tensor
    old_cumA: torch.Tensor
    buf_idx: torch.Tensor
    prev_accepted: torch.Tensor

    @property
    def tokens(self) -> int:
        """T, the tokens verified per step that the cache was allocated for."""
        return self.old_x.shape[1]

    def commit(self, slots: torch.Tensor, accepted: torch.Tensor, *, pad_slot_id: int = -1) -> None:
        """Record the step's acceptance for ``slots`` (see :func:`commit_accepted`)."""
        commit_accepted(self.buf_idx, self.prev_accepted, slots, accepted, pad_slot_id=pad_slot_id,
                        max_accepted=self.tokens)


def allocate_replay_cache(
    S: int, T: int, H: int, P: int, G: int, N: int,
    state_dtype: torch.dtype, act_dtype: torch.dtype, device: torch.device | str,
) -> ReplayCache:
    """Zero-initialised replay cache for S slots verifying T tokens per step.

    Every slot starts fresh: state 0, prev_accepted 0 (nothing to replay), buf_idx 0. A prefill
    that writes a slot's state must also set its prev_accepted to 0 (e.g. ``commit`` with 0).
    """
    def zeros(*shape, dtype):
        return torch.zeros(*shape, dtype=dtype, device=device)

    return ReplayCache(
        state=zeros(S, H, P, N, dtype=state_dtype),
        old_x=zeros(S, T, H, P, dtype=act_dtype),
        old_B=zeros(2, S, T, G, N, dtype=act_dtype),
        old_dt=zeros(2, S, T, H, dtype=torch.float32),
        old_cumA=zeros(2, S, T, H, dtype=torch.float32),
        buf_idx=zeros(S, dtype=torch.int32),
        prev_accepted=zeros(S, dtype=torch.int32),
    )


def commit_accepted(
    buf_idx: torch.Tensor,
    prev_accepted: torch.Tensor,
    slots: torch.Tensor,
    accepted: torch.Tensor,
    *,
    pad_slot_id: int = -1,
    max_accepted: int | None = None,
) -> None:
    """Commit a verification step: for each non-pad ``slots[b]``, flip ``buf_idx`` (the step's
    B / dt' / cumA went to the other buffer) and set ``prev_accepted`` to ``accepted[b]``.

    buf_idx, prev_accepted  [S] int32/int64, mutated in place at the given slots only
    slots                   [B] int32/int64, the step's ``state_batch_indices``; pad_slot_id rows skipped
    accepted                [B] integer, tokens accepted per request, in 0..T (0: none; the next step
                            then replays nothing and the committed state stays as it is)
    max_accepted            T: when given, ``accepted`` is range-checked on the host (one sync),
                            except while a CUDA graph is being captured

    Must run once for every slot of every replay call, before the next call on that slot: the
    call overwrote ``old_x``, so an uncommitted step cannot be replayed again. Plain torch ops,
    no host sync of their own; two requests must not share a slot.

    >>> buf_idx, prev_accepted = torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    >>> commit_accepted(buf_idx, prev_accepted, torch.tensor([2, -1]), torch.tensor([3, 1]))
    >>> buf_idx.tolist(), prev_accepted.tolist()
    ([0, 0, 1, 0], [0, 0, 3, 0])
    """
    op = "commit_accepted"
    check_dtype(op, "buf_idx", buf_idx, INDEX_DTYPES)
    check_dtype(op, "prev_accepted", prev_accepted, INDEX_DTYPES)
    nslots = buf_idx.shape[0]
    check_shape(op, "prev_accepted", prev_accepted, [("S", nslots)])
    check_indices(op, "slots", slots, slots.shape[0], nslots, pad_slot_id)
    check_shape(op, "accepted", accepted, [("B", slots.shape[0])])
    if accepted.dtype.is_floating_point or accepted.dtype.is_complex:
        raise TypeError(f"{op}: `accepted` expected an integer dtype, got {str(accepted.dtype).replace('torch.', '')}")
    if max_accepted is not None and not capturing(accepted):
        bad = (accepted < 0) | (accepted > max_accepted)
        if bool(bad.any()):
            raise ValueError(f"{op}: `accepted` values must lie in [0, {max_accepted}]; got {accepted[bad][:4].tolist()}")
    # pad rows go to a scratch element past the end, so no boolean indexing (and no sync) is needed
    dest = torch.where(slots == pad_slot_id, torch.full_like(slots, nslots), slots).long()
    flipped = torch.cat([buf_idx, buf_idx.new_zeros(1)])
    flipped.index_copy_(0, dest, 1 - flipped[dest])
    buf_idx.copy_(flipped[:nslots])
    counts = torch.cat([prev_accepted, prev_accepted.new_zeros(1)])
    counts.index_copy_(0, dest, accepted.to(counts.dtype))
    prev_accepted.copy_(counts[:nslots])


def _per_head(name: str, t: torch.Tensor | None, shapes: list[list[tuple[str, int]]]) -> torch.Tensor | None:
    """A / D / dt_bias / dt: accept the per-head shape or an extension tied (stride 0 or extent 1)
    over the trailing dims; return the per-head view. Untied values raise the tie-hdim error."""
    if t is None:
        return None
    per_head, full = shapes
    if t.dim() == len(per_head):
        check_shape(OP, name, t, per_head)
        return t
    check_shape(OP, name, t, full)
    trailing = range(len(per_head), len(full))
    if not all(t.size(d) == 1 or t.stride(d) == 0 for d in trailing):
        dims = "".join(k for k, _ in full[len(per_head):])
        raise ValueError(
            f"{OP}: `{name}` must hold one value per head (tie-hdim: A, dt, dt_bias and D are per head, as "
            f"Mamba-2 has them); got shape {tuple(t.shape)} with strides {tuple(t.stride())}, which varies over "
            f"{dims}. Pass the per-head tensor or a stride-0 broadcast of it"
        )
    return t[(Ellipsis,) + (0,) * len(trailing)]


# Registered so torch.compile and CUDA-graph capture see the in-place writes. The schema is
# inferred from these annotations (typing.Optional, which every supported torch version reads).
@torch.library.custom_op(
    "fastmamba::replay_selective_state_update_",
    mutates_args=("state", "old_x", "old_B", "old_dt", "old_cumA", "out"),
)
def _replay_op(
    state: torch.Tensor,
    old_x: torch.Tensor,
    old_B: torch.Tensor,
    old_dt: torch.Tensor,
    old_cumA: torch.Tensor,
    buf_idx: torch.Tensor,
    prev_accepted: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor],
    z: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor],
    dt_softplus: bool,
    state_batch_indices: Optional[torch.Tensor],
    pad_slot_id: int,
    out: torch.Tensor,
    rand_seed: Optional[torch.Tensor],
) -> None:
    """In-place op on checked inputs with per-head A, D, dt_bias ([H]) and dt ([B, T, H])."""
    if not use_triton(x):
        replay_selective_state_update_ref(
            state, old_x, old_B, old_dt, old_cumA, buf_idx, prev_accepted, x, dt, A, B, C, D, z, dt_bias,
            dt_softplus, state_batch_indices, pad_slot_id=pad_slot_id, out=out,
        )
        return
    nreq, ntok, nheads, headdim = x.shape
    cfg = pick_config(
        programs_per_block=nreq * nheads, headdim=headdim, dstate=B.shape[-1],
        t_pad=max(16, 1 << (ntok - 1).bit_length()), interpreter=interpreter_enabled(),
        act_bytes=x.element_size(),
    )
    M = torch.empty(nreq, nheads, ntok, ntok, dtype=torch.float32, device=x.device)  # per-call scratch
    launch_replay_precompute(
        dt, dt_bias, A, B, C, state_batch_indices, buf_idx, M, old_B, old_dt, old_cumA,
        dt_softplus=dt_softplus, pad_slot_id=pad_slot_id, heads=cfg.heads, num_warps=cfg.warps_pre,
    )
    launch_replay_main(
        state, old_x, old_B, old_dt, old_cumA, buf_idx, prev_accepted, x, C, D, z, M, out,
        state_batch_indices, rand_seed, pad_slot_id=pad_slot_id, block_p=cfg.block_p, num_warps=cfg.num_warps,
    )


@_replay_op.register_fake
def _(*args, **kwargs) -> None:
    return None


def replay_selective_state_update(
    state: torch.Tensor,
    old_x: torch.Tensor,
    old_B: torch.Tensor,
    old_dt: torch.Tensor,
    old_cumA: torch.Tensor,
    buf_idx: torch.Tensor,
    prev_accepted: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    state_batch_indices: torch.Tensor | None = None,
    *,
    pad_slot_id: int = -1,
    out: torch.Tensor | None = None,
    rand_seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Verify T = K+1 tokens per request with replay-based rollback (the TensorRT-LLM design).

    Instead of a state per draft position, each slot keeps the committed state from the start of
    the previous step, that step's inputs and how many of its tokens were accepted. A call
    (1) replays the accepted old tokens onto the committed state and stores it, (2) computes the
    T new outputs from it without materialising per-token states, (3) records the new inputs.
    After ``commit_accepted`` with ``a`` accepted tokens, the next call's stored state equals a
    plain token-by-token ``selective_state_update`` over exactly the accepted tokens.

    The cache (``ReplayCache`` / ``allocate_replay_cache``), per slot; rows of the requests'
    slots are used, other rows are not touched:
    state         [S, H, P, N]     fp32, bf16 or fp16; mutated: the replayed (committed) state is
                                   stored when prev_accepted > 0
    old_x         [S, T, H, P]     x's dtype; read (replay), then overwritten with this step's x
    old_B         [2, S, T, G, N]  B's dtype; buffer buf_idx read, buffer 1 - buf_idx written
    old_dt        [2, S, T, H]     fp32 dt' (bias and softplus applied); same double buffering
    old_cumA      [2, S, T, H]     fp32 cumulative sum of A dt' over the step; same double buffering
    buf_idx       [S] int32/int64  0/1; read only
    prev_accepted [S] int32/int64  read only; must lie in 0..T (the caller's job: commit_accepted
                                   checks it; the kernel clamps out-of-range values to 0..T)

    This step's inputs (T must equal the cache's T):
    x             [B, T, H, P]     fp32, bf16 or fp16, any strides; y has the same shape and dtype
    dt            [B, T, H] raw (or [B, T, H, P] stride-0 over P); dt' = softplus(dt + dt_bias)
                                   if dt_softplus, else dt + dt_bias
    A             [H] fp32 (= -exp(A_log)), or an [H, P, N] stride-0 broadcast of it
    B, C          [B, T, G, N]     x's dtype; G divides H, head h reads group h // (H // G)
    D, dt_bias    [H] (or [H, P] stride-0 over P) or None;   z like x or None (y *= silu(z))
    state_batch_indices [B] int32/int64 or None (slot b); rows equal to ``pad_slot_id`` get y = 0
                        and touch nothing. Two requests must not share a slot.
    rand_seed     one-element int64 tensor on x's device or None: with a 16-bit state, the stored
                  state is rounded stochastically (advance it every step); else round to nearest
    out           like x, or None (allocated contiguous)

    A, dt, dt_bias and D must be per head (tie-hdim); values that vary over P or N are refused.
    The outputs are computed from the fp32 replayed state (before it is rounded for storage).
    buf_idx and prev_accepted are not written: after acceptance is known, call
    ``commit_accepted`` (or ``ReplayCache.commit``) for every slot of the call, accepted may be 0.
    A fresh slot (state from prefill) needs prev_accepted = 0. The outputs of token t depend on
    tokens 0..t of this step only, so the accepted tokens' outputs are final.

    Returns y [B, T, H, P] (``out`` when given).
    Reference: ``fastmamba.ops.replay.ref.replay_selective_state_update_ref``.
    """
    check_dtype(OP, "x", x, FLOAT_DTYPES)
    check_dtype(OP, "state", state, FLOAT_DTYPES)
    if x.dim() != 4:
        raise ValueError(f"{OP}: `x` expected shape (B, T, H, P), got {tuple(x.shape)}")
    nreq, ntok, nheads, headdim = x.shape
    check_shape(OP, "state", state, [("S", None), ("H", nheads), ("P", headdim), ("N", None)])
    nslots, dstate = state.shape[0], state.shape[3]

    if old_x.dim() == 4 and old_x.shape[1] != ntok:
        raise ValueError(
            f"{OP}: `x` has T={ntok} tokens per request but the replay cache holds T={old_x.shape[1]} "
            f"(`old_x` shape {tuple(old_x.shape)}); allocate the cache for the number of tokens verified per step"
        )
    check_shape(OP, "old_x", old_x, [("S", nslots), ("T", ntok), ("H", nheads), ("P", headdim)])
    check_shape(OP, "B", B, [("B", nreq), ("T", ntok), ("G", None), ("N", dstate)])
    ngroups = B.shape[2]
    check_shape(OP, "C", C, [("B", nreq), ("T", ntok), ("G", ngroups), ("N", dstate)])
    if nheads % ngroups != 0:
        raise ValueError(f"{OP}: the number of groups G={ngroups} (from `B`) must divide the number of heads H={nheads}")
    check_shape(OP, "old_B", old_B, [("buffers", 2), ("S", nslots), ("T", ntok), ("G", ngroups), ("N", dstate)])
    for name, t in (("old_dt", old_dt), ("old_cumA", old_cumA)):
        check_shape(OP, name, t, [("buffers", 2), ("S", nslots), ("T", ntok), ("H", nheads)])
        check_dtype(OP, name, t, (torch.float32,))
    for name, t in (("buf_idx", buf_idx), ("prev_accepted", prev_accepted)):
        check_shape(OP, name, t, [("S", nslots)])
        check_dtype(OP, name, t, INDEX_DTYPES)
    check_same_dtype(OP, [("x", x), ("B", B), ("C", C), ("old_x", old_x), ("old_B", old_B)]
                     + ([("z", z)] if z is not None else []))

    dt = _per_head("dt", dt, [[("B", nreq), ("T", ntok), ("H", nheads)],
                              [("B", nreq), ("T", ntok), ("H", nheads), ("P", headdim)]])
    check_dtype(OP, "dt", dt, FLOAT_DTYPES)
    A = _per_head("A", A, [[("H", nheads)], [("H", nheads), ("P", headdim), ("N", dstate)]])
    check_dtype(OP, "A", A, FLOAT_DTYPES)
    D = _per_head("D", D, [[("H", nheads)], [("H", nheads), ("P", headdim)]])
    dt_bias = _per_head("dt_bias", dt_bias, [[("H", nheads)], [("H", nheads), ("P", headdim)]])
    if z is not None:
        check_shape(OP, "z", z, [(k, v) for k, v in zip("BTHP", x.shape)])

    check_same_device(OP, [("x", x), ("state", state), ("old_x", old_x), ("old_B", old_B), ("old_dt", old_dt),
                           ("old_cumA", old_cumA), ("buf_idx", buf_idx), ("prev_accepted", prev_accepted),
                           ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z), ("dt_bias", dt_bias),
                           ("state_batch_indices", state_batch_indices), ("rand_seed", rand_seed), ("out", out)])
    if state_batch_indices is not None:
        check_indices(OP, "state_batch_indices", state_batch_indices, nreq, nslots, pad_slot_id)
    elif nslots < nreq:
        raise ValueError(f"{OP}: without state_batch_indices, `state` needs at least B={nreq} rows, got {nslots}")
    if rand_seed is not None:
        check_dtype(OP, "rand_seed", rand_seed, (torch.int64,))
        if rand_seed.numel() != 1:
            raise ValueError(f"{OP}: `rand_seed` must hold one element, got shape {tuple(rand_seed.shape)}")
        if state.dtype == torch.float32:
            rand_seed = None  # nothing to round: fp32 state is stored exactly

    if out is None:  # contiguous whatever x's strides
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        check_shape(OP, "out", out, [(k, v) for k, v in zip("BTHP", x.shape)])
        check_same_dtype(OP, [("x", x), ("out", out)])

    _replay_op(
        state, old_x, old_B, old_dt, old_cumA, buf_idx, prev_accepted, x, dt, A, B, C, D, z, dt_bias,
        bool(dt_softplus), state_batch_indices, int(pad_slot_id), out, rand_seed,
    )
    return out
