"""Byte models: the minimum bytes a kernel must move, for GB/s and % of measured copy bandwidth;
and the FLOP model of the chunked scan, for TFLOP/s and % of the measured matmul rate.

Counting rules (STYLE.md section 6, PEERS.md): the state rows actually touched are read and written
once, every input is read once, every output written once, and a broadcast (stride-0) operand is
counted at its stored size. Untouched cache slots cost nothing.
"""
from __future__ import annotations

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


def spec_replay_bytes(
    B: int,
    T: int,
    H: int,
    P: int,
    N: int,
    G: int,
    *,
    accepted: int,
    state_dtype: torch.dtype,
    act_dtype: torch.dtype,
    dt_dtype: torch.dtype,
) -> int:
    """replay_selective_state_update, T tokens per request, each slot replaying ``accepted`` (k)
    old tokens (fastmamba.ops.replay; old x, B, dt', cumA as its ReplayCache stores them).

    state        B*H*P*N*s read; B*H*P*N*s written when k > 0 (k = 0 stores nothing)
    replayed     k old tokens per request: old_x  k*H*P*a, old_B  k*G*N*a, old_dt and old_cumA  k*H*4 each
    new inputs   x, z  T*H*P*a each   B, C  2*T*G*N*a   dt  T*H*d ([B, T, H], per head)
    outputs      y  T*H*P*a; the step recorded for the next one: old_x  T*H*P*a, old_B  T*G*N*a,
                 old_dt and old_cumA  T*H*4 each
    per slot     state_batch_indices, buf_idx, prev_accepted: 3*4 per request
    A, D, dt_bias  H*4 each (fp32 per head)
    The [B, H, T, T] scratch the precompute kernel hands the main kernel is intermediate traffic, not counted.
    """
    s, a, d = _size(state_dtype), _size(act_dtype), _size(dt_dtype)
    k = accepted
    per_req = H * P * N * s * (2 if k > 0 else 1)  # state
    per_req += k * (H * P * a + G * N * a + 2 * H * FP32)  # replayed old tokens
    per_req += T * (2 * H * P * a + 2 * G * N * a + H * d)  # x, z, B, C, dt
    per_req += T * (2 * H * P * a + G * N * a + 2 * H * FP32)  # y, old_x, old_B, old_dt, old_cumA
    per_req += 3 * INDEX
    return B * per_req + 3 * H * FP32


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
