"""Drop-in dtypes: fp32 weight / bias (and fp32 initial / final states) next to fp16 or bf16 x,
as causal-conv1d accepts and its callers pass. Compared with the reference computed from the very
same tensors (fp32 inside); y keeps x's dtype, the states their own.
"""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops.conv1d_fn import causal_conv1d_fn, causal_conv1d_varlen
from fastmamba.ops.conv1d_fn.ref import causal_conv1d_fn_ref, causal_conv1d_varlen_ref
from tests.helpers import nan_like, seeded, tol
from tests.ops.conv1d_fn.test_conv1d_fn import assert_moved_equal, make_x

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize(
    "layout, x_dtype, w_dtype, bias_dtype, state_dtype",
    [
        ("channel_last", BF16, F32, F32, None),
        ("channel_last", F16, F32, F32, F32),
        ("channel_last", BF16, F32, None, F32),
        ("slice", BF16, F32, BF16, BF16),  # bias in x's dtype, weight fp32
        ("channel_first", BF16, F32, F32, F32),
        ("channel_first", F16, F32, F32, None),
        ("strided", BF16, F32, F32, F32),
        ("channel_last", F32, BF16, BF16, F32),  # 16-bit weights next to fp32 x
    ],
    ids=["cl-bf16-w32", "cl-fp16-w32-s32", "cl-bf16-w32-nobias", "slice-bf16-w32-b16-s16", "cf-bf16-w32-s32",
         "cf-fp16-w32", "strided-bf16-w32-s32", "cl-fp32-w16"],
)
def test_fn_mixed_dtypes_match_ref(layout, x_dtype, w_dtype, bias_dtype, state_dtype, device):
    g = seeded(7)
    B, D, L, W = 2, 40, 19, 4
    x = make_x(layout, B, D, L, g).to(device=device, dtype=x_dtype)
    w = (torch.randn(D, W, generator=g) / W**0.5).to(device=device, dtype=w_dtype)
    bias = None if bias_dtype is None else (0.1 * torch.randn(D, generator=g)).to(device=device, dtype=bias_dtype)
    seq_idx = torch.tensor([[0] * 7 + [1] * 12, [0] * 19], dtype=torch.int32, device=device)
    h0 = None
    final = None
    if state_dtype is not None:
        h0 = torch.randn(B, D, W - 1, generator=g).to(device=device, dtype=state_dtype)
        final = nan_like(torch.empty(B, D, W - 1, device=device, dtype=state_dtype))
    y, final_got = causal_conv1d_fn(x, w, bias, seq_idx, h0, True, final, activation="silu")
    y_ref, final_ref = causal_conv1d_fn_ref(x, w, bias, seq_idx, h0, True, activation="silu")
    assert y.dtype == x_dtype
    torch.testing.assert_close(y.float(), y_ref.float(), **tol(x_dtype))
    assert final_got.dtype == (state_dtype or x_dtype)
    assert_moved_equal(final_got, final_ref.to(final_got.dtype), x_dtype)


@pytest.mark.parametrize(
    "x_dtype, w_dtype, state_dtype",
    [(BF16, F32, F32), (BF16, F32, BF16), (F16, F32, F16), (F16, F32, F32)],
    ids=["bf16-w32-s32", "bf16-w32-s16", "fp16-w32-s16", "fp16-w32-s32"],
)
def test_varlen_mixed_dtypes_match_ref(x_dtype, w_dtype, state_dtype, device):
    g = seeded(8)
    lens, D, W, S = (7, 0, 2, 13), 40, 4, 6
    T = sum(lens)
    x = torch.randn(T, D + 8, generator=g)[:, 4 : 4 + D].to(device=device, dtype=x_dtype)
    w = (torch.randn(D, W, generator=g) / W**0.5).to(device=device, dtype=w_dtype)
    bias = (0.1 * torch.randn(D, generator=g)).to(device=device, dtype=w_dtype)
    states = torch.randn(S, D, W - 1, generator=g).to(device=device, dtype=state_dtype)
    cu = torch.tensor([0, 7, 7, 9, 22], dtype=torch.int32, device=device)
    idx = torch.tensor([4, 0, -1, 2], dtype=torch.int32, device=device)
    has_init = torch.tensor([True, True, False, True], device=device)
    got_states, ref_states = states.clone(), states.clone()
    out = nan_like(torch.empty(T, D, device=device, dtype=x_dtype))
    y = causal_conv1d_varlen(x, w, bias, got_states, cu, idx, has_init, "silu", out=out)
    y_ref = causal_conv1d_varlen_ref(x, w, bias, ref_states, cu, idx, has_init, "silu")
    assert y is out
    torch.testing.assert_close(y.float(), y_ref.float(), **tol(x_dtype))
    assert_moved_equal(got_states, ref_states, x_dtype)
