"""causal_conv1d_fn with seq_idx < 0 marking padding tokens (causal-conv1d's contract).

Padding positions get zero output and contribute nothing: every real token equals the reference
run on its sequence alone (unpadded), padding tokens are not convolved with each other, and the
final states are those of the row's last sequence (zeros when the row ends with padding).
"""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops.conv1d_fn import causal_conv1d_fn
from fastmamba.ops.conv1d_fn.ref import causal_conv1d_fn_ref
from tests.helpers import seeded, tol
from tests.ops.conv1d_fn.test_conv1d_fn import make_x

P = -1
# B=3, L=19: padding at the start, between sequences (one token, and more than W-1), at the end;
# a sequence of one token, one shorter than W-1; row 2 ends on a real sequence, row 1 starts on one
SEQ_IDX = [
    [P, P, 0, 0, 0, 0, 0, P, 1, 1, 1, 1, 1, 1, 1, 1, P, P, P],
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, P, P, P, P, P, 3, P, 4, 4],
    [P, P, P, P, P, 7, 7, 7, 7, 7, 7, 7, 7, 7, -5, 8, 8, 8, 8],
]


def runs(ids: list[int]) -> list[tuple[int, int]]:
    """Maximal [start, end) runs of one non-negative id."""
    out, t = [], 0
    while t < len(ids):
        e = t
        while e < len(ids) and ids[e] == ids[t]:
            e += 1
        if ids[t] >= 0:
            out.append((t, e))
        t = e
    return out


@pytest.mark.parametrize(
    "layout, dtype, W",
    [
        ("channel_last", torch.float32, 4),
        ("channel_last", torch.bfloat16, 4),
        ("channel_last", torch.float32, 2),
        ("channel_last", torch.float32, 6),
        ("slice", torch.float16, 3),
        ("channel_first", torch.float32, 4),
        ("channel_first", torch.bfloat16, 5),
        ("strided", torch.float32, 4),
    ],
    ids=["channel-last", "channel-last-bf16", "W2", "W6", "slice-fp16-W3", "channel-first", "channel-first-bf16-W5",
         "strided"],
)
@pytest.mark.parametrize("init", [False, True], ids=["no-init", "init"])
def test_padding_tokens_are_zero_and_invisible(layout: str, dtype: torch.dtype, W: int, init: bool, device):
    g = seeded(5)
    B, D, L = 3, 40, 19
    x = make_x(layout, B, D, L, g).to(device=device, dtype=dtype)
    w = (torch.randn(D, W, generator=g) / W**0.5).to(device=device, dtype=dtype)
    bias = (0.5 + 0.1 * torch.randn(D, generator=g)).to(device=device, dtype=dtype)  # nonzero: act(bias) != 0
    h0 = torch.randn(B, D, W - 1, generator=g).to(device=device, dtype=dtype) if init else None
    seq_idx = torch.tensor(SEQ_IDX, dtype=torch.int32, device=device)
    y, final = causal_conv1d_fn(x, w, bias, seq_idx, h0, True, activation="silu")

    pad = seq_idx < 0
    assert (y.transpose(1, 2)[pad] == 0).all()
    y_ref, final_ref = causal_conv1d_fn_ref(x, w, bias, seq_idx, h0, True, activation="silu")
    torch.testing.assert_close(y.float(), y_ref.float(), **tol(dtype))
    assert torch.equal(final, final_ref)

    # every real token == its sequence on its own, unpadded (the row's first sequence continues
    # from the initial states when it starts at token 0: the history carries seq_idx[b, 0])
    for b in range(B):
        seqs = runs(SEQ_IDX[b])
        for s, e in seqs:
            hist = h0[b : b + 1] if init and s == 0 else None
            want, want_final = causal_conv1d_fn_ref(x[b : b + 1, :, s:e], w, bias, None, hist, True, activation="silu")
            torch.testing.assert_close(y[b : b + 1, :, s:e].float(), want.float(), **tol(dtype))
            if e == L:
                assert torch.equal(final[b : b + 1], want_final)
        if SEQ_IDX[b][-1] < 0:
            assert (final[b] == 0).all()


@pytest.mark.parametrize("layout", ["channel_last", "channel_first"])
def test_all_padding_row(layout: str, device):
    """A row of padding only: zero output and zero final states, whatever the initial states."""
    g = seeded(6)
    x = make_x(layout, 2, 40, 11, g).to(device)
    w, bias = torch.randn(40, 4, generator=g).to(device), torch.ones(40, device=device)
    h0 = torch.randn(2, 40, 3, generator=g).to(device)
    seq_idx = torch.tensor([[P] * 11, [0] * 11], dtype=torch.int64, device=device)
    y, final = causal_conv1d_fn(x, w, bias, seq_idx, h0, True)
    assert (y[0] == 0).all() and (final[0] == 0).all()
    want, want_final = causal_conv1d_fn_ref(x[1:], w, bias, None, h0[1:], True)
    torch.testing.assert_close(y[1:], want, **tol(torch.float32))
    assert torch.equal(final[1:], want_final)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["slice", "channel_first"])
def test_padding_full_shape_gpu(layout: str, device):
    """bf16 at a Mamba-2 width with fp32 weights: packed sequences separated by padding runs
    (lengths 1 to 300), zero at every padding position, the reference everywhere else."""
    g = seeded(9)
    B, D, L, W = 2, 5376, 1500, 4
    x = make_x(layout, B, D, L, g).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(D, W, generator=g) / W**0.5).to(device)
    bias = torch.randn(D, generator=g).to(device)
    h0 = torch.randn(B, D, W - 1, generator=g).to(device, torch.bfloat16)
    ids = []
    for b in range(B):
        row, sid = [], 0
        while len(row) < L:
            n = int(torch.randint(1, 300, (1,), generator=g))
            pad = int(torch.randint(0, 5, (1,), generator=g))
            row += [sid] * n + [P] * pad
            sid += 1
        ids.append(row[:L])
    seq_idx = torch.tensor(ids, dtype=torch.int32, device=device)
    y, final = causal_conv1d_fn(x, w, bias, seq_idx, h0, True, activation="silu")
    assert (y.transpose(1, 2)[seq_idx < 0] == 0).all()
    y_ref, final_ref = causal_conv1d_fn_ref(x, w, bias, seq_idx, h0, True, activation="silu")
    torch.testing.assert_close(y.float(), y_ref.float(), **tol(torch.bfloat16))
    assert torch.equal(final, final_ref)
