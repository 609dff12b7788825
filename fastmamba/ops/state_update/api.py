"""Public entry of the SSM state update: checks, shape normalisation, allocation, launch."""
from __future__ import annotations

import torch

from fastmamba.ops._common.checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_indices,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensors,
    check_int,
    check_flag,
)
from fastmamba.ops._common.dispatch import call_directly, use_triton
from fastmamba.ops._common.pdl import pdl_active, pdl_requested
from fastmamba.ops._common import pdl as _pdl
from fastmamba.ops._common.plans import PlanCache, sig
from fastmamba.ops._common import slot_errors
from fastmamba.ops._common.checks import check_index_values
from fastmamba.ops._common.host_values import host_reads_allowed
from fastmamba.ops._common.host_math import cdiv
from fastmamba.ops.state_update import configs as ssu_configs
from fastmamba.ops.state_update.configs import pick_config
from fastmamba.ops.state_update.kernel import launch_planned, plan_selective_state_update
from fastmamba.ops.state_update.ref import selective_state_update_ref

OP = "selective_state_update"


def _tied(t: torch.Tensor | None, dims: tuple[int, ...]) -> bool:
    """True if ``t`` does not vary along ``dims`` (stride 0 or extent 1)."""
    return t is None or all(t.size(d) == 1 or t.stride(d) == 0 for d in dims)


def _per_head(name: str, t: torch.Tensor | None, H: int, P: int) -> torch.Tensor | None:
    """Accept (H,) or (H, P) for D / dt_bias; returns an (H, P) view (stride 0 over P for (H,))."""
    if t is None:
        return None
    if t.dim() == 1:
        check_shape(OP, name, t, [("H", H)])
        return t.unsqueeze(-1).expand(H, P)
    check_shape(OP, name, t, [("H", H), ("P", P)])
    return t


def _selective_state_update_impl(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    state_batch_indices: torch.Tensor | None,
    pad_slot_id: int,
    out: torch.Tensor,
    dst_state_batch_indices: torch.Tensor | None,
    intermediate_states: torch.Tensor | None,
    rand_seed: torch.Tensor | None,
    A_is_log: bool,
) -> None:
    """In-place op on normalised 4-D views (see launch_selective_state_update)."""
    if not use_triton(x):
        selective_state_update_ref(
            state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices,
            pad_slot_id=pad_slot_id, out=out, dst_state_batch_indices=dst_state_batch_indices,
            intermediate_states=intermediate_states, A_is_log=A_is_log,
        )
        return
    plan = _plan(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, pad_slot_id, out,
                 dst_state_batch_indices, intermediate_states, rand_seed, A_is_log)
    launch_planned(plan, state, x, dt, dt_bias, A, B, C, D, z, out,
                   state_batch_indices, dst_state_batch_indices, intermediate_states, rand_seed)


def _plan(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, pad_slot_id, out,
          dst_state_batch_indices, intermediate_states, rand_seed, A_is_log, report_slots=False) -> tuple:
    """The kernel launch for these normalised 4-D views, but for the tensors' addresses."""
    nreq, _, nheads, headdim = x.shape
    block_p, num_warps = pick_config(
        programs_per_block=nreq * nheads, headdim=headdim, dstate=B.shape[-1], state_bytes=state.element_size(),
        pdl=pdl_requested(x),
    )
    tie_hdim = _tied(A, (1, 2)) and _tied(dt, (3,)) and _tied(dt_bias, (1,)) and _tied(D, (1,))
    programs = nreq * nheads * cdiv(headdim, block_p)
    return plan_selective_state_update(
        state, x, dt, dt_bias, A, B, C, D, z, out,
        state_batch_indices, dst_state_batch_indices, intermediate_states, rand_seed,
        dt_softplus=dt_softplus, tie_hdim=tie_hdim, pad_slot_id=pad_slot_id,
        block_p=block_p, num_warps=num_warps, use_pdl=pdl_active(x, programs, num_warps), A_is_log=A_is_log,
        report_slots=report_slots,
    )


# Whether the lean path also checks CPU indices on the device instead of the host (tests of the
# device check without a GPU; on a CPU the host read costs no synchronize, so it stays off).
DEVICE_CHECK_CPU = False
SLOT_NAMES = ("state_batch_indices", "dst_state_batch_indices")
slot_errors.NAMES[OP] = SLOT_NAMES


def _device_check(idx: torch.Tensor | None) -> bool:
    """Whether a lean call checks ``idx`` in the kernel (reported at the next call: slot_errors.py)
    instead of reading it on the host: indices on a GPU that the caller has not vouched for."""
    return slot_errors.checked_on_device(idx, DEVICE_CHECK_CPU)


# Launch plans of plain eager calls (issue 19: an eager call's host time), keyed by the call's
# signature: every tensor's shape, strides, dtype and device, the flags, and the switches a plan
# depends on (PDL, the tuning hooks). A signature gets a plan only after a call with it passed
# every check, and every check but the slot-index values depends on the signature alone; the
# index values are checked on every call (where host reads are allowed).
_PLANS = PlanCache("selective_state_update", 1024)



def _plan_key(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, idx, pad_slot_id, A_is_log) -> tuple:
    return (x.shape, x.stride(), x.dtype, x.device, sig(state), sig(dt), sig(A), sig(B), sig(C),
            sig(D), sig(z), sig(dt_bias), sig(idx), dt_softplus, pad_slot_id, A_is_log,
            _pdl._enabled, ssu_configs._forced.value, ssu_configs.STORE_EARLY, _device_check(idx))


# Registered so torch.compile and graph capture see the in-place writes; plain eager calls skip
# the dispatcher (dispatch.call_directly) and run the same function.
_selective_state_update_op = torch.library.custom_op(
    "fastmamba::selective_state_update_", mutates_args=("state", "out", "intermediate_states"))(
    _selective_state_update_impl)


@_selective_state_update_op.register_fake
def _(*args, **kwargs) -> None:
    return None


def selective_state_update(
    state: torch.Tensor,
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
    dst_state_batch_indices: torch.Tensor | None = None,
    intermediate_states: torch.Tensor | None = None,
    rand_seed: torch.Tensor | None = None,
    A_is_log: bool = False,
) -> torch.Tensor:
    """Advance the SSM by one (or T) tokens for each of B requests (drop-in for mamba_ssm's op).

    Three forms, told apart by ``x.dim()``:
      single token     x [B, H, P]      B, C [B, G, N]      state [S, H, P, N]
      no heads axis    x [B, P]         B, C [B, N]         state [S, P, N]    (mamba_ssm's (B, D) form)
      T tokens         x [B, T, H, P]   B, C [B, T, G, N]   state [S, H, P, N]

    state   fp32, bf16 or fp16; row ``state_batch_indices[b]`` is read and row
            ``dst_state_batch_indices[b]`` (default: the same row) is written, in place
    x       activation dtype (fp32/bf16/fp16); y has the same shape and dtype
    dt      x's shape (usually a stride-0 broadcast of [B, H] / [B, T, H]) or [B, H] / [B, T, H];
            dt' = softplus(dt + dt_bias) when dt_softplus, else dt + dt_bias
    A       [H, P, N] (usually a stride-0 broadcast of [H] = -exp(A_log)) or [H]; with ``A_is_log``
            it holds A_log itself (same shapes) and the kernel computes -exp(A_log) in fp32 where it
            loads it: nothing derived from the weight is cached, so an in-place weight change is seen
            by eager calls, CUDA graphs and compiled code alike (prefer this to a cached -exp)
    B, C    any float dtype (e.g. fp32 next to a bf16 x, as mamba_ssm accepts); G divides H, head h
            reads group h // (H // G)
    D       [H, P] or [H] or None;   dt_bias [H, P] or [H] or None (any float dtype);
    z       like x (same dtype) or None (y *= silu(z))
    state_batch_indices     [B] int32/int64 or None (row b); rows equal to ``pad_slot_id`` are
                            skipped: no state read or write, y row zeroed. Values outside [0, S)
                            raise ValueError: at once where reading them costs no synchronize (CPU
                            indices, the first call of a call signature); on a GPU, repeated plain
                            calls leave the check to the kernel, which skips such a row and makes
                            the op's next call raise (fastmamba.ops._common.slot_errors)
    dst_state_batch_indices [B] int32/int64 or None: where the new state goes (pad: not written)
    intermediate_states     [B, T, H, P, N] float or None: written with the state after every token
                            (the per-position buffers of speculative verification)
    rand_seed               one-element int64 tensor on x's device or None: with a 16-bit state, the
                            stored state is rounded stochastically (unbiased, software, works on
                            Hopper); read on the device, so a CUDA graph may change it between replays.
                            Advance it every step, or the same random numbers repeat.
    out                     like x, or None (allocated contiguous)

    Precision: every input is converted to fp32 as it is loaded (so dt, A, B, C, D and dt_bias may
    each be fp32, bf16 or fp16 whatever x is); the recurrence, the output's reduction, the D skip
    and the gate run in fp32; y is rounded once to x's dtype and the state once to its own dtype.
    When A, dt, dt_bias and D are stride-0 over P (and A over N), they are loaded as one scalar per
    head. Returns y (``out`` when given). Reference: ``fastmamba.ops.state_update.ref``.
    """
    # Fast path: a plain call (no out / dst / intermediate / seed) whose signature an earlier call
    # validated and planned: only the slot values are checked, then one launch.
    if (out is None and dst_state_batch_indices is None and intermediate_states is None and rand_seed is None
            and pad_slot_id.__class__ is int and dt_softplus.__class__ is bool and A_is_log.__class__ is bool
            and type(x) is torch.Tensor):
        try:
            key = _plan_key(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, pad_slot_id,
                            A_is_log)
        except AttributeError:  # not a tensor somewhere: the checks below say which
            key = None
        err = None
        if key is not None and key[-1]:  # indices checked by the kernels: report what an earlier call found
            err, host = slot_errors.slot_record(OP, x.device)
            if host[0]:
                slot_errors.raise_pending(OP, x.device, SLOT_NAMES)
        plan = _PLANS.get(key)
        if plan is not None and use_triton(x) and call_directly(x):
            if err is None and state_batch_indices is not None and host_reads_allowed(state_batch_indices):
                check_index_values(OP, "state_batch_indices", state_batch_indices, state.shape[0], pad_slot_id)
            y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            launch_planned(plan, state, x, dt, dt_bias, A, B, C, D, z, y, state_batch_indices, None, None, None, err)
            return y
    else:
        key = None
    check_tensors(OP, [("state", state), ("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)],
                  [("D", D), ("z", z), ("dt_bias", dt_bias), ("state_batch_indices", state_batch_indices),
                   ("out", out), ("dst_state_batch_indices", dst_state_batch_indices),
                   ("intermediate_states", intermediate_states), ("rand_seed", rand_seed)])
    pad_slot_id = check_int(OP, "pad_slot_id", pad_slot_id)
    dt_softplus = check_flag(OP, "dt_softplus", dt_softplus)
    A_is_log = check_flag(OP, "A_is_log", A_is_log)
    check_dtype(OP, "x", x, FLOAT_DTYPES)
    check_dtype(OP, "state", state, FLOAT_DTYPES)
    no_heads = x.dim() == 2
    if x.dim() not in (2, 3, 4):
        raise ValueError(f"{OP}: `x` must be (B, P), (B, H, P) or (B, T, H, P); got shape {tuple(x.shape)}")
    if no_heads:  # mamba_ssm's headless form: one head of P = D channels
        state = state.unsqueeze(1)
        x, B, C = x.unsqueeze(1), B.unsqueeze(1), C.unsqueeze(1)
        dt = dt.unsqueeze(1)
        A = A.unsqueeze(0)
        z = z.unsqueeze(1) if z is not None else None
        D = D.unsqueeze(0) if D is not None else None
        dt_bias = dt_bias.unsqueeze(0) if dt_bias is not None else None
        if out is not None:
            out = out.unsqueeze(1)
    multi_token = x.dim() == 4
    x4 = x if multi_token else x.unsqueeze(1)
    nreq, ntok, nheads, headdim = x4.shape
    if state.dim() != 4:
        raise ValueError(f"{OP}: `state` expected shape (S, H={nheads}, P={headdim}, N), got {tuple(state.shape)}")
    nslots, dstate = state.shape[0], state.shape[3]
    check_shape(OP, "state", state, [("S", None), ("H", nheads), ("P", headdim), ("N", None)])

    tok = [("T", ntok)] if multi_token else []
    bc_expected = [("B", nreq)] + tok + [("G", None), ("N", dstate)]
    check_shape(OP, "B", B, bc_expected)
    ngroups = B.shape[-2]
    check_shape(OP, "C", C, bc_expected[:-2] + [("G", ngroups), ("N", dstate)])
    if nheads % ngroups != 0:
        raise ValueError(f"{OP}: the number of groups G={ngroups} (from `B`) must divide the number of heads H={nheads}")
    check_dtype(OP, "B", B, FLOAT_DTYPES)  # fp32 B / C next to 16-bit x, as mamba_ssm's callers pass them
    check_dtype(OP, "C", C, FLOAT_DTYPES)
    if z is not None:
        check_same_dtype(OP, [("x", x), ("z", z)])

    if dt.dim() == x.dim() - 1 and not no_heads:  # [B, H] / [B, T, H]: broadcast over P
        check_shape(OP, "dt", dt, [("B", nreq)] + tok + [("H", nheads)])
        dt = dt.unsqueeze(-1).expand(*dt.shape, headdim)
    check_shape(OP, "dt", dt, [("B", nreq)] + tok + [("H", nheads), ("P", headdim)])
    check_dtype(OP, "dt", dt, FLOAT_DTYPES)
    if A.dim() == 1:
        check_shape(OP, "A", A, [("H", nheads)])
        A = A[:, None, None].expand(nheads, headdim, dstate)
    check_shape(OP, "A", A, [("H", nheads), ("P", headdim), ("N", dstate)])
    check_dtype(OP, "A", A, FLOAT_DTYPES)
    D = _per_head("D", D, nheads, headdim)
    dt_bias = _per_head("dt_bias", dt_bias, nheads, headdim)
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            check_dtype(OP, name, t, FLOAT_DTYPES)
    if z is not None:
        check_shape(OP, "z", z, [(k, v) for k, v in zip("BTHP" if multi_token else "BHP", x.shape)])

    check_same_device(OP, [("x", x), ("state", state), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D),
                           ("z", z), ("dt_bias", dt_bias), ("state_batch_indices", state_batch_indices),
                           ("dst_state_batch_indices", dst_state_batch_indices),
                           ("intermediate_states", intermediate_states), ("rand_seed", rand_seed), ("out", out)])
    slot_errors.raise_pending(OP, x.device, SLOT_NAMES)  # an earlier lean call's bad index: report it at this call
    if state_batch_indices is not None:
        check_indices(OP, "state_batch_indices", state_batch_indices, nreq, nslots, pad_slot_id)
    elif nslots < nreq:
        raise ValueError(f"{OP}: without state_batch_indices, `state` needs at least B={nreq} rows, got {nslots}")
    if dst_state_batch_indices is not None:
        check_indices(OP, "dst_state_batch_indices", dst_state_batch_indices, nreq, nslots, pad_slot_id)
    if intermediate_states is not None:
        check_shape(OP, "intermediate_states", intermediate_states,
                    [("B", nreq), ("T", ntok), ("H", nheads), ("P", headdim), ("N", dstate)])
        check_dtype(OP, "intermediate_states", intermediate_states, FLOAT_DTYPES)
    if rand_seed is not None:
        check_dtype(OP, "rand_seed", rand_seed, (torch.int64,))
        if rand_seed.numel() != 1:
            raise ValueError(f"{OP}: `rand_seed` must hold one element, got shape {tuple(rand_seed.shape)}")
        if state.dtype == torch.float32:
            rand_seed = None  # nothing to round: fp32 state is stored exactly

    if out is None:  # contiguous whatever x's strides, so y feeds the norm and out_proj directly
        out4 = torch.empty(x4.shape, dtype=x4.dtype, device=x4.device)
    else:
        check_shape(OP, "out", out, [(k, v) for k, v in zip("BTHP" if multi_token else "BHP", x.shape)])
        check_same_dtype(OP, [("x", x), ("out", out)])
        out4 = out if multi_token else out.unsqueeze(1)

    def tokens(t: torch.Tensor | None) -> torch.Tensor | None:
        return t if t is None or multi_token else t.unsqueeze(1)

    args = (state, x4, tokens(dt), A, tokens(B), tokens(C), D, tokens(z), dt_bias, bool(dt_softplus),
            state_batch_indices, int(pad_slot_id), out4, dst_state_batch_indices, intermediate_states, rand_seed,
            bool(A_is_log))
    if key is not None and use_triton(x4) and call_directly(x4) and _PLANS.has_room():
        # checked: plan this signature (out4 is the contiguous buffer the fast path allocates too)
        report = key[-1]
        err = slot_errors.slot_record(OP, x4.device)[0] if report else None
        plan = _PLANS[key] = _plan(*args, report_slots=report)
        launch_planned(plan, state, x4, args[2], dt_bias, A, args[4], args[5], D, args[7], out4,
                       state_batch_indices, None, None, None, err)
    else:
        op = _selective_state_update_impl if call_directly() else _selective_state_update_op
        op(*args)
    y = out4 if multi_token else out4.squeeze(1)
    return y.squeeze(1) if no_heads else y
