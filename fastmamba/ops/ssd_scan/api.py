"""Public entries of the chunked SSD scan: mamba_ssm's dense call and the packed varlen serving call.
Their shared argument checks: ``inputs.py``; chunk counts and segment tables: ``plan.py``."""
from __future__ import annotations

from typing import Optional

import torch

from fastmamba.ops._common.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dtype,
    check_indices,
    check_same_device,
    check_shape,
    check_tensors,
)
from fastmamba.ops._common.dispatch import call_directly, use_triton
from fastmamba.ops._common import slot_errors, varlen_checks
from fastmamba.ops._common.host_values import compiling, host_reads_allowed
from fastmamba.ops.ssd_scan.fused.api import choose_fused, longest_sequence_bound, ssd_scan_varlen_fused_impl
from fastmamba.ops.ssd_scan.hopper.chunk_output import hopper_chunk_output_ok
from fastmamba.ops.ssd_scan.chunked.kernel import _segment_slots_kernel
from fastmamba.ops.ssd_scan.chunked.launch import ScanSegments, ssd_scan_launch
from fastmamba.ops.ssd_scan.inputs import _DENSE, _VARLEN, _as_x_dtype, _check_common, _check_norm
from fastmamba.ops.ssd_scan.plan import _check_cu_seqlens, _count_chunks, _dense_call_segments, chunk_count_bound
from fastmamba.ops.ssd_scan.ref import mamba_chunk_scan_combined_ref, ssd_scan_varlen_ref
from fastmamba.ops._common.host_math import cdiv
from fastmamba.ops._common.launch import lean

_INF = float("inf")


def mamba_chunk_scan_combined(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, _INF),
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    state_dtype: torch.dtype | None = None,
    *,
    A_is_log: bool = False,
):
    """The Mamba-2 SSD scan over whole prompts (drop-in for mamba_ssm's function).

    x        [B, L, H, P]   fp32, bf16 or fp16, any strides; read
    dt       [B, L, H]      any float dtype; dt' = clamp(softplus(dt + dt_bias), *dt_limit)
    A        [H]            fp32 (= -exp(A_log)); with A_is_log, A_log itself (the kernel takes
                            -exp in fp32 where it loads it, so nothing derived from the weight is cached)
    B, C     [B, L, G, N]   x's dtype, or another float dtype (converted to x's first: a copy); head h reads group h // (H // G)
    D        [H] or [H, P]  or None: y += D * x
    z        [B, L, H, P]   or None: y *= silu(z)
    dt_bias  [H]            or None
    initial_states [B, H, P, N] or None (zeros): the state before each row's first segment
    seq_idx  [B, L] int32   or None: a new sequence (state from zeros) starts wherever it changes.
                            Read on the host (one sync) to find the boundaries.
    cu_seqlens [S+1]        or None: with B = 1, the row packs S sequences at these offsets
                            (takes precedence over seq_idx for the boundaries). CPU tensors are
                            checked on the host; an eager call on GPU tensors checks them on the
                            device (no synchronize): a call with bad values runs its tokens as one
                            sequence and the op's next call raises the ValueError
    state_dtype             dtype of the per-chunk states between the kernels (default fp32;
                            bf16 halves their traffic at some precision)
    Returns out [B, L, H, P] (x's dtype); with return_final_states also the state after each row
    [B, H, P, N] fp32; with return_varlen_states also each sequence's final state [S, H, P, N] fp32
    (sequences in order: cu_seqlens, else seq_idx runs of every row): out, (out, final), (out,
    varlen) or (out, final, varlen) as mamba_ssm returns them.
    Chunks never cross a sequence boundary, so ``chunk_size`` is a tiling choice only.
    Reference: fastmamba.ops.ssd_scan.ref.mamba_chunk_scan_combined_ref
    """
    check_tensors(_DENSE, [("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)],
                  [("D", D), ("z", z), ("dt_bias", dt_bias), ("initial_states", initial_states), ("seq_idx", seq_idx),
                   ("cu_seqlens", cu_seqlens)])
    if x.dim() != 4:
        raise ValueError(f"{_DENSE}: `x` expected shape (B, L, H, P), got {tuple(x.shape)}")
    nb, L, H, P = x.shape
    _, _, G, N = _check_common(_DENSE, x, dt, A, B, C, D, z, dt_bias, [("B", nb), ("L", L)])
    B, C = _as_x_dtype(B, x), _as_x_dtype(C, x)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"{_DENSE}: `chunk_size` expected a positive int, got {chunk_size!r}")
    if initial_states is not None:
        check_shape(_DENSE, "initial_states", initial_states, [("B", nb), ("H", H), ("P", P), ("N", N)])
        check_dtype(_DENSE, "initial_states", initial_states, FLOAT_DTYPES)
    cu_on_device = False
    if cu_seqlens is not None:
        if nb != 1:
            raise ValueError(f"{_DENSE}: `cu_seqlens` needs batch 1 (packed sequences in one row), got B={nb}")
        check_same_device(_DENSE, [("x", x), ("cu_seqlens", cu_seqlens)])
        cu_on_device = varlen_checks.device_checked(x, cu_seqlens)
        slot_errors.raise_pending(_DENSE, x.device, DENSE_NAMES)  # what an earlier call's check found
        _check_cu_seqlens(_DENSE, cu_seqlens, L, read=not cu_on_device)
    elif seq_idx is not None:
        check_shape(_DENSE, "seq_idx", seq_idx, [("B", nb), ("L", L)])
        check_dtype(_DENSE, "seq_idx", seq_idx, INDEX_DTYPES)
    if return_varlen_states and cu_seqlens is None and seq_idx is None:
        raise ValueError(f"{_DENSE}: `return_varlen_states` needs `cu_seqlens` or `seq_idx` to know the sequences")

    if cu_on_device and L > 0:  # checked on the device, no synchronize (varlen_checks.py)
        n_seg = cu_seqlens.shape[0] - 1
        cu_seqlens, _ = varlen_checks.sanitize(_DENSE, cu_seqlens, None, L, n_seg, -1, cu_which=1, idx_which=2)
    op = _mamba_chunk_scan_combined_impl if call_directly(x) else _mamba_chunk_scan_combined_
    with varlen_checks.launches_after(cu_on_device, x):  # no PDL overlap with the check's writes
        out, final_states, varlen_states = op(
            x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, chunk_size, bool(dt_softplus),
            float(dt_limit[0]), float(dt_limit[1]), bool(return_final_states), bool(return_varlen_states),
            state_dtype, bool(A_is_log), cu_seqlens is not None and not cu_on_device and host_reads_allowed(cu_seqlens),
        )
    result = [out]
    if return_final_states:
        result.append(final_states)
    if return_varlen_states:
        result.append(varlen_states)
    return result[0] if len(result) == 1 else tuple(result)


DENSE_NAMES = ("cu_seqlens",)  # argument number 1 of the device check's record
slot_errors.NAMES[_DENSE] = DENSE_NAMES
slot_errors.EFFECTS[_DENSE] = ("that call ran its tokens as one sequence: its outputs and states are not the "
                               "ones asked for")


def _nothing(x: torch.Tensor) -> torch.Tensor:
    """The placeholder for a state the caller did not ask for (a custom op returns tensors)."""
    return torch.empty(0, dtype=torch.float32, device=x.device)


def _mamba_chunk_scan_combined_impl(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor],
    z: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor],
    initial_states: Optional[torch.Tensor],
    seq_idx: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    chunk_size: int,
    dt_softplus: bool,
    dt_min: float,
    dt_max: float,
    return_final_states: bool,
    return_varlen_states: bool,
    state_dtype: Optional[torch.dtype],
    A_is_log: bool,
    read_cu_seqlens: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked inputs -> (out, final states or an empty placeholder, per-sequence states or one)."""
    nb, L, H, P = x.shape
    N = B.shape[-1]
    dt_limit = (dt_min, dt_max)
    if not use_triton(x) or nb * L == 0:  # no tokens: the reference's answer (final = initial states)
        res = mamba_chunk_scan_combined_ref(
            x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus, dt_limit,
            return_final_states, return_varlen_states, state_dtype, A_is_log=A_is_log,
        )
        res = list(res) if isinstance(res, tuple) else [res]
        out = res.pop(0)
        final = res.pop(0) if return_final_states else _nothing(x)
        varlen = res.pop(0) if return_varlen_states else _nothing(x)
        return out, final, varlen
    dev = x.device
    # segments in the flat token space f = row * L + position
    cu, n_chunks, row_of_seg, first_of_row, last_of_row, none = _dense_call_segments(
        nb, L, dev, seq_idx, cu_seqlens, chunk_size, read_cu_seqlens)
    n_seg = cu.shape[0] - 1

    def where_row(flags):
        return row_of_seg if flags is None else torch.where(flags, row_of_seg, none)

    final_states = torch.empty(nb, H, P, N, dtype=torch.float32, device=dev) if return_final_states else None
    varlen_states = torch.empty(n_seg, H, P, N, dtype=torch.float32, device=dev) if return_varlen_states else None
    segments = ScanSegments(
        cu=cu,
        n_chunks=n_chunks,
        init=initial_states,
        init_idx=where_row(first_of_row) if initial_states is not None else None,
        final=final_states,
        final_idx=where_row(last_of_row) if final_states is not None else None,
        seg_final=varlen_states,
    )
    out = torch.empty(x.shape, dtype=x.dtype, device=dev)
    ssd_scan_launch(
        x, dt, A, B, C, D, z, dt_bias, out, segments,
        chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=tuple(dt_limit),
        state_dtype=state_dtype or torch.float32, A_is_log=A_is_log,
    )
    return (out, final_states if final_states is not None else _nothing(x),
            varlen_states if varlen_states is not None else _nothing(x))


# A custom op, so that torch.compile(fullgraph=True) traces the public function without
# breaking the graph at the launches (and the seq_idx host read happens when the op runs). Plain
# eager calls on plain tensors skip the dispatcher (dispatch.call_directly) and run the same body.
_mamba_chunk_scan_combined_ = torch.library.custom_op("fastmamba::mamba_chunk_scan_combined_", mutates_args=())(
    _mamba_chunk_scan_combined_impl)


@_mamba_chunk_scan_combined_.register_fake
def _(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, chunk_size, dt_softplus, dt_min, dt_max,
      return_final_states, return_varlen_states, state_dtype, A_is_log, read_cu_seqlens):
    nb, _, H, P = x.shape
    N = B.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    final = x.new_empty(nb, H, P, N, dtype=torch.float32) if return_final_states else _nothing(x)
    if not return_varlen_states:
        varlen = _nothing(x)
    else:  # seq_idx: as many as the runs of equal values, known when the op runs
        n_seg = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else torch.library.get_ctx().new_dynamic_size()
        varlen = x.new_empty(n_seg, H, P, N, dtype=torch.float32)
    return out, final, varlen


def ssd_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    ssm_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    chunk_size: int = 256,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, _INF),
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    pad_slot_id: int = -1,
    out: torch.Tensor | None = None,
    chunk_states_out: torch.Tensor | None = None,
    A_is_log: bool = False,
    rand_seed: torch.Tensor | None = None,
    fused: bool | None = None,
    max_seqlen: int | None = None,
    live_seqs: int | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_sumsq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed variable-length prefill of the SSM, reading and writing each sequence's cache slot.

    x          [T, H, P]     fp32, bf16 or fp16, any strides; T tokens of B sequences; read
    dt         [T, H]        any float dtype (raw: dt_bias and softplus are applied inside)
    A          [H] fp32 (= -exp(A_log)), or A_log itself when A_is_log (-exp taken in fp32 inside)
    B, C       [T, G, N] x's dtype (another float dtype is converted first: a copy);  D [H] or [H, P];  dt_bias [H]
    z          [T, H, P]     or None: y *= silu(z) inside (the norm afterwards runs without z)
    ssm_states [S, H, P, N]  fp32, bf16 or fp16, any strides; slot cache_indices[b] is read as
                             sequence b's initial state when has_initial_state[b], and receives
                             its final state unless the sequence is empty (16-bit: round to nearest,
                             or stochastically with rand_seed)
    cu_seqlens [B+1] int32/int64: 0 = cu[0] <= cu[1] <= ... <= cu[B] = T (empty sequences allowed)
    cache_indices [B] int32/int64 or None (slot b): pad_slot_id marks a padding sequence, whose
                             output rows are zeroed and whose slot is not touched; checked to lie in
                             [0, S); where the check is skipped (trusted_inputs(), capture, compile)
                             an index outside [0, S) acts as the pad slot
    has_initial_state [B] bool/int or None (all False: start from zeros)
    out        [T, H, P]     or None; written (must not overlap x)
    chunk_states_out [n_chunks, H, P, N] or None: the state after every chunk (prefix caching);
                             chunk k of sequence b goes to row chunk_offsets(cu_seqlens)[b] + k,
                             and it needs at least num_chunks(cu_seqlens, chunk_size) rows
    rand_seed  one-element int64 tensor on x's device or None: with a 16-bit ``ssm_states``, the
                             final states stored into the slots are rounded stochastically (unbiased,
                             the state update's scheme and random stream); read on the device, so a
                             CUDA graph may advance it between replays. With it the chunk states
                             between the kernels stay fp32 (so the stored state is rounded once, at
                             random, from the fp32 value). Ignored for an fp32 cache (and by the
                             reference, which rounds to nearest).
    fused      None (automatic), True or False: the one-launch kernel for short sequences
                             (ops/ssd_scan/fused/kernel.py) instead of the five-kernel chunked path;
                             automatic: fused when every sequence is at most fused_configs.MAX_FUSED_LEN
                             tokens. Same results up to rounding.
    max_seqlen int or None: a host bound on the longest sequence (the runtime knows it), which
                             picks the path and tiles without reading cu_seqlens; None: from
                             cu_seqlens where the op reads it anyway (CPU tensors), else T (GPU
                             tensors: pass it to get the fused path for short sequences packed
                             past MAX_FUSED_LEN tokens)
    live_seqs  int or None: how many of the B sequences are not padding (pad slot), when the host
                             knows (a graphed prefill's padding requests): the fused path sizes its
                             tiles for them. Tiles only: the result is the same for any value
    norm_weight [H * P] float, and norm_sumsq [T, H * P / 16] fp32 (unit stride along its last
                             dim; written), both or neither: the RMSNorm that follows the scan
                             (over all H * P columns of a token, no bias), deferred. ``out`` gets
                             y * norm_weight and norm_sumsq[t, j] the sum of y[t]^2 over the
                             columns 16 j .. 16 j + 15 (y: the scan's output after D and z, in
                             fp32), so that the norm's 1 / rms(y_t) = rsqrt(sum_j norm_sumsq[t, j] /
                             (H * P) + eps) becomes a per-token scale for whoever consumes a linear
                             map of ``out`` (``add_rmsnorm``'s ``pending_norm``). P must be a
                             multiple of 16. Pad sequences get zero sums
    Returns out [T, H, P] (x's dtype). Chunks of ``chunk_size`` tokens never cross a sequence.
    cu_seqlens and cache_indices values: CPU tensors are checked on the host (ValueError before
    anything is written); an eager call on GPU tensors checks them on the device with no
    synchronize (ops/_common/varlen_checks.py): a call with a bad value runs as padding (no state
    read or written, zero outputs) and the op's next call raises the ValueError (or
    ``fastmamba.ops.raise_pending_slot_errors()`` does); with ``chunk_states_out`` they are read on
    the host. Nothing is checked while a CUDA graph is captured, under torch.compile or inside
    ``trusted_inputs()``.
    Reference: fastmamba.ops.ssd_scan.ref.ssd_scan_varlen_ref
    """
    check_tensors(_VARLEN, [("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("ssm_states", ssm_states),
                            ("cu_seqlens", cu_seqlens)],
                  [("D", D), ("z", z), ("dt_bias", dt_bias), ("cache_indices", cache_indices),
                   ("has_initial_state", has_initial_state), ("out", out), ("chunk_states_out", chunk_states_out),
                   ("rand_seed", rand_seed), ("norm_weight", norm_weight), ("norm_sumsq", norm_sumsq)])
    if x.dim() != 3:
        raise ValueError(f"{_VARLEN}: `x` expected shape (T, H, P), got {tuple(x.shape)}")
    T, H, P = x.shape
    _, _, G, N = _check_common(_VARLEN, x, dt, A, B, C, D, z, dt_bias, [("T", T)])
    B, C = _as_x_dtype(B, x), _as_x_dtype(C, x)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"{_VARLEN}: `chunk_size` expected a positive int, got {chunk_size!r}")
    check_shape(_VARLEN, "ssm_states", ssm_states, [("S", None), ("H", H), ("P", P), ("N", N)])
    check_dtype(_VARLEN, "ssm_states", ssm_states, FLOAT_DTYPES)
    check_same_device(_VARLEN, [("x", x), ("ssm_states", ssm_states), ("cu_seqlens", cu_seqlens),
                                ("cache_indices", cache_indices), ("has_initial_state", has_initial_state),
                                ("out", out), ("chunk_states_out", chunk_states_out)])
    # an eager call on GPU tensors checks cu_seqlens and the slots on the device (no synchronize:
    # varlen_checks.py) unless chunk_states_out needs the exact chunk count on the host
    on_device = chunk_states_out is None and varlen_checks.device_checked(x, cu_seqlens)
    slot_errors.raise_pending(_VARLEN, x.device, VARLEN_NAMES)  # what an earlier call's check found
    cu_values = _check_cu_seqlens(_VARLEN, cu_seqlens, T, read=not on_device)
    nseq = cu_seqlens.shape[0] - 1
    S = ssm_states.shape[0]
    if cache_indices is not None:
        check_indices(_VARLEN, "cache_indices", cache_indices, nseq, S, pad_slot_id, read=not on_device)
    elif S < nseq:
        raise ValueError(f"{_VARLEN}: without `cache_indices` sequence b uses slot b, so `ssm_states` needs "
                         f"S >= B = {nseq} slots, got S = {S}")
    if has_initial_state is not None:
        check_shape(_VARLEN, "has_initial_state", has_initial_state, [("B", nseq)])
        check_dtype(_VARLEN, "has_initial_state", has_initial_state, (torch.bool, *INDEX_DTYPES))
    if rand_seed is not None:
        check_dtype(_VARLEN, "rand_seed", rand_seed, (torch.int64,))
        if rand_seed.numel() != 1:
            raise ValueError(f"{_VARLEN}: `rand_seed` must hold one element, got shape {tuple(rand_seed.shape)}")
        if rand_seed.device != x.device:
            raise ValueError(f"{_VARLEN}: `rand_seed` is on {rand_seed.device} but `x` is on {x.device}; "
                             f"all tensors must share a device")
        if ssm_states.dtype == torch.float32:
            rand_seed = None  # nothing to round: an fp32 cache stores the state exactly
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"{_VARLEN}: `fused` expected None, True or False, got {fused!r}")
    if max_seqlen is not None and (not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < 0):
        raise ValueError(f"{_VARLEN}: `max_seqlen` expected a non-negative int or None, got {max_seqlen!r}")
    if live_seqs is not None and (not isinstance(live_seqs, int) or isinstance(live_seqs, bool)
                                  or not 0 <= live_seqs <= nseq):
        raise ValueError(f"{_VARLEN}: `live_seqs` expected an int in [0, B={nseq}] or None, got {live_seqs!r}")
    if out is not None:
        check_shape(_VARLEN, "out", out, [("T", T), ("H", H), ("P", P)])
        if out.dtype != x.dtype:
            raise TypeError(f"{_VARLEN}: `out` has dtype {out.dtype} but `x` has {x.dtype}; they must match")
        if T > 0 and not compiling() and out.data_ptr() == x.data_ptr():
            raise ValueError(f"{_VARLEN}: `out` must not alias `x` (the scan reads x after writing out)")
    total_chunks = None if cu_values is None else _count_chunks(cu_values, chunk_size)
    if chunk_states_out is not None:
        check_shape(_VARLEN, "chunk_states_out", chunk_states_out, [("n_chunks", None), ("H", H), ("P", P), ("N", N)])
        check_dtype(_VARLEN, "chunk_states_out", chunk_states_out, FLOAT_DTYPES)
        if total_chunks is not None and chunk_states_out.shape[0] < total_chunks:
            raise ValueError(f"{_VARLEN}: `chunk_states_out` needs at least {total_chunks} rows (one per chunk), "
                             f"got {chunk_states_out.shape[0]}")
    _check_norm(x, norm_weight, norm_sumsq)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    if on_device:
        cu_seqlens, cache_indices = varlen_checks.sanitize(
            _VARLEN, cu_seqlens, cache_indices, T, S, pad_slot_id, cu_which=2, idx_which=1)
    with varlen_checks.launches_after(on_device, x):  # no PDL overlap with the check's writes
        max_len = longest_sequence_bound(cu_values, T, max_seqlen)
        def hopper_chunked() -> bool:  # whether the chunked path below would run the Hopper kernels
            z4 = None if z is None else z.unsqueeze(0)
            return hopper_chunk_output_ok(x.unsqueeze(0), z4, out.unsqueeze(0), C.unsqueeze(0), chunk_size)

        if choose_fused(fused, max_len, hopper_chunked):
            fused_op = ssd_scan_varlen_fused_impl if call_directly(x) else torch.ops.fastmamba.ssd_scan_varlen_fused_
            fused_op(
                x, dt, A, B, C, ssm_states, cu_seqlens, D, z, dt_bias, cache_indices, has_initial_state, out,
                chunk_states_out, chunk_size, dt_softplus, float(dt_limit[0]), float(dt_limit[1]), pad_slot_id,
                bool(A_is_log), rand_seed, max_len, live_seqs or 0, norm_weight, norm_sumsq,
            )
            return out
        n_chunks = total_chunks if total_chunks is not None else chunk_count_bound(T, nseq, chunk_size)
        op = _ssd_scan_varlen_impl if call_directly(x) else _ssd_scan_varlen_
        op(
            x, dt, A, B, C, ssm_states, cu_seqlens, D, z, dt_bias, cache_indices, has_initial_state, out,
            chunk_states_out, chunk_size, dt_softplus, float(dt_limit[0]), float(dt_limit[1]), pad_slot_id, n_chunks,
            bool(A_is_log), rand_seed, norm_weight, norm_sumsq,
        )
        return out


VARLEN_NAMES = ("cache_indices", "cu_seqlens")  # argument numbers 1, 2 of the device check's record
slot_errors.NAMES[_VARLEN] = VARLEN_NAMES
slot_errors.EFFECTS[_VARLEN] = "that call ran as padding: no state was read or written, its outputs are zeros"


def _ssd_scan_varlen_impl(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    ssm_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    D: Optional[torch.Tensor],
    z: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor],
    cache_indices: Optional[torch.Tensor],
    has_initial_state: Optional[torch.Tensor],
    out: torch.Tensor,
    chunk_states_out: Optional[torch.Tensor],
    chunk_size: int,
    dt_softplus: bool,
    dt_min: float,
    dt_max: float,
    pad_slot_id: int,
    n_chunks: int,
    A_is_log: bool,
    rand_seed: Optional[torch.Tensor],
    norm_weight: Optional[torch.Tensor],
    norm_sumsq: Optional[torch.Tensor],
) -> None:
    """In-place op on checked inputs: writes ``out``, the sequences' slots, ``chunk_states_out``
    and ``norm_sumsq``."""
    if not use_triton(x):
        ssd_scan_varlen_ref(
            x, dt, A, B, C, ssm_states, cu_seqlens, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias,
            dt_softplus=dt_softplus, dt_limit=(dt_min, dt_max), cache_indices=cache_indices,
            has_initial_state=has_initial_state, pad_slot_id=pad_slot_id, out=out, chunk_states_out=chunk_states_out,
            A_is_log=A_is_log, rand_seed=rand_seed, norm_weight=norm_weight, norm_sumsq=norm_sumsq,
        )
        return
    nseq = cu_seqlens.shape[0] - 1
    dev = x.device
    # a slot outside [0, S) acts as the pad slot (no read, no write, zero output), so unchecked
    # indices (trusted_inputs, graph capture, compile) never reach outside the pool; one small
    # kernel derives the rows (final_idx, init_idx) and the skip flags
    S = ssm_states.shape[0]
    has_init = has_initial_state is not None
    rows = torch.empty(2 if has_init else 1, nseq, dtype=torch.int32, device=dev)
    skip = torch.empty(nseq, dtype=torch.int8, device=dev) if cache_indices is not None else None
    block = 128
    lean(_segment_slots_kernel)[(cdiv(nseq, block),)](
        cache_indices, has_initial_state, rows, skip, nseq, pad_slot_id, S,
        HAS_SLOTS=cache_indices is not None, HAS_INIT=has_init, BLOCK=block, num_warps=4,
    )
    final_idx = rows[0]
    init_idx = rows[1] if has_init else None
    segments = ScanSegments(
        cu=cu_seqlens,
        n_chunks=n_chunks,
        skip=skip,
        init=ssm_states if init_idx is not None else None,
        init_idx=init_idx,
        final=ssm_states,
        final_idx=final_idx,
        chunk_out=chunk_states_out,
        final_seed=rand_seed,
    )
    ssd_scan_launch(
        x.unsqueeze(0), dt.unsqueeze(0), A, B.unsqueeze(0), C.unsqueeze(0), D,
        z.unsqueeze(0) if z is not None else None, dt_bias, out.unsqueeze(0), segments,
        chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=(dt_min, dt_max),
        # with stochastic rounding the states between the kernels stay fp32, so that the one rounding
        # of a prompt's final state into the 16-bit cache is the stochastic one (16-bit chunk states
        # would already have rounded it to nearest)
        state_dtype=torch.float32 if rand_seed is not None else ssm_states.dtype,
        A_is_log=A_is_log, norm_weight=norm_weight, norm_sumsq=norm_sumsq, after_own_kernel=True,
    )


# Registered so torch.compile and CUDA-graph capture see the in-place writes (plain eager calls on
# plain tensors run the body directly: dispatch.call_directly).
_ssd_scan_varlen_ = torch.library.custom_op(
    "fastmamba::ssd_scan_varlen_", mutates_args=("ssm_states", "out", "chunk_states_out", "norm_sumsq"))(
    _ssd_scan_varlen_impl)


@_ssd_scan_varlen_.register_fake
def _(x, dt, A, B, C, ssm_states, cu_seqlens, D, z, dt_bias, cache_indices, has_initial_state, out,
      chunk_states_out, chunk_size, dt_softplus, dt_min, dt_max, pad_slot_id, n_chunks, A_is_log,
      rand_seed, norm_weight, norm_sumsq):
    return None
