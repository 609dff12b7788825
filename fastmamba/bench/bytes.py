"""Byte models: the minimum bytes a kernel must move, for GB/s and % of measured copy bandwidth.

Counting rules (STYLE.md section 6, PEERS.md): the state rows actually touched are read and written
once, every input is read once, every output written once, and a broadcast (stride-0) operand is
counted at its stored size. Untouched cache slots cost nothing.
"""
from __future__ import annotations

import torch

FP32 = 4  # A, D and dt_bias are per-head fp32 vectors
INDEX = 4  # slot indices are int32


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
