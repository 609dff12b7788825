"""Triton kernels of the FP8 ops (e4m3 = ``tl.float8e4nv`` = ``torch.float8_e4m3fn``), one
launcher per kernel. The math each implements is in ``ref.py``; the checks are in ``api.py``.

Quantisation multiplies by the scale's reciprocal (one ``div_rn`` a row: IEEE round-to-nearest, like
torch's ``1 / s``; a division per value was ~10 instructions in the decode GEMVs), clamps to
+-448 and rounds to the e4m3 grid in fp32 (``_round_e4m3``) before the cast, so the bytes it
writes equal the reference's. The explicit rounding is there for the CPU interpreter, whose
fp32 -> fp8e4nv cast does not round to nearest even (124.3 became 64, 100 became 104, subnormals
flushed: Triton 3.6); on a GPU the cast of an already representable value is exact, so it costs
a few ALU ops in a bandwidth-bound kernel.

Every e4m3 x e4m3 ``tl.dot`` passes ``max_num_imprecise_acc=BLOCK_K``: on sm_90 Triton's default
(2^30) keeps the whole K sum in the tensor cores' FP8 accumulator, which holds about 14 bits
(DeepSeek-V3's report on Hopper), so h drifted from the fp32 reference by ~2^-14 and its e4m3
requantisation flipped grid values often enough to move 0.8% of Nano's outputs by up to 0.18 at
1024 tokens (H100 run, 2026-12-06). With it, each K tile's products are added into the fp32
accumulator in registers (DeepSeek-V3's promotion), as the reference sums them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fastmamba.ops._common.dispatch import inline_asm_ok
from fastmamba.ops._common.launch import lean
from fastmamba.ops._common.pdl import pdl_active
from fastmamba.ops.fp8.configs import FMA_MAX_ROWS, GemvConfig
from fastmamba.ops.fp8.ref import AMAX_FLOOR, FP8_MAX


@triton.jit
def _round_e4m3(x):
    """fp32 x with |x| <= 448 -> the nearest e4m3 value (ties to even) as fp32: the grid step is
    2^(e - 3) for exponent e >= -6 and 2^-9 below (subnormals); x * (1 / step) is exact (powers of two),
    and adding then subtracting 1.5 * 2^23 rounds it to an integer, ties to even."""
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    g = tl.maximum(e, -6) - 3
    step = ((g + 127) << 23).to(tl.float32, bitcast=True)
    y = x * ((127 - g) << 23).to(tl.float32, bitcast=True)   # x / step, exact
    r = (y + 12582912.0) - 12582912.0
    return tl.where(r == 0.0, x * 0.0, r * step)  # a zero keeps x's sign (-0.0 as torch's cast)


@triton.jit
def _reciprocal(scale):
    """1 / scale in fp32, IEEE round-to-nearest (as torch's ``1.0 / s``): the factor ``_e4m3_of`` takes."""
    return tl.div_rn(1.0 + tl.zeros_like(scale), scale)


@triton.jit
def _e4m3_of(x, inv_scale, QMAX: tl.constexpr, ON_GPU: tl.constexpr = False):
    """fp32 x * inv_scale (``_reciprocal`` of the scale, broadcast), clamped to +-QMAX, as the nearest e4m3 value in fp32
    (exact): every quantisation in this file, so that the fused ones equal ``quantize_per_token``.
    ON_GPU (a CUDA tensor outside the interpreter: ``inline_asm_ok``): the rounding is the cast's own
    (sm_89+ converts fp32 to e4m3 with round-to-nearest-even, the same value as ``_round_e4m3`` in
    fewer instructions: the decode GEMVs quantise their input in every program); the interpreter's
    cast does not round so."""
    c = tl.minimum(tl.maximum(x * inv_scale, -QMAX), QMAX)
    if ON_GPU:
        return c.to(tl.float8e4nv).to(tl.float32)
    else:
        return _round_e4m3(c)


@triton.jit
def _dynamic_scale(amax, AMAX_MIN: tl.constexpr, QMAX: tl.constexpr):
    """A row's scale from its largest |x| (a scalar, or one per row): max(amax, AMAX_MIN) / QMAX."""
    m = tl.maximum(amax, AMAX_MIN)
    return tl.div_rn(m, QMAX + tl.zeros_like(m))


@triton.jit
def _row_amax(row_ptr, stride_k, K, BLOCK_K: tl.constexpr, RELU2: tl.constexpr = False):
    """The largest |x| of one row of K values (any dtype, read as fp32), in BLOCK_K steps; RELU2: of
    relu(x)² rounded to x's dtype (``_relu2_in_dtype``) instead."""
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(row_ptr + k * stride_k, mask=k < K, other=0.0).to(tl.float32)
        if RELU2:
            x = _relu2_in_dtype(x, row_ptr.dtype.element_ty)
        amax = tl.maximum(amax, tl.abs(x))
    return tl.max(amax, axis=0)


@triton.jit(do_not_specialize=["T"])
def _quantize_per_token_kernel(x_ptr, q_ptr, s_ptr, T, K, stride_x_t, stride_x_k, stride_q_t,
                               AMAX_MIN: tl.constexpr, QMAX: tl.constexpr, BLOCK_K: tl.constexpr):
    # one program per row t: amax over K (first pass), then scale and cast (second pass)
    t = tl.program_id(0)
    scale = _dynamic_scale(_row_amax(x_ptr + t * stride_x_t, stride_x_k, K, BLOCK_K), AMAX_MIN, QMAX)
    tl.store(s_ptr + t, scale)
    inv = _reciprocal(scale)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * stride_x_t + k * stride_x_k, mask=k < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + t * stride_q_t + k, _e4m3_of(x, inv, QMAX).to(tl.float8e4nv), mask=k < K)


def launch_quantize_per_token(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """x [T, K] (any strides) -> q [T, K] e4m3 (unit stride along K), s [T] fp32 (written)."""
    T, K = x.shape
    block = min(1024, triton.next_power_of_2(max(K, 16)))
    _quantize_per_token_kernel[(T,)](x, q, s, T, K, x.stride(0), x.stride(1), q.stride(0),
                                     AMAX_MIN=AMAX_FLOOR, QMAX=FP8_MAX, BLOCK_K=block, num_warps=4)


@triton.jit(do_not_specialize=["T"])
def _quantize_static_kernel(x_ptr, q_ptr, s_ptr, T, K, stride_x_t, stride_x_k, stride_q_t,
                            QMAX: tl.constexpr, BLOCK_K: tl.constexpr):
    # one program per (row t, block of K): one scale for the whole tensor
    t = tl.program_id(0)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + t * stride_x_t + k * stride_x_k, mask=k < K, other=0.0).to(tl.float32)
    tl.store(q_ptr + t * stride_q_t + k, _e4m3_of(x, _reciprocal(tl.load(s_ptr)), QMAX).to(tl.float8e4nv), mask=k < K)


def launch_quantize_static(x: torch.Tensor, scale: torch.Tensor, q: torch.Tensor) -> None:
    """x [T, K] (any strides), scale one fp32 value -> q [T, K] e4m3 (unit stride along K; written)."""
    T, K = x.shape
    block = min(1024, triton.next_power_of_2(max(K, 16)))
    _quantize_static_kernel[(T, triton.cdiv(K, block))](x, q, scale, T, K, x.stride(0), x.stride(1), q.stride(0),
                                                       QMAX=FP8_MAX, BLOCK_K=block, num_warps=4)


@triton.jit
def _round_as_torch(x, dtype: tl.constexpr):
    """fp32 x rounded to ``dtype`` (nearest, ties to even, as PyTorch's elementwise ops round) and
    back to fp32. bf16 by its bits: the CPU interpreter's fp32 -> bf16 cast truncates (Triton 3.6,
    docs/interpreter_bf16.md) where a GPU's rounds to nearest even; both then give PyTorch's value."""
    if dtype == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        return b.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _add_unfused(a, b, ON_GPU: tl.constexpr):
    """fp32 a + b, rounded once as an add of its own. On a GPU an ``add.rn`` (PTX: an add with an
    explicit rounding mode is never contracted with the multiply before it into an fma; a plain
    add was, so an fp32 GEMV's ``y = acc * s + add`` skipped the product's rounding that PyTorch's
    ``fp8_gemv(...) + add`` has: H100, 2026-12-07). The interpreter never fuses."""
    if ON_GPU:
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a + b


@triton.jit
def _relu2_in_dtype(x, dtype: tl.constexpr):
    """relu(x)² of fp32 x rounded to ``dtype`` and back: what ``torch.relu(h).square()`` gives for
    an h of that dtype (the square computed in fp32, rounded once)."""
    r = tl.maximum(x, 0.0)
    return _round_as_torch(r * r, dtype)


@triton.jit
def _gemv_x_tile(x_ptr, t, k, T, K, stride_x_t, sx_inv, RELU2_IN: tl.constexpr, QUANT: tl.constexpr,
                 USE_DOT: tl.constexpr, ON_GPU: tl.constexpr, QMAX: tl.constexpr, EVEN: tl.constexpr):
    """x[t, k] [BLOCK_T, BLOCK_K] as the GEMV multiplies it: e4m3 for the dot, its fp32 value for FMA
    (QUANT 1 / 2: quantised with sx_inv [BLOCK_T], the reciprocals of the rows' scales)."""
    if EVEN:
        x = tl.load(x_ptr + t[:, None] * stride_x_t + k[None, :], mask=t[:, None] < T, other=0.0)
    else:
        x = tl.load(x_ptr + t[:, None] * stride_x_t + k[None, :], mask=(t[:, None] < T) & (k[None, :] < K), other=0.0)
    if QUANT != 0:  # the e4m3 value as fp32 (exact), as quantize_per_token / quantize_static write it
        xf = x.to(tl.float32)
        if RELU2_IN:
            xf = _relu2_in_dtype(xf, x_ptr.dtype.element_ty)
        x = _e4m3_of(xf, sx_inv[:, None], QMAX, ON_GPU)
        if USE_DOT:
            x = x.to(tl.float8e4nv)
    elif not USE_DOT:
        x = x.to(tl.float32)
    return x


@triton.jit
def _gemv_w_tile(w_rows, n, k, N, K, EVEN: tl.constexpr):
    """w[n, k] [BLOCK_N, BLOCK_K] e4m3 (zeros outside N x K)."""
    if EVEN:
        return tl.load(w_rows + k[None, :])
    else:
        return tl.load(w_rows + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)


@triton.jit
def _gemv_mul(acc, x, w, USE_DOT: tl.constexpr, SWAP_AB: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + the products of one tile: x [BLOCK_T, BLOCK_K] (``_gemv_x_tile``), w [BLOCK_N, BLOCK_K]
    e4m3; acc [BLOCK_N, BLOCK_T] (SWAP_AB), [BLOCK_T, BLOCK_N] (dot) or [BLOCK_T, BLOCK_N, BLOCK_K] (FMA)."""
    if USE_DOT and SWAP_AB:
        return tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=BLOCK_K)
    elif USE_DOT:
        return tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=BLOCK_K)  # fp32 sums per tile (module docstring)
    else:
        return acc + x[:, None, :] * w.to(tl.float32)[None, :, :]


@triton.jit
def _one_row_x(x_ptr, k, K, sx_inv, RELU2_IN: tl.constexpr, QUANT: tl.constexpr, ON_GPU: tl.constexpr,
               EVEN: tl.constexpr, QMAX: tl.constexpr):
    """x[k] [BLOCK_K] of the one row as fp32: its e4m3 value (QUANT 1 / 2, with sx_inv the reciprocal
    of its scale, as quantize_per_token / quantize_static write it), or x's own (QUANT 0: e4m3)."""
    if EVEN:
        x = tl.load(x_ptr + k).to(tl.float32)
    else:
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    if QUANT != 0:
        if RELU2_IN:
            x = _relu2_in_dtype(x, x_ptr.dtype.element_ty)
        x = _e4m3_of(x, sx_inv, QMAX, ON_GPU)
    return x


@triton.jit
def _one_row_fma(x_ptr, sx_ptr, w, w_rows, n, kb, N, K, RELU2_IN: tl.constexpr, QUANT: tl.constexpr,
                 ON_GPU: tl.constexpr, EVEN: tl.constexpr, AMAX_MIN: tl.constexpr, QMAX: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``_fp8_gemv_kernel``'s K loop for one row on fp32 FMAs (``w`` its first weight tile, loaded):
    the sums [1, BLOCK_N] and the row's scale [1]. x stays a [BLOCK_K] vector that broadcasts over the
    tile's rows; as a [1, BLOCK_K] tile against a [1, BLOCK_N, BLOCK_K] product it cost 2-3 more SASS
    instructions a weight (layout changes through shared memory; sm_90, Triton 3.6)."""
    if QUANT == 1:
        sx = _dynamic_scale(_row_amax(x_ptr, 1, K, BLOCK_K, RELU2_IN), AMAX_MIN, QMAX)
    else:  # QUANT 0: x's row scale; 2: the static scale
        sx = tl.load(sx_ptr)
    sx_inv = _reciprocal(sx) if QUANT != 0 else sx  # (QUANT 0: not read)
    acc = w.to(tl.float32) * _one_row_x(x_ptr, kb, K, sx_inv, RELU2_IN, QUANT, ON_GPU, EVEN, QMAX)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + kb
        w = _gemv_w_tile(w_rows, n, k, N, K, EVEN)
        acc += w.to(tl.float32) * _one_row_x(x_ptr, k, K, sx_inv, RELU2_IN, QUANT, ON_GPU, EVEN, QMAX)[None, :]
    return tl.sum(acc, axis=1)[None, :], sx + tl.zeros([1], dtype=tl.float32)


@triton.heuristics({"HAS_BIAS": lambda a: a["b_ptr"] is not None, "HAS_ADD": lambda a: a["add_ptr"] is not None})
@triton.jit(do_not_specialize=["T"])
def _fp8_gemv_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, add_ptr, y_ptr, T, N, K,
                     stride_x_t, stride_w_n, stride_sw_n, stride_add_t, stride_y_t,
                     HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr, RELU2_IN: tl.constexpr, QUANT: tl.constexpr,
                     USE_DOT: tl.constexpr, SWAP_AB: tl.constexpr, ON_GPU: tl.constexpr, EVEN: tl.constexpr,
                     USE_PDL: tl.constexpr, AMAX_MIN: tl.constexpr, QMAX: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE_ROW: tl.constexpr = False):
    # one program per block of N output features, all T (<= BLOCK_T) rows: each weight tile is read
    # once, under PDL the first one before the grid-dependency wait (weights are never written by
    # the kernel before). USE_DOT: an e4m3 x e4m3 tensor-core dot over rows padded to 16; else fp32
    # FMAs (1-2 rows) into a [BLOCK_T, BLOCK_N, BLOCK_K] accumulator summed once at the end.
    # SWAP_AB (with USE_DOT): the weight tile is the dot's left operand (y^T = w x^T: BLOCK_N rows
    # of the MMA, the padded rows its 16 columns), the shape Hopper's warpgroup MMA takes at M >= 64.
    # QUANT 0: x is e4m3 with row scales sx; 1: x in 16/32 bits, quantised here per token (a first
    # pass over x for the row maxima; x is small and L2-resident); 2: x quantised here with the
    # static scale sx[0]. Products of two e4m3 values are exact in fp32; sums in fp32.
    # RELU2_IN (QUANT 1 / 2): the input is relu(x)² rounded to x's dtype (an MLP's down projection
    # reading its up projection's output). HAS_ADD: y = round(round(y) + add) (a residual sum).
    # EVEN: N and K are multiples of the tile (no masks on the weight). ONE_ROW (BLOCK_T 1, FMA):
    # the K loop of ``_one_row_fma``.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, BLOCK_T)
    kb = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_w_n
    w = _gemv_w_tile(w_rows, n, kb, N, K, EVEN)                                      # [BLOCK_N, BLOCK_K] e4m3
    if USE_PDL:
        gdc_wait()  # x comes from the kernel before; the first weight tile is already in flight
        gdc_launch_dependents()
    if ONE_ROW:  # one row of fp32 FMAs: x a [BLOCK_K] vector over the tile's rows
        acc, sx = _one_row_fma(x_ptr, sx_ptr, w, w_rows, n, kb, N, K, RELU2_IN, QUANT, ON_GPU, EVEN, AMAX_MIN, QMAX,
                               BLOCK_N, BLOCK_K)
    else:
        if QUANT == 0:
            sx = tl.load(sx_ptr + t, mask=t < T, other=0.0)
        elif QUANT == 1:
            amax = tl.zeros([BLOCK_T], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + kb
                xa = tl.load(x_ptr + t[:, None] * stride_x_t + k[None, :], mask=(t[:, None] < T) & (k[None, :] < K),
                             other=0.0).to(tl.float32)
                if RELU2_IN:
                    xa = _relu2_in_dtype(xa, x_ptr.dtype.element_ty)
                amax = tl.maximum(amax, tl.max(tl.abs(xa), axis=1))
            sx = _dynamic_scale(amax, AMAX_MIN, QMAX)
        else:
            sx = tl.load(sx_ptr) + tl.zeros([BLOCK_T], dtype=tl.float32)
        sx_inv = _reciprocal(sx) if QUANT != 0 else sx  # (QUANT 0: not read)
        if USE_DOT and SWAP_AB:
            acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        elif USE_DOT:
            acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_K], dtype=tl.float32)
        x = _gemv_x_tile(x_ptr, t, kb, T, K, stride_x_t, sx_inv, RELU2_IN, QUANT, USE_DOT, ON_GPU, QMAX, EVEN)
        acc = _gemv_mul(acc, x, w, USE_DOT, SWAP_AB, BLOCK_K)
        for k0 in range(BLOCK_K, K, BLOCK_K):  # (the dot's weight loads: Triton pipelines them, num_stages deep)
            k = k0 + kb
            w = _gemv_w_tile(w_rows, n, k, N, K, EVEN)
            x = _gemv_x_tile(x_ptr, t, k, T, K, stride_x_t, sx_inv, RELU2_IN, QUANT, USE_DOT, ON_GPU, QMAX, EVEN)
            acc = _gemv_mul(acc, x, w, USE_DOT, SWAP_AB, BLOCK_K)
        if USE_DOT and SWAP_AB:
            acc = tl.trans(acc)
        elif not USE_DOT:
            acc = tl.sum(acc, axis=2)
    sw = tl.load(sw_ptr + n * stride_sw_n, mask=n < N, other=0.0)
    y = acc * sx[:, None] * sw[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    if HAS_ADD:  # the product as this kernel would store it, plus add, rounded as PyTorch's `+` (then stored exactly)
        y = _round_as_torch(_add_unfused(y.to(y_ptr.dtype.element_ty).to(tl.float32), tl.load(
            add_ptr + t[:, None] * stride_add_t + n[None, :], mask=(t[:, None] < T) & (n[None, :] < N),
            other=0.0).to(tl.float32), ON_GPU), y_ptr.dtype.element_ty)
    tl.store(y_ptr + t[:, None] * stride_y_t + n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(t[:, None] < T) & (n[None, :] < N))


FUSE_QUANT = True  # fp8_gemv quantises x inside the GEMV (False: a quantisation kernel first; for the bench)


def launch_fp8_gemv(x: torch.Tensor, sx: torch.Tensor | None, w: torch.Tensor, sw: torch.Tensor,
                    bias: torch.Tensor | None, y: torch.Tensor, *, quant: int, cfg: GemvConfig,
                    relu2_input: bool = False, add: torch.Tensor | None = None) -> None:
    """x [T, K] (unit stride along K): e4m3 with sx [T] fp32 (quant 0), or 16/32-bit quantised in
    the kernel per token (quant 1, sx None) or with the one static scale sx (quant 2); w [N, K] e4m3,
    sw [N] fp32 (stride 0 for one scale), bias [N] or None -> y [T, N] (written). T <= 16.
    relu2_input (quant 1 / 2): the input is relu(x)² in x's dtype; add [T, N] (unit stride along N,
    y's dtype) or None: y = add + the product, each rounded to y's dtype as two PyTorch ops would.
    ``cfg``: ``configs.gemv_config`` (its use_dot; more than ``configs.FMA_MAX_ROWS`` rows: always the dot)."""
    T, K = x.shape
    N = w.shape[0]
    use_dot = cfg.use_dot or T > FMA_MAX_ROWS
    block_t = 16 if use_dot else T
    block_k = min(cfg.block_k, max(32, triton.next_power_of_2(K)))
    programs = triton.cdiv(N, cfg.block_n)
    use_pdl = pdl_active(x, programs, cfg.num_warps)
    lean(_fp8_gemv_kernel)[(programs,)](
        x, sx if sx is not None else sw, w, sw, bias, add, y, T, N, K, x.stride(0), w.stride(0), sw.stride(0),
        add.stride(0) if add is not None else 0, y.stride(0), RELU2_IN=relu2_input, QUANT=quant, USE_DOT=use_dot,
        SWAP_AB=use_dot and cfg.swap_ab, ON_GPU=inline_asm_ok(x), EVEN=N % cfg.block_n == 0 and K % block_k == 0,
        USE_PDL=use_pdl, AMAX_MIN=AMAX_FLOOR, QMAX=FP8_MAX, BLOCK_T=block_t, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        ONE_ROW=block_t == 1 and not use_dot, num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=use_pdl)


@triton.jit(do_not_specialize=["P"])
def _moe_pair_gemv_kernel(q_ptr, sq_ptr, w_ptr, s_ptr, ids_ptr, tw_ptr, out_ptr, P, N, K, TOP_K, E,
                          stride_q_r, stride_w_e, stride_w_n, stride_s_e, stride_se_n, stride_o_p,
                          Q_PER_PAIR: tl.constexpr, RELU2: tl.constexpr, QUANT: tl.constexpr, USE_DOT: tl.constexpr,
                          SWAP_AB: tl.constexpr, ON_GPU: tl.constexpr, EVEN: tl.constexpr, USE_PDL: tl.constexpr,
                          AMAX_MIN: tl.constexpr, QMAX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # one program per (token-expert pair p = t * TOP_K + j, block of BLOCK_N outputs): the pair's
    # expert rows are streamed once (only the chosen experts are read), e4m3 x e4m3 products summed
    # in fp32. The input row is q[t] (up: Q_PER_PAIR False) or q[p] (down: Q_PER_PAIR True).
    # QUANT 0: q is e4m3 with row scales sq; 1: q in 16/32 bits, quantised here per row as
    # quantize_per_token does (a first pass over the row for its maximum: a few KB, L2-resident);
    # 2: q in 16/32 bits, quantised here with the one static scale sq[0] (as quantize_static).
    # RELU2 (up): out = relu(acc * sq * s)^2; else (down): out = acc * sq * s * topk_weight[p].
    # USE_DOT: the sums on the tensor cores (the row padded to 16 with zeros; BLOCK_N >= 16, BLOCK_K >= 32)
    # instead of fp32 FMAs over converted weights; SWAP_AB (with USE_DOT): the weight tile as the dot's
    # left operand and the row as column 0 of its right one (as in the GEMV above). An expert id
    # outside [0, E) is not read and writes zeros (the k-sum then skips its row). The FMA loop keeps
    # [BLOCK_N, BLOCK_K] partial sums, summed once at the end. USE_PDL: the ids come from the kernel before, so the
    # program waits first (the launch itself is what PDL hides). EVEN: N and K are multiples of the tile.
    p = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = p // TOP_K
    row = p if Q_PER_PAIR else t
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    e = tl.load(ids_ptr + p).to(tl.int64)
    valid = (e >= 0) & (e < E)
    if QUANT == 1:
        sx = _dynamic_scale(_row_amax(q_ptr + row * stride_q_r, 1, K, BLOCK_K), AMAX_MIN, QMAX)
    elif QUANT == 2:
        sx = tl.load(sq_ptr)
    else:
        sx = tl.load(sq_ptr + row)
    sx_inv = _reciprocal(sx) if QUANT != 0 else sx  # (QUANT 0: not read)
    if USE_DOT and SWAP_AB:
        acc16 = tl.zeros([BLOCK_N, 16], dtype=tl.float32)  # the pair's column, then 15 columns of zeros
        first = tl.arange(0, 16)[None, :] == 0
    elif USE_DOT:
        acc16 = tl.zeros([16, BLOCK_N], dtype=tl.float32)  # the pair's row, then 15 rows of zeros
        first = tl.arange(0, 16)[:, None] == 0
    else:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    kb = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + e * stride_w_e + n.to(tl.int64)[:, None] * stride_w_n
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kb
        if EVEN:
            w = tl.load(w_rows + k[None, :], mask=valid, other=0.0)                            # [BLOCK_N, BLOCK_K] e4m3
        else:
            w = tl.load(w_rows + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K) & valid, other=0.0)
        x = _one_row_x(q_ptr + row * stride_q_r, k, K, sx_inv, False, QUANT, ON_GPU, EVEN, QMAX)  # [BLOCK_K] fp32
        if USE_DOT and SWAP_AB:
            x16 = tl.where(first, x[:, None], 0.0).to(tl.float8e4nv)                          # [BLOCK_K, 16]
            acc16 = tl.dot(w, x16, acc16, max_num_imprecise_acc=BLOCK_K)
        elif USE_DOT:  # the e4m3 tiles straight into the tensor cores (no conversion of the weights)
            x16 = tl.where(first, x[None, :], 0.0).to(tl.float8e4nv)
            acc16 = tl.dot(x16, tl.trans(w), acc16, max_num_imprecise_acc=BLOCK_K)
        else:
            acc2 += w.to(tl.float32) * x[None, :]
    if USE_DOT and SWAP_AB:
        acc = tl.sum(acc16, axis=1)  # column 0 (the others are exact zeros)
    elif USE_DOT:
        acc = tl.sum(acc16, axis=0)  # row 0 (the others are exact zeros)
    else:
        acc = tl.sum(acc2, axis=1)
    sw = tl.load(s_ptr + e * stride_s_e + n * stride_se_n, mask=(n < N) & valid, other=0.0)
    y = acc * sx * sw
    if RELU2:
        y = tl.maximum(y, 0.0)
        y = y * y
    else:
        y = y * tl.load(tw_ptr + p)
    tl.store(out_ptr + p * stride_o_p + n, y, mask=n < N)


def launch_moe_pair_gemv(q: torch.Tensor, sq: torch.Tensor | None, w: torch.Tensor, s: torch.Tensor, ids: torch.Tensor,
                         tw: torch.Tensor, out: torch.Tensor, *, top_k: int, per_pair: bool, relu2: bool,
                         quant: int, cfg: GemvConfig) -> None:
    """q [T or P, K] (unit stride along K): e4m3 with sq [T or P] fp32 (quant 0), or 16/32-bit
    quantised in the kernel per row (quant 1, sq None) or with the one static scale sq (quant 2);
    w [E, N, K] e4m3 (unit stride along K); s [E, N] fp32 (stride 0 along N for per-tensor scales);
    ids [P] int32 / int64, the flattened [T, top_k] (an id outside [0, E) reads nothing, writes
    zeros); tw [P] fp32; out [P, N] fp32 (written). ``cfg``: ``configs.gemv_config(..., "moe", 1, F, M)``."""
    P = ids.shape[0]
    E, N, K = w.shape
    block_k = min(cfg.block_k, max(32, triton.next_power_of_2(K)))  # (>= 32: the e4m3 dot's minimum)
    grid = (P, triton.cdiv(N, cfg.block_n))
    use_pdl = pdl_active(q, grid[0] * grid[1], cfg.num_warps)
    lean(_moe_pair_gemv_kernel)[grid](
        q, sq if sq is not None else s, w, s, ids, tw, out, P, N, K, top_k, E, q.stride(0), w.stride(0), w.stride(1),
        s.stride(0), s.stride(1), out.stride(0), Q_PER_PAIR=per_pair, RELU2=relu2, QUANT=quant, USE_DOT=cfg.use_dot,
        SWAP_AB=cfg.use_dot and cfg.swap_ab, ON_GPU=inline_asm_ok(q), EVEN=N % cfg.block_n == 0 and K % block_k == 0,
        USE_PDL=use_pdl, AMAX_MIN=AMAX_FLOOR, QMAX=FP8_MAX, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=use_pdl)
