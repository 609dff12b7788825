"""Public entry of the replay state update: checks, the registered op and its launch plan. The
per-slot cache and its bookkeeping (allocate, commit, reset, flush): ``cache.py``."""
from __future__ import annotations

from typing import Optional

import torch

from fastmamba.ops._common import slot_errors
from fastmamba.ops._common.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dtype,
    check_indices,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensors,
    check_int,
    check_flag,
)
from fastmamba.ops._common.dispatch import call_directly, interpreter_enabled, use_triton
from fastmamba.ops._common.host_math import cdiv
from fastmamba.ops._common.pdl import pdl_active, pdl_supported, sm_count
from fastmamba.ops.replay import configs
from fastmamba.ops.replay.configs import pick_config
from fastmamba.ops.replay.checkpoint_kernel import (
    checkpoint_tma_usable,
    launch_replay_checkpoint,
    launch_replay_checkpoint_tma,
)
from fastmamba.ops.replay.kernel import launch_replay_main, launch_replay_precompute
from fastmamba.ops.replay.kernel_common import dot_dim
from fastmamba.ops.replay.out_kernel import launch_replay_out, launch_replay_out_tma, out_tma_usable
from fastmamba.ops.replay.ref import replay_selective_state_update_ref

OP = "replay_selective_state_update"


# Tests of the device check without a GPU: CPU indices (under the interpreter) checked on the
# device too; a real CPU run reads them on the host (no synchronize there).
DEVICE_CHECK_CPU = False
slot_errors.NAMES["replay_selective_state_update"] = ("state_batch_indices",)


def _device_check(t: torch.Tensor | None) -> bool:
    """Whether a call checks ``t``'s index values on the device (recorded, raised at the op's next
    call: ops/_common/slot_errors.py) instead of reading them on the host: eager GPU tensors."""
    return slot_errors.checked_on_device(t, DEVICE_CHECK_CPU)


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
def _replay_impl(
    state: torch.Tensor,
    old_x: torch.Tensor,
    old_B: torch.Tensor,
    old_dt: torch.Tensor,
    old_cumA: torch.Tensor,
    buf_idx: torch.Tensor,
    prev_accepted: torch.Tensor,
    hist_len: torch.Tensor,
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
    A_is_log: bool,
) -> None:
    """In-place op on checked inputs with per-head A, D, dt_bias ([H]) and dt ([B, T, H])."""
    if not use_triton(x):
        replay_selective_state_update_ref(
            state, old_x, old_B, old_dt, old_cumA, buf_idx, prev_accepted, hist_len, x, dt, A, B, C, D, z, dt_bias,
            dt_softplus, state_batch_indices, pad_slot_id=pad_slot_id, out=out, A_is_log=A_is_log,
        )
        return
    nreq, ntok, nheads, headdim = x.shape
    cfg = pick_config(
        programs_per_block=nreq * nheads, headdim=headdim, dstate=B.shape[-1],
        t_pad=configs.padded_tokens(ntok), interpreter=interpreter_enabled(),
        act_bytes=x.element_size(), state_bytes=state.element_size(),
    )
    ngroups = B.shape[2]
    pre_programs = nreq * ngroups * -(-(nheads // ngroups) // cfg.heads)
    main_programs = cdiv(headdim, cfg.block_p) * nreq * nheads
    # The split path (large batches): the output kernel produces every request's outputs straight
    # from the stored state (and records x where no state is stored); then the checkpoint kernel,
    # on a persistent grid, replays and stores the state of the requests that store it this step,
    # from the list the precompute kernel makes. Its per-call scratch: C . B products per group (Q),
    # each head's decay factors, cs and dt' (scale), the list and its length, C in fp16 for an fp16 state, and
    # (without PDL, configs.CHAIN_PDL) each request's history length k.
    Q = scale = kinfo = C16 = ckpt_count = ckpt_list = None
    chain_pdl = configs.CHAIN_PDL and pdl_supported(x)
    out_tma = cfg.split and configs.OUT_TMA is not None and out_tma_usable(state, old_x, x, z, C, cfg.out_block_p)
    # M, per-call scratch: per head [B, H, T, T] for the main kernel and the TMA output kernel; the
    # one-tile output kernel (group_cb) builds it itself from C . B^T per group [B, G, T, T] and
    # each head's cs and dt' (2T more per scale row). H200, Nemotron-H batch 128, fp16 state, step
    # T=2 / 6 / 16: 131.3 / 154.6 / 228.8 -> 129.9 / 155.5 / 221.0 us; the TMA output kernel of an
    # fp32 state keeps the per-head M (built there: T=16 295.2 -> 304.9 us)
    group_cb = cfg.split and not out_tma
    M = torch.empty(nreq, ngroups if group_cb else nheads, ntok, ntok, dtype=torch.float32, device=x.device)
    if cfg.split:
        Q = torch.empty(nreq, ngroups, ntok, old_x.shape[1], dtype=torch.float32, device=x.device)
        scale = torch.empty(nreq, nheads, (3 if group_cb else 1) * ntok + 1 + old_x.shape[1],
                            dtype=torch.float32, device=x.device)
        # the history lengths k as the precompute kernel recorded them: read by the output kernel
        # without PDL, or by its TMA variant always (after its wait)
        kinfo = None if chain_pdl and not out_tma else torch.empty(nreq, dtype=torch.int32, device=x.device)
        if state.dtype == torch.float16 and C.dtype == torch.bfloat16 and not interpreter_enabled():
            # bf16 C meets an fp16 state on 16-bit tensor cores: converted once per group
            # (the precompute kernel writes it as [B, G, its BLOCK_T, its BLOCK_N])
            C16 = torch.empty(nreq, ngroups, dot_dim(ntok), dot_dim(B.shape[3]),
                              dtype=torch.float16, device=x.device)
        ckpt_count = torch.zeros(1, dtype=torch.int32, device=x.device)
        ckpt_list = torch.empty(nreq, 4, dtype=torch.int32, device=x.device)
    launch_replay_precompute(
        dt, dt_bias, A, B, C, state_batch_indices, buf_idx, prev_accepted, hist_len, M, old_B, old_dt, old_cumA,
        Q, scale, kinfo, C16, ckpt_count, ckpt_list,
        dt_softplus=dt_softplus, pad_slot_id=pad_slot_id, heads=cfg.heads, num_warps=cfg.warps_pre,
        use_pdl=pdl_active(x, pre_programs, cfg.warps_pre), launch_dependents=cfg.split and chain_pdl,
        group_cb=group_cb, A_is_log=A_is_log,
    )
    if not cfg.split:
        launch_replay_main(
            state, old_x, old_B, old_dt, old_cumA, buf_idx, prev_accepted, hist_len, x, C, D, z, M, out,
            state_batch_indices, rand_seed, pad_slot_id=pad_slot_id, block_p=cfg.block_p, num_warps=cfg.num_warps,
            use_pdl=pdl_active(x, main_programs, cfg.num_warps),
        )
        return
    if out_tma:
        launch_replay_out_tma(
            state, old_x, kinfo, scale, x, C, D, z, M, Q, out, state_batch_indices, pad_slot_id=pad_slot_id,
            block_p=cfg.out_block_p, num_warps=cfg.out_warps, programs=sm_count(x) * configs.OUT_TMA["programs_per_sm"],
            stages=configs.OUT_TMA["stages"], maxnreg=configs.OUT_TMA["maxnreg"],
            # not a dependent of the precompute kernel: its programs would take every SM's registers
            # while they wait, keeping the precompute kernel's later programs out
            use_pdl=chain_pdl and bool(configs.OUT_TMA.get("pdl_in")), launch_dependents=chain_pdl,
        )
    else:
        launch_replay_out(
            state, old_x, buf_idx, prev_accepted, hist_len, kinfo, scale, x,
            C if C16 is None else C16[:, :, :ntok, :B.shape[3]].transpose(1, 2), D, z, M, Q, out,
            state_batch_indices, pad_slot_id=pad_slot_id, block_p=cfg.out_block_p, num_warps=cfg.out_warps,
            maxnreg=None if interpreter_enabled() else configs.OUT_MAXNREG[4 if state.element_size() >= 4 else 2],
            use_pdl=chain_pdl, launch_dependents=chain_pdl,
        )
    # the checkpoint kernel: TMA-fed where it can be (configs.CKPT_TMA), else with pointer loads
    ck_tma = configs.CKPT_TMA
    if ck_tma is not None and checkpoint_tma_usable(state, old_x, old_B, x, ck_tma["block_p"]):
        launch_replay_checkpoint_tma(
            state, old_x, old_B, old_dt, old_cumA, x, rand_seed, ckpt_count, ckpt_list,
            block_p=ck_tma["block_p"], num_warps=ck_tma["num_warps"],
            programs=min(main_programs, sm_count(x) * configs.checkpoint_tma_programs_per_sm(old_x.shape[1])),
            stages=ck_tma["stages"], maxnreg=ck_tma.get("maxnreg"), use_pdl=chain_pdl,
        )
    else:
        launch_replay_checkpoint(
            state, old_x, old_B, old_dt, old_cumA, x, rand_seed, ckpt_count, ckpt_list,
            block_p=cfg.block_p, num_warps=cfg.num_warps,
            programs=min(main_programs, checkpoint_programs(x, cfg.num_warps)), use_pdl=chain_pdl,
        )


def checkpoint_programs(x: torch.Tensor, num_warps: int) -> int:
    """Programs of the split path's persistent checkpoint kernel: up to 32 warps per SM (fewer
    fit when its registers say so; the rest wait, as in any grid); 4 under the interpreter."""
    return sm_count(x) * max(1, 32 // num_warps) if x.is_cuda else 4


# plain eager calls skip the dispatcher (dispatch.call_directly) and run the same function
_replay_op = torch.library.custom_op(
    "fastmamba::replay_selective_state_update_",
    mutates_args=("state", "old_x", "old_B", "old_dt", "old_cumA", "out"),
)(_replay_impl)


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
    hist_len: torch.Tensor,
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
    A_is_log: bool = False,
) -> torch.Tensor:
    """Verify T = K+1 tokens per request with replay-based rollback (the TensorRT-LLM design),
    storing the state only at checkpoints.

    Instead of a state per draft position, each slot keeps a stored state and the inputs of the
    tokens consumed since (its history, up to C_h tokens): ``hist_len`` tokens accepted in earlier
    steps, then the previous step's tokens, ``prev_accepted`` of them accepted. A call
    (1) replays the k = hist_len + prev_accepted accepted tokens onto the stored state (in
    registers, tensor-core matmuls); (2) stores the result only when this step's T tokens would
    overflow the history (k + T > C_h, then a new history starts in the other buffer), so the
    state is read every step but written once every few; (3) computes the T new outputs without
    materialising per-token states; (4) appends this step's inputs to the history. After
    ``commit_accepted`` with ``a`` accepted tokens, replaying equals a plain token-by-token
    ``selective_state_update`` over exactly the accepted tokens; ``flush_replay_cache`` stores it.

    The cache (``ReplayCache`` / ``allocate_replay_cache``), per slot; rows of the requests'
    slots are used, other rows are not touched:
    state         [S, H, P, N]       fp32, bf16 or fp16; written only at a checkpoint
    old_x         [S, C_h, H, P]     x's dtype; positions < k read, this step's x written at k (or 0)
    old_B         [2, S, C_h, G, N]  B's dtype; buffer buf_idx read, written at k (or buffer
                                     1 - buf_idx at 0 on a checkpoint)
    old_dt        [2, S, C_h, H]     fp32 dt' (bias and softplus applied); same layout
    old_cumA      [2, S, C_h, H]     fp32 cumulative sum of A dt' since the stored state; same layout
    buf_idx, prev_accepted, hist_len  [S] int32/int64; read only (``commit_accepted`` updates
                                     them; prev_accepted <= the previous step's T, and
                                     hist_len + that T <= C_h by construction; the kernels clamp)

    This step's inputs (1 <= T <= C_h):
    x             [B, T, H, P]     fp32, bf16 or fp16, any strides; y has the same shape and dtype
    dt            [B, T, H] raw (or [B, T, H, P] stride-0 over P); dt' = softplus(dt + dt_bias)
                                   if dt_softplus, else dt + dt_bias
    A             [H] fp32 (= -exp(A_log)), or an [H, P, N] stride-0 broadcast of it; with
                  ``A_is_log`` it holds A_log itself (same shapes) and the kernel computes
                  -exp(A_log) in fp32 where it loads it (no cached copy to go stale)
    B, C          [B, T, G, N]     x's dtype; G divides H, head h reads group h // (H // G)
    D, dt_bias    [H] (or [H, P] stride-0 over P) or None;   z like x or None (y *= silu(z))
    state_batch_indices [B] int32/int64 or None (slot b); rows equal to ``pad_slot_id`` get y = 0
                        and touch nothing. Two requests must not share a slot.
    rand_seed     one-element int64 tensor on x's device or None: with a 16-bit state, the stored
                  state is rounded stochastically (advance it every step); else round to nearest
    out           like x, or None (allocated contiguous)

    A, dt, dt_bias and D must be per head (tie-hdim); values that vary over P or N are refused.
    The outputs are computed from the fp32 replayed state (before any rounding for storage). On
    large grids (the split path, ``configs.TABLE``) they come from the stored state plus the
    history's share instead: the same values up to rounding; there a 16-bit state meets C on
    16-bit tensor cores (exact products; with an fp16 state, |C| beyond fp16's 65504 gives inf).
    After acceptance is known, call ``commit_accepted`` (or ``ReplayCache.commit``) with this T
    for every slot of the call (accepted may be 0). A slot whose state was written by something
    else (prefill, plain decode) needs ``reset_history`` first. The outputs of token t depend on
    tokens 0..t of this step only, so the accepted tokens' outputs are final.

    Returns y [B, T, H, P] (``out`` when given).
    Reference: ``fastmamba.ops.replay.ref.replay_selective_state_update_ref``.
    """
    check_tensors(OP, [("state", state), ("old_x", old_x), ("old_B", old_B), ("old_dt", old_dt),
                       ("old_cumA", old_cumA), ("buf_idx", buf_idx), ("prev_accepted", prev_accepted),
                       ("hist_len", hist_len), ("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)],
                  [("D", D), ("z", z), ("dt_bias", dt_bias), ("state_batch_indices", state_batch_indices),
                   ("out", out), ("rand_seed", rand_seed)])
    pad_slot_id = check_int(OP, "pad_slot_id", pad_slot_id)
    dt_softplus = check_flag(OP, "dt_softplus", dt_softplus)
    A_is_log = check_flag(OP, "A_is_log", A_is_log)
    check_dtype(OP, "x", x, FLOAT_DTYPES)
    check_dtype(OP, "state", state, FLOAT_DTYPES)
    if x.dim() != 4:
        raise ValueError(f"{OP}: `x` expected shape (B, T, H, P), got {tuple(x.shape)}")
    nreq, ntok, nheads, headdim = x.shape
    check_shape(OP, "state", state, [("S", None), ("H", nheads), ("P", headdim), ("N", None)])
    nslots, dstate = state.shape[0], state.shape[3]

    if old_x.dim() == 4 and old_x.shape[1] < ntok:
        raise ValueError(
            f"{OP}: `x` has T={ntok} tokens per request but the replay cache's history holds C_h={old_x.shape[1]} "
            f"(`old_x` shape {tuple(old_x.shape)}); allocate the cache with history >= the tokens verified per step"
        )
    check_shape(OP, "old_x", old_x, [("S", nslots), ("C_h", None), ("H", nheads), ("P", headdim)])
    capacity = old_x.shape[1]
    check_shape(OP, "B", B, [("B", nreq), ("T", ntok), ("G", None), ("N", dstate)])
    ngroups = B.shape[2]
    check_shape(OP, "C", C, [("B", nreq), ("T", ntok), ("G", ngroups), ("N", dstate)])
    if nheads % ngroups != 0:
        raise ValueError(f"{OP}: the number of groups G={ngroups} (from `B`) must divide the number of heads H={nheads}")
    check_shape(OP, "old_B", old_B, [("buffers", 2), ("S", nslots), ("C_h", capacity), ("G", ngroups), ("N", dstate)])
    for name, t in (("old_dt", old_dt), ("old_cumA", old_cumA)):
        check_shape(OP, name, t, [("buffers", 2), ("S", nslots), ("C_h", capacity), ("H", nheads)])
        check_dtype(OP, name, t, (torch.float32,))
    for name, t in (("buf_idx", buf_idx), ("prev_accepted", prev_accepted), ("hist_len", hist_len)):
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
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            check_dtype(OP, name, t, FLOAT_DTYPES)
    if z is not None:
        check_shape(OP, "z", z, [(k, v) for k, v in zip("BTHP", x.shape)])

    check_same_device(OP, [("x", x), ("state", state), ("old_x", old_x), ("old_B", old_B), ("old_dt", old_dt),
                           ("old_cumA", old_cumA), ("buf_idx", buf_idx), ("prev_accepted", prev_accepted),
                           ("hist_len", hist_len), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z), ("dt_bias", dt_bias),
                           ("state_batch_indices", state_batch_indices), ("rand_seed", rand_seed), ("out", out)])
    on_device = _device_check(state_batch_indices) and use_triton(x)
    slot_errors.raise_pending(OP, x.device, slot_errors.NAMES[OP])
    if state_batch_indices is not None:
        check_indices(OP, "state_batch_indices", state_batch_indices, nreq, nslots, pad_slot_id, read=not on_device)
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

    if on_device:  # the kernels skip a slot outside [0, S); this records it for the next call
        slot_errors.check_slots_on_device(OP, state_batch_indices, nslots, pad_slot_id, which=1)
    op = _replay_impl if call_directly() else _replay_op
    op(
        state, old_x, old_B, old_dt, old_cumA, buf_idx, prev_accepted, hist_len, x, dt, A, B, C, D, z, dt_bias,
        bool(dt_softplus), state_batch_indices, int(pad_slot_id), out, rand_seed, bool(A_is_log),
    )
    return out
