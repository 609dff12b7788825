"""Byte models: the minimum bytes a kernel must move, for GB/s and % of measured copy bandwidth;
and the FLOP model of the chunked scan, for TFLOP/s and % of the measured matmul rate.

Counting rules (STYLE.md section 6, PEERS.md): the state rows actually touched are read and written
once, every input is read once, every output written once, and a broadcast (stride-0) operand is
counted at its stored size. Untouched cache slots cost nothing.
"""
from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple

import torch

FP32 = 4  # A, D and dt_bias are per-head fp32 vectors
INDEX = 4  # slot indices and cu_seqlens are int32
FLAG = 1  # has_initial_state is bool


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def ssu_bytes(
    B: int,
    H: int,
    P: int,
    N: int,
    G: int,
    *,
    state_dtype: torch.dtype,
    act_dtype: torch.dtype,
    has_z: bool = True,
    has_D: bool = True,
    has_dt_bias: bool = True,
    has_indices: bool = True,
) -> int:
    """selective_state_update, one token per request.

    state  2*B*H*P*N*s (B rows read and written)   x, y  B*H*P*a each   z  B*H*P*a
    B, C   2*B*G*N*a                               dt    B*H*a (stride-0 over P)
    A, D, dt_bias  H*4 each (fp32 per head, stride-0 over P and N)      indices  B*4
    """
    s, a = _size(state_dtype), _size(act_dtype)
    n = 2 * B * H * P * N * s  # state
    n += 2 * B * H * P * a  # x read, y written
    n += B * H * P * a if has_z else 0
    n += 2 * B * G * N * a  # B, C
    n += B * H * a  # dt, stride-0 over P
    n += H * FP32  # A
    n += H * FP32 if has_D else 0
    n += H * FP32 if has_dt_bias else 0
    n += B * INDEX if has_indices else 0
    return n


def conv_update_bytes(
    B: int,
    D: int,
    W: int,
    state_len: int,
    *,
    state_dtype: torch.dtype,
    act_dtype: torch.dtype,
    has_bias: bool = True,
    has_indices: bool = True,
) -> int:
    """causal_conv1d_update, one token per request.

    conv_state  2*B*D*state_len*s   x, out  B*D*a each   weight  D*W*a   bias  D*a   indices  B*4
    """
    s, a = _size(state_dtype), _size(act_dtype)
    n = 2 * B * D * state_len * s
    n += 2 * B * D * a
    n += D * W * a
    n += D * a if has_bias else 0
    n += B * INDEX if has_indices else 0
    return n


def norm_bytes(M: int, Dh: int, *, act_dtype: torch.dtype, has_z: bool = True, has_bias: bool = False) -> int:
    """Gated RMSNorm over M rows of Dh: x (and z) read, y written, weight (and bias) read once."""
    a = _size(act_dtype)
    n = (3 if has_z else 2) * M * Dh * a
    n += Dh * a
    n += Dh * a if has_bias else 0
    return n


def conv_fn_bytes(B: int, L: int, D: int, W: int, *, act_dtype: torch.dtype, has_bias: bool = True) -> int:
    """causal_conv1d_fn (prefill), no initial or final states: either memory layout.

    x, out  B*D*L*a each (x read once: the W-1 overlap between tiles is re-read from L2, not DRAM)
    weight  D*W*a   bias  D*a
    """
    a = _size(act_dtype)
    n = 2 * B * D * L * a
    n += D * W * a
    n += D * a if has_bias else 0
    return n


def ssd_bytes(
    T: int,
    H: int,
    P: int,
    N: int,
    G: int,
    *,
    act_dtype: torch.dtype,
    dt_dtype: torch.dtype,
    state_dtype: torch.dtype,
    states_read: int,
    states_written: int,
    final_dtype: torch.dtype | None = None,
    n_seqs: int = 0,
    has_z: bool = True,
    has_D: bool = True,
    has_dt_bias: bool = True,
    has_indices: bool = False,
) -> int:
    """Chunked scan (mamba_chunk_scan_combined / ssd_scan_varlen) over T tokens in all.

    x, out  T*H*P*a each   z  T*H*P*a   B, C  2*T*G*N*a   dt  T*H*d
    A, D, dt_bias  H*4 each (fp32 per head)
    states  states_read*H*P*N*s + states_written*H*P*N*f: the initial states actually read
            (dense: B when initial_states is given; varlen: the sequences with has_initial_state)
            in the state dtype s, and the final states written (one per sequence) in f =
            final_dtype (default: the state dtype; the dense API returns them in fp32)
    varlen (n_seqs > 0): cu_seqlens (n_seqs+1)*4; with has_indices, cache_indices n_seqs*4 and
            has_initial_state n_seqs*1
    The chunk states the kernels pass between their stages are intermediate traffic, not counted.
    """
    a, d, s = _size(act_dtype), _size(dt_dtype), _size(state_dtype)
    f = _size(final_dtype) if final_dtype is not None else s
    n = 2 * T * H * P * a  # x read, out written
    n += T * H * P * a if has_z else 0
    n += 2 * T * G * N * a  # B, C
    n += T * H * d  # dt
    n += H * FP32  # A
    n += H * FP32 if has_D else 0
    n += H * FP32 if has_dt_bias else 0
    n += states_read * H * P * N * s + states_written * H * P * N * f
    if n_seqs:
        n += (n_seqs + 1) * INDEX
        n += n_seqs * (INDEX + FLAG) if has_indices else 0
    return n


def ssd_flops(T: int, H: int, P: int, N: int, G: int, chunk_size: int) -> int:
    """Model FLOPs of the chunked scan over T tokens (2 per multiply-add), the tensor-core work
    of the SSD algorithm with chunk size Q, counted per token:

        C_i . B_j for the Q positions j of its chunk, per group     G*Q*N
        scores_ij x_j (intra-chunk output), per head                H*Q*P
        x_j B_j^T into the chunk state, per head                    H*P*N
        C_i . state (inter-chunk output), per head                  H*P*N

    flops = 2*T*(G*Q*N + H*Q*P + 2*H*P*N). Full Q x Q blocks are counted (no causal halving,
    as the kernels compute them); the elementwise work (softplus, exp, z gate, D) and the serial
    state passing between chunks are left out. mamba2-2.7b at T=8192, Q=256: 43.5 GFLOP.
    """
    Q = chunk_size
    return 2 * T * (G * Q * N + H * Q * P + 2 * H * P * N)


class ReplaySteadyState(NamedTuple):
    """Long-run averages of the replay cache per call (see :func:`spec_replay_steady_state`)."""

    checkpoint_rate: float  # fraction of calls that store the state (history would overflow)
    replayed: float  # history tokens replayed per call (hist_len + prev_accepted)


def spec_replay_steady_state(tokens: int, history: int, *, redraw: bool = False) -> ReplaySteadyState:
    """How often a replay call stores the state, and how many history tokens it replays, in steady
    state, with T = ``tokens`` per step on a cache of ``history`` (C) tokens and accepted counts
    uniform in 1..T. Exact (rational arithmetic), so a deterministic function of (T, C, redraw).

    The per-slot chain (fastmamba.ops.replay.ref): a call sees h = hist_len and a = prev_accepted,
    replays k = h + a tokens, and stores the state iff k + T > C (then h' = 0), else h' = k;
    a' = the step's accepted count. From h = 0 (just after a store) to the next store is a renewal
    cycle, so per call: checkpoint rate = 1 / E[calls per cycle], replayed = E[k per cycle] / E[calls].

    redraw=False  a is drawn once per request and then fixed: what ``bench spec`` times (each input
                  set commits the same per-request accepted tensor every call, so the timed graph
                  holds no random-number kernel). With room = C - T, a request with count a stores
                  the state every L_a = room // a + 1 calls and replays a, 2a, ..., L_a a tokens
                  (mean a (L_a + 1) / 2); both averaged over a in 1..T.
    redraw=True   a is redrawn every step (independent, uniform): a decoding engine's situation.
                  E[calls] L(h) and E[replayed] K(h) from h to the next store, by backward recursion
                  over h = room..0: L(h) = 1 + (1/T) sum_{a <= room-h} L(h+a),
                  K(h) = h + (T+1)/2 + (1/T) sum_{a <= room-h} K(h+a).

    >>> [round(v, 4) for v in spec_replay_steady_state(6, 32)]  # T=6, C=32: a store every 8.2 calls
    [0.1215, 15.9167]
    >>> [round(v, 4) for v in spec_replay_steady_state(6, 32, redraw=True)]
    [0.1221, 15.7053]
    """
    T, C = tokens, history
    if not 1 <= T <= C:
        raise ValueError(f"spec_replay_steady_state: expected 1 <= tokens <= history, got tokens={T}, history={C}")
    room = C - T  # hist_len + prev_accepted <= room: the step's T tokens fit after them, no store
    if not redraw:
        lengths = {a: room // a + 1 for a in range(1, T + 1)}
        rate = sum(Fraction(1, n) for n in lengths.values()) / T
        replayed = sum(Fraction(a * (n + 1), 2) for a, n in lengths.items()) / T
        return ReplaySteadyState(float(rate), float(replayed))
    calls = [Fraction(0)] * (room + 1)
    tokens_replayed = [Fraction(0)] * (room + 1)
    for h in range(room, -1, -1):
        nxt = range(h + 1, min(h + T, room) + 1)  # h + a for the counts a that do not overflow
        calls[h] = 1 + sum((calls[j] for j in nxt), Fraction(0)) / T
        tokens_replayed[h] = h + Fraction(T + 1, 2) + sum((tokens_replayed[j] for j in nxt), Fraction(0)) / T
    return ReplaySteadyState(float(1 / calls[0]), float(tokens_replayed[0] / calls[0]))


def spec_replay_bytes(
    B: int,
    T: int,
    H: int,
    P: int,
    N: int,
    G: int,
    *,
    history: int,
    state_dtype: torch.dtype,
    act_dtype: torch.dtype,
    dt_dtype: torch.dtype,
    redraw: bool = False,
) -> int:
    """replay_selective_state_update + its commit, T tokens per request, on a cache whose history
    holds up to C = ``history`` tokens (fastmamba.ops.replay): the EXPECTED bytes of one call in
    steady state, rounded to an integer. With p = the checkpoint rate and k = the tokens replayed
    per call from :func:`spec_replay_steady_state` (T, C, accepted counts uniform in 1..T; ``redraw``
    as there: False is what ``bench spec`` times):

    state        H*P*N*s read every call; H*P*N*s written with probability p (the history would overflow)
    replayed     k history tokens: old_x  H*P*a, old_B  G*N*a, old_dt and old_cumA  H*4 each, per token
    new inputs   x, z  T*H*P*a each   B, C  2*T*G*N*a   dt  T*H*d ([B, T, H], per head)
    outputs      y  T*H*P*a; the step appended to the history: old_x  T*H*P*a, old_B  T*G*N*a,
                 old_dt and old_cumA  T*H*4 each
    per slot     the op reads state_batch_indices, buf_idx, prev_accepted, hist_len; the commit reads
                 slots and accepted and writes buf_idx, prev_accepted, hist_len: 9*4 per request
    A, D, dt_bias  H*4 each (fp32 per head)
    The [B, H, T, T] scratch the precompute kernel hands the main kernel is intermediate traffic, not counted.
    """
    s, a, d = _size(state_dtype), _size(act_dtype), _size(dt_dtype)
    steady = spec_replay_steady_state(T, history, redraw=redraw)
    state = H * P * N * s
    per_req = state * (1 + steady.checkpoint_rate)
    per_req += steady.replayed * (H * P * a + G * N * a + 2 * H * FP32)  # replayed history tokens
    per_req += T * (2 * H * P * a + 2 * G * N * a + H * d)  # x, z, B, C, dt
    per_req += T * (2 * H * P * a + G * N * a + 2 * H * FP32)  # y, old_x, old_B, old_dt, old_cumA
    per_req += 9 * INDEX
    return round(B * per_req) + 3 * H * FP32


def spec_legacy_bytes(
    B: int,
    T: int,
    H: int,
    P: int,
    N: int,
    G: int,
    *,
    state_dtype: torch.dtype,
    act_dtype: torch.dtype,
    dt_dtype: torch.dtype,
    copy: bool,
) -> int:
    """The per-position ("legacy") verification step: multi-token ``selective_state_update``
    writing every position's state into ``intermediate_states`` [B, T, H, P, N] (state dtype),
    then, with ``copy``, the accepted position's state copied back into the slot.

    state        B*H*P*N*s read, B*H*P*N*s written (the op stores the last token's state in the slot too)
    per position T*B*H*P*N*s written (intermediate_states)
    new inputs   x, z  T*H*P*a each   B, C  2*T*G*N*a   dt  T*H*d     output  y  T*H*P*a
    A, D, dt_bias  H*4 each          state_batch_indices  B*4
    copy         one state per request read from intermediate_states and written to its slot:
                 2*B*H*P*N*s, plus its gather indices (slot and position, int64: 2*B*8)
    """
    s, a, d = _size(state_dtype), _size(act_dtype), _size(dt_dtype)
    state = H * P * N * s
    per_req = 2 * state + T * state
    per_req += T * (3 * H * P * a + 2 * G * N * a + H * d)
    per_req += INDEX
    if copy:
        per_req += 2 * state + 2 * 8
    return B * per_req + 3 * H * FP32


def moe_bytes(T: int, M: int, F: int, k: int, experts_touched: int, *, act_dtype: torch.dtype) -> int:
    """Routed MoE experts (``fused_moe``): the weights of the distinct experts the routing touched
    (up_proj [F, M] and down_proj [M, F] each), read once; x read and out written once; the
    routing (fp32 weights, int32 ids) read once. Intermediates (relu² activations, per-pair
    contributions) are not counted: a fused kernel need not move them.

    weights  2*experts_touched*M*F*a     x, out  2*T*M*a     routing  T*k*(4 + 4)
    """
    a = _size(act_dtype)
    return 2 * experts_touched * M * F * a + 2 * T * M * a + T * k * (FP32 + INDEX)


def moe_flops(T: int, M: int, F: int, k: int) -> int:
    """Routed MoE experts: two GEMMs of 2*M*F FLOPs per token-expert pair (relu², the routing
    weight and the k-sum are not counted)."""
    return 4 * T * k * M * F


def moe_route_bytes(T: int, E: int, k: int) -> int:
    """The router's selection (``moe_route``): fp32 logits [T, E] and bias [E] read; fp32 weights
    and int32 ids [T, k] written."""
    return T * E * FP32 + E * FP32 + T * k * (FP32 + INDEX)
