"""One launcher for the SSD-scan kernels, on inputs already checked and put in row form: the prep kernel,
chunk states and state passing (two Triton kernels, or on the Hopper path one Gluon walk:
``hopper_states``), the chunk outputs (Triton, or the Hopper kernel with the Triton one behind it for
a non-finite x).

Row form: every token tensor is 4-d (rows, tokens per row, heads or groups, P or N); dense input
is (B, L, ...) with row_len = L, packed varlen input is (1, T, ...) with row_len = T. Segments
are given by ``cu`` (n_seg + 1 offsets into the flat token index row * row_len + position).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import math

from fastmamba.ops._common.dispatch import inline_asm_ok, interpreter_enabled
from fastmamba.ops._common.pdl import TRIGGER_EARLY, pdl_active, pdl_chained, sm_count
from fastmamba.ops.ssd_scan.chunked.configs import block_p_of, check_config, pick_config
from fastmamba.ops.ssd_scan.hopper.chunk_output import chunk_output_sm90, hopper_chunk_output_ok
from fastmamba.ops.ssd_scan.hopper.states import chunk_states_sm90, hopper_states_ok
from fastmamba.ops._common.launch import lean
from fastmamba.ops.ssd_scan.chunked.kernel import (
    _chunk_prep_kernel,
    _chunk_scan_kernel,
    _chunk_state_kernel,
    _state_passing_kernel,
)
from fastmamba.ops.ssd_scan.chunked.kernel_common import d_strides, strides4
from fastmamba.ops._common.host_math import cdiv, next_power_of_2

# C B^T tile (rows = columns); the chunk scan reads it in its own tiles. At least 64: the Hopper
# kernel's 64 x 64 diagonal blocks rely on the zeros the diagonal tiles hold above the diagonal, and
# a smaller tile would leave part of such a block unwritten (tiles above the diagonal are skipped).
CB_BLOCK = 64
# the Triton chunk-scan programs launched after the Hopper kernel, per SM: one wave that exits at once
# unless the chunk-state kernel flagged a non-finite x
FLAGGED_PROGRAMS_PER_SM = 4


@dataclass
class ScanSegments:
    """Where segments start and end, and what state each one reads and writes.

    cu          [n_seg + 1] int32/int64 flat token offsets (device)
    n_chunks    number of chunk slots to allocate: the exact chunk count, or an upper bound
    skip        [n_seg] int8 or None: 1 = padding (output zeroed, no state read or written)
    init, init_idx    [*, H, P, N] and [n_seg] int32 (-1: start from zeros), or None
    final, final_idx  [*, H, P, N] and [n_seg] int32 (-1: not stored), or None; zero-length
                      segments never store
    final_seed  one-element int64 tensor or None: round 16-bit ``final`` stores stochastically
    seg_final   [n_seg, H, P, N] or None: every segment's final state
    chunk_out   [n_chunks, H, P, N] or None: the state after every chunk
    """

    cu: torch.Tensor
    n_chunks: int
    skip: torch.Tensor | None = None
    init: torch.Tensor | None = None
    init_idx: torch.Tensor | None = None
    final: torch.Tensor | None = None
    final_idx: torch.Tensor | None = None
    seg_final: torch.Tensor | None = None
    chunk_out: torch.Tensor | None = None
    final_seed: torch.Tensor | None = None

    @property
    def n_seg(self) -> int:
        return self.cu.shape[0] - 1


def _pdl(x: torch.Tensor, grid: tuple[int, ...], num_warps: int, *, chained: bool) -> dict:
    """Launch options of one of the scan's kernels under programmatic dependent launch
    (``fastmamba.ops._common.pdl``): each kernel waits for the one before at its start, so PDL hides
    the launch gap of single-wave grids (all of them at L=2048, the Hopper kernel and the Triton
    fallback after it, one wave of programs that exit at once unless flagged, at any length). The
    op's first kernel takes it only when PDL is switched on (the runtime's prefill graphs); a kernel
    after another of the op's own (``chained``) takes it on sm_90+ either way (``pdl_chained``)."""
    programs = math.prod(grid)
    use = pdl_chained(x, programs, num_warps) if chained else pdl_active(x, programs, num_warps)
    return dict(USE_PDL=use, PDL_TRIGGER=TRIGGER_EARLY, launch_pdl=use)


# The chunk-state kernel's 16-bit tiles take ~118 registers: 4 programs per SM. A grid of 4 to 5
# programs per SM (mamba2-2.7b at L=2048: 640 programs on 132 SMs) then runs in 1.2 waves; capped at
# STATE_REGS_CAP a fifth program fits and it runs in one (H200, .ab-style sweep of the captured
# launch: fp32 states 18.9 -> 17.4 us, bf16 15.4 -> 15.0; at L=8192, 4.85 waves, the cap gains nothing).
STATE_REGS_CAP = 96


def state_regs_cap(programs: int, sms: int) -> int:
    """The chunk-state launch's register cap for a grid of ``programs`` on ``sms`` SMs (0: none)."""
    return STATE_REGS_CAP if 4 * sms < programs <= 5 * sms else 0


def ssd_scan_launch(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    out: torch.Tensor,
    segments: ScanSegments,
    *,
    chunk_size: int,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    state_dtype: torch.dtype,
    A_is_log: bool = False,
    norm_weight: torch.Tensor | None = None,
    norm_sumsq: torch.Tensor | None = None,
    after_own_kernel: bool = False,
) -> None:
    """x, z, out [R, L, H, P]; dt [R, L, H]; B, C [R, L, G, N]; A [H] (A_log when A_is_log); D [H] or [H, P];
    norm_weight [H * P] and norm_sumsq [R * L, H * P / 16] or None (the deferred norm: ssd_scan_varlen).
    ``after_own_kernel``: the op launched a kernel of its own just before (the varlen slot rows), so
    the first kernel here may take PDL too."""
    _, row_len, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    Q = chunk_size
    n_seg = segments.n_seg
    n_chunks = max(segments.n_chunks, 1)
    interpreter = interpreter_enabled()
    fast_math = inline_asm_ok(x)  # the approximate PTX exp2 / silu
    cfg = pick_config(H, P, N, x.element_size(), interpreter=interpreter)
    check_config(cfg)
    block_n = max(16, next_power_of_2(N))
    block_p_full = max(16, next_power_of_2(P))
    block_p_scan = block_p_of(cfg, P)
    block_seg = max(16, next_power_of_2(n_seg + 1))
    dot_precision = "ieee" if x.dtype == torch.float32 else "tf32"
    # Triton 3.6's interpreter multiplies bf16 tl.dot operands as raw bits (docs/interpreter_bf16.md)
    dot_upcast = interpreter and x.dtype == torch.bfloat16
    dev = x.device

    states_in = torch.empty(n_chunks, H, P, N, dtype=x.dtype, device=dev)  # S_in, read by the scan's matmul
    dt_scratch = torch.empty(H, n_chunks, Q, dtype=torch.float32, device=dev)
    cs_scratch = torch.empty(H, n_chunks, Q, dtype=torch.float32, device=dev)
    cb_block = min(CB_BLOCK, max(16, next_power_of_2(Q)))
    # the chunk scan reads whole tiles of the CB buffer without masks: pad it to every tile size
    tile = max(cb_block, cfg.block_m, cfg.block_k)
    q_pad = cdiv(Q, tile) * tile
    cb = torch.empty(n_chunks, G, q_pad, q_pad, dtype=x.dtype, device=dev)
    lo, hi = dt_limit
    has_limit = lo > 0.0 or hi != float("inf")
    block_n_state = min(cfg.block_n_state, block_n)

    # decided before the first launch: a bad FASTMAMBA_HOPPER_SCAN raises before any state is written
    hopper = q_pad == Q and cb_block >= 64 and hopper_chunk_output_ok(x, z, out, C, Q)
    # and the states too (one walk per segment, head and 64 state columns), where it covers the call
    hopper_states = hopper and hopper_states_ok(x, B, chunk_out=segments.chunk_out, final_seed=segments.final_seed)
    table = torch.empty(n_chunks, 4, dtype=torch.int32, device=dev)
    block_h = 4 if interpreter else 8
    n_hblocks = cdiv(H, block_h)
    n_tiles = cdiv(Q, cb_block)
    grid = (n_chunks, n_hblocks + G * n_tiles * n_tiles)  # cumsum blocks, then C B^T tiles
    lean(_chunk_prep_kernel)[grid](
        dt, dt_bias, A, segments.cu, table, dt_scratch, cs_scratch, B, C, cb,
        n_seg, row_len, H, N, n_chunks, n_hblocks, float(lo), float(hi), *dt.stride(),
        *B.stride(), *C.stride(), *cb.stride(),
        Q=Q, BLOCK_Q=max(16, next_power_of_2(Q)), BLOCK_H=block_h, BLOCK_SEG=block_seg,
        DT_SOFTPLUS=dt_softplus, HAS_DT_LIMIT=has_limit, A_IS_LOG=bool(A_is_log),
        CB_M=cb_block, CB_N=min(block_n, 128), DOT_PRECISION=dot_precision, DOT_UPCAST=dot_upcast,
        # one stage: the C B^T loop has one or two trips, and Triton's default 3 stages of (C, B) tiles
        # (~100 KB of shared memory) left two programs per SM
        num_warps=4, num_stages=1, **_pdl(x, grid, 4, chained=after_own_kernel),
    )
    if hopper_states:  # sm_90: chunk states and state passing in one walk, the running state in fp32
        chunk_states_sm90(x, B, states_in, dt_scratch, cs_scratch, table, segments.cu, segments.skip, segments.init,
                          segments.init_idx, segments.final, segments.final_idx, segments.seg_final,
                          segments.chunk_out, chunk_size=Q, block_seg=block_seg)
    else:
        states = torch.empty(n_chunks, H, P, N, dtype=state_dtype, device=dev)  # S_loc, recurrence precision
        grid = (n_chunks, H, cdiv(N, block_n_state))
        # 16-bit tiles on a GPU only: the cap was measured there (fp32 tiles are smem-bound at 3 per SM)
        on_gpu16 = x.is_cuda and x.element_size() == 2 and not interpreter
        regs_cap = state_regs_cap(math.prod(grid), sm_count(x)) if on_gpu16 else 0
        lean(_chunk_state_kernel)[grid](
            x, B, table, segments.skip, states, dt_scratch, cs_scratch,
            n_seg, row_len, P, N, H // G, n_chunks,
            *x.stride(), *B.stride(), *states.stride(),
            Q=Q, BLOCK_K=cfg.block_k_state, BLOCK_P=block_p_full, BLOCK_N=block_n_state,
            DOT_PRECISION=dot_precision, FAST_MATH=fast_math, DOT_UPCAST=dot_upcast, FLAG_NONFINITE=hopper,
            num_warps=cfg.warps_state, **_pdl(x, grid, cfg.warps_state, chained=True),
            **({"maxnreg": regs_cap} if regs_cap else {}),
        )
        block_pass = cfg.block_pass * 4 // states.element_size()  # 16-byte loads per thread at either width
        grid = (n_seg, H, cdiv(P * N, block_pass))
        lean(_state_passing_kernel)[grid](
            states, states_in, cs_scratch, segments.cu, segments.skip,
            segments.init, segments.init_idx, segments.final, segments.final_idx, segments.seg_final, segments.chunk_out,
            segments.final_seed,
            n_seg, P, N, n_chunks,
            *states.stride(), *states_in.stride(), *strides4(segments.init), *strides4(segments.final),
            *strides4(segments.seg_final), *strides4(segments.chunk_out),
            Q=Q, BLOCK_PN=block_pass, BLOCK_SEG=block_seg,
            num_warps=4, **_pdl(x, grid, 4, chained=True),
        )
    if hopper:  # sm_90: the warp-specialized TMA kernel; the Triton one below redoes it only on non-finite x
        chunk_output_sm90(x, z, out, cb, C, D, table, segments.skip, states_in, dt_scratch, cs_scratch,
                          norm_weight, norm_sumsq, n_seg=n_seg, chunk_size=Q)
    m_blocks = cdiv(Q, cfg.block_m)
    tiles = m_blocks * cdiv(P, block_p_scan)
    heads = cfg.heads if H % cfg.heads == 0 else 1
    if hopper:  # programs that exit unless flagged, then walk all the tiles (few: exiting costs too)
        grid = (min(tiles * n_chunks * (H // heads), FLAGGED_PROGRAMS_PER_SM * (sm_count(x) if x.is_cuda else 1)),)
    else:
        grid = (tiles, n_chunks, H // heads) if cfg.head_major else (n_chunks, H // heads, tiles)
    lean(_chunk_scan_kernel)[grid](
        x, z, out, cb, C, D, table, segments.skip,
        states_in, dt_scratch, cs_scratch, norm_weight, norm_sumsq,
        n_seg, row_len, P, N, H // G, n_chunks, norm_sumsq.stride(0) if norm_sumsq is not None else 0,
        *x.stride(), *strides4(z), *out.stride(), *cb.stride(), *C.stride(), *d_strides(D), *states_in.stride(),
        H // heads,
        Q=Q, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_P=block_p_scan, BLOCK_N=block_n, HEADS=heads,
        DOT_PRECISION=dot_precision, HEAD_MAJOR=bool(cfg.head_major), FAST_MATH=fast_math, DOT_UPCAST=dot_upcast,
        ONLY_IF_FLAGGED=hopper, num_warps=cfg.warps_scan, num_stages=cfg.stages_scan,
        **_pdl(x, grid, cfg.warps_scan, chained=True),
        **({"maxnreg": cfg.maxnreg_scan} if cfg.maxnreg_scan and not interpreter else {}),
    )
