"""Triton 3.6's CPU interpreter mis-emulates two bf16 operations (docs/interpreter_bf16.md).

Minimal reproducers, kernel against torch: each fails under the interpreter (``xfail``, strict,
so a Triton release that fixes it turns the run red and the workaround in
``fastmamba/ops/ssd_scan/chunked/kernel_common.py`` (``_mma``'s DOT_UPCAST) can go) and passes on a GPU.
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from fastmamba.ops._common.dispatch import interpreter_enabled

INTERPRETER_BUG = pytest.mark.xfail(
    interpreter_enabled(), strict=True, reason="Triton interpreter bf16 emulation (docs/interpreter_bf16.md)")


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr):
    offs = tl.arange(0, M)
    tile = offs[:, None] * M + offs[None, :]
    tl.store(c_ptr + tile, tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile)))


@triton.jit
def _cast_kernel(x_ptr, y_ptr, M: tl.constexpr):
    offs = tl.arange(0, M)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(tl.bfloat16))


@INTERPRETER_BUG
def test_bf16_dot(device):
    """tl.dot of two bf16 tiles: the interpreter keeps bf16 as uint16 and np.matmul multiplies
    the bit patterns (bf16 1.0 = 0x3F80 = 16256), so ones @ ones gives 16 * 16256**2 = 4.2e9
    instead of 16."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=g).to(device=device, dtype=torch.bfloat16)
    b = torch.randn(16, 16, generator=g).to(device=device, dtype=torch.bfloat16)
    c = torch.full((16, 16), float("nan"), device=device)
    _dot_kernel[(1,)](a, b, c, M=16)
    torch.testing.assert_close(c, a.float() @ b.float(), atol=1e-4, rtol=1e-4)


@INTERPRETER_BUG
def test_fp32_to_bf16_cast_rounds_to_nearest(device):
    """x.to(tl.bfloat16) rounds to nearest even on a GPU, as torch does; the interpreter
    truncates (1 + 2^-8 + 2^-10 -> 1.0 instead of 1.0078125)."""
    x = torch.full((16,), 1 + 2**-8 + 2**-10, device=device)
    y = torch.full((16,), float("nan"), device=device, dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, y, M=16)
    assert torch.equal(y, x.to(torch.bfloat16))
