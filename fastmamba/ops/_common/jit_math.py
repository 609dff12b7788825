"""Small @triton.jit helpers used by several kernels (inlined at compile time)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softplus(x):
    """log(1 + exp(x)) in fp32; returns x itself above 20, where the two agree to fp32 precision."""
    return tl.where(x <= 20.0, tl.log(1.0 + tl.exp(x)), x)


@triton.jit
def silu(x):
    """x * sigmoid(x) in fp32."""
    return x / (1.0 + tl.exp(-x))


# x * sigmoid(x) = x * rcp(1 + 2^(-x log2 e)) with the approximate PTX exp2 and reciprocal, for
# tl.inline_asm_elementwise(SILU_PTX, "=f,f", [x], ...) (kernels that inline it to spare the
# interpreter a jit call per row use it directly)
SILU_PTX = tl.constexpr("{ .reg .f32 e, d, r; mul.f32 e, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 e, e; "
                        "add.f32 d, e, 0f3F800000; rcp.approx.ftz.f32 r, d; mul.f32 $0, $1, r; }")


@triton.jit
def silu_approx(x, FAST: tl.constexpr):
    """x * sigmoid(x) in fp32 with the approximate PTX exp2 and reciprocal (FAST: GPU only, inline
    assembly; 5 instructions instead of ~12, relative error ~1e-7 -- x << 0 gives -0 as 1 + e^-x
    overflows to inf), else ``silu`` (the interpreter runs no inline assembly)."""
    if FAST:
        return tl.inline_asm_elementwise(SILU_PTX, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return silu(x)


@triton.jit
def exp_approx(x, FAST: tl.constexpr):
    """exp(x) in fp32 with the approximate PTX exp2 (FAST: GPU only, inline assembly; 2 instructions
    instead of ~5, relative error ~2^-22, subnormal results flushed to 0, exp(-inf) = 0), else tl.exp."""
    if FAST:
        return tl.inline_asm_elementwise(
            "{ .reg .f32 e; mul.f32 e, $1, 0f3FB8AA3B; ex2.approx.ftz.f32 $0, e; }",
            "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.exp(x)


@triton.jit
def stochastic_round(v, u, OUT_DTYPE: tl.constexpr):
    """Round fp32 ``v`` to ``OUT_DTYPE`` (fp16 or bf16) up or down at random, unbiased.

    Done in software so it runs on Hopper (the PTX ``cvt.rs`` instruction is Blackwell-only).
    ``lo`` is the round-to-nearest result; ``other`` is its neighbour on the far side of ``v``
    (one unit in the last place, by stepping the integer bits, which also covers subnormals and
    zero). ``v`` rounds to ``other`` with probability |v - lo| / |other - lo|, so the expected
    result equals ``v``. ``u`` holds uniform random fp32 numbers in [0, 1), one per element.
    Non-finite values and values beyond the largest finite ``OUT_DTYPE`` take the plain rounding.
    """
    lo = v.to(OUT_DTYPE)
    lo_f = lo.to(tl.float32)
    lo_bits = lo.to(tl.int16, bitcast=True)
    # magnitude of lo below |v| -> neighbour is one step away from zero (bits + 1), else toward it
    step = tl.where(tl.abs(lo_f) < tl.abs(v), 1, -1).to(tl.int16)
    other = (lo_bits + step).to(OUT_DTYPE, bitcast=True)
    other_f = other.to(tl.float32)
    gap = tl.abs(other_f - lo_f)
    p = tl.abs(v - lo_f) / tl.where(gap > 0, gap, 1.0)
    take_other = (u < p) & (lo_f == lo_f) & (tl.abs(other_f) < float("inf")) & (lo_f != v)
    return tl.where(take_other, other, lo)


@triton.jit
def split8(t):
    """[..., 8] -> the 8 tensors t[..., v], v = 0..7 in order. reshape + splits: when each thread
    holds its 8 values (a 16-byte vector of 16-bit ones), no data moves between threads."""
    k0, k1 = tl.split(tl.reshape(t, t.shape[:-1] + [2, 2, 2]))  # v = 4i + 2j + k: split takes k
    j0k0, j1k0 = tl.split(k0)
    j0k1, j1k1 = tl.split(k1)
    c0, c4 = tl.split(j0k0)
    c2, c6 = tl.split(j1k0)
    c1, c5 = tl.split(j0k1)
    c3, c7 = tl.split(j1k1)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def join8(c0, c1, c2, c3, c4, c5, c6, c7):
    """The inverse of ``split8``: eight tensors of one shape [...] -> [..., 8]."""
    k0 = tl.join(tl.join(c0, c4), tl.join(c2, c6))
    k1 = tl.join(tl.join(c1, c5), tl.join(c3, c7))
    return tl.reshape(tl.join(k0, k1), c0.shape + [8])
