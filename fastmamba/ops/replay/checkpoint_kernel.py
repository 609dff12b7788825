"""The split path's checkpoint kernels (see ``kernel.py``'s docstring, 2b): a persistent grid over
the requests that store their state this step (the precompute kernel's list) replays the history,
stores the state and records this step's x; with pointer loads, or fed by TMA on sm_90+ for bf16
activations and a history of up to 64 positions. Their launchers and the TMA rule.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from fastmamba.ops._common.launch import lean
from fastmamba.ops.replay.kernel_common import (
    HISTORY_CHUNK,
    _dot_precision,
    _dot_split,
    _history_weights,
    _interpreting,
    _replay_history,
    _store_state,
    _tma_views_ok,
    _view_desc,
    dot_dim,
)


@triton.jit
def _checkpoint_record(ckpt_list_ptr, tile, n_tiles, per_request, p_blocks: tl.constexpr):
    """Tile ``tile`` of the checkpoint kernel's list: (request, slot, k, rbuf, head, block of P);
    zeros past the list (``tile >= n_tiles``)."""
    live = tile < n_tiles
    rec = ckpt_list_ptr + 4 * (tile // per_request)
    b = tl.load(rec, mask=live, other=0).to(tl.int64)
    slot = tl.load(rec + 1, mask=live, other=0).to(tl.int64)
    k = tl.load(rec + 2, mask=live, other=0)
    rbuf = tl.load(rec + 3, mask=live, other=0).to(tl.int64)
    h = ((tile % per_request) // p_blocks).to(tl.int64)
    return b, slot, k, rbuf, h, tile % p_blocks


@triton.jit
def _replay_checkpoint_kernel(
    state_ptr, old_x_ptr, old_B_ptr, old_dt_ptr, old_cumA_ptr,
    x_ptr, seed_ptr, ckpt_count_ptr, ckpt_list_ptr,
    T, heads_per_group, nheads,
    stride_state_s, stride_state_h, stride_state_p, stride_state_n,
    stride_ox_s, stride_ox_t, stride_ox_h, stride_ox_p,
    stride_oB_r, stride_oB_s, stride_oB_t, stride_oB_g, stride_oB_n,
    stride_odt_r, stride_odt_s, stride_odt_t, stride_odt_h,
    stride_ocs_r, stride_ocs_s, stride_ocs_t, stride_ocs_h,
    stride_x_b, stride_x_t, stride_x_h, stride_x_p,
    STOCHASTIC_ROUND: tl.constexpr,
    P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr, USE_PDL: tl.constexpr,
):
    # The split path's checkpoint kernel, after the output kernel: a persistent grid walks the
    # (request, head, block of P) tiles of the requests that store their state this step, listed by
    # the precompute kernel (in any order, one record [request, slot, k, rbuf] each): replay the
    # history onto the stored state, store it, and record this step's x at positions 0.. of the
    # new history. Software-pipelined: each iteration issues the next tile's state load before it
    # replays its own.
    # Under PDL (launched as the output kernel's dependent) everything before the stores overlaps
    # the output kernel's last programs: it reads only what that kernel leaves alone (the stored
    # states, history positions < k of checkpointing slots, the precompute kernel's list).
    p_blocks: tl.constexpr = (P + BLOCK_P - 1) // BLOCK_P
    per_request = nheads * p_blocks
    n_tiles = tl.load(ckpt_count_ptr) * per_request
    offs_n = tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_T)
    mn = offs_n < N
    mt = offs_t < T
    nprog = tl.num_programs(0)
    b, slot, k, rbuf, h, pb = _checkpoint_record(ckpt_list_ptr, tl.program_id(0), n_tiles, per_request, p_blocks)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    s_next = tl.load(state_ptr + slot * stride_state_s + h * stride_state_h + offs_p[:, None] * stride_state_p
                     + offs_n[None, :] * stride_state_n,
                     mask=(offs_p[:, None] < P) & mn[None, :] & (tl.program_id(0) < n_tiles), other=0.0)
    for tile in range(tl.program_id(0), n_tiles, nprog):
        s_raw = s_next
        offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        mp = offs_p < P
        tile_mask = mp[:, None] & mn[None, :]
        # the next tile's record and state, in flight while this one replays
        nb, nslot, nk, nrbuf, nh, npb = _checkpoint_record(ckpt_list_ptr, tile + nprog, n_tiles, per_request, p_blocks)
        noffs_p = npb * BLOCK_P + tl.arange(0, BLOCK_P)
        s_next = tl.load(state_ptr + nslot * stride_state_s + nh * stride_state_h + noffs_p[:, None] * stride_state_p
                         + offs_n[None, :] * stride_state_n,
                         mask=(noffs_p[:, None] < P) & mn[None, :] & (tile + nprog < n_tiles), other=0.0)
        mask_pt = mp[:, None] & mt[None, :]
        x_T = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + offs_p[:, None] * stride_x_p + offs_t[None, :] * stride_x_t,
                      mask=mask_pt, other=0.0)

        cum_row = old_cumA_ptr + rbuf * stride_ocs_r + slot * stride_ocs_s + h * stride_ocs_h
        x_row = old_x_ptr + slot * stride_ox_s + h * stride_ox_h
        cum_last = tl.load(cum_row + (k - 1) * stride_ocs_t, mask=k > 0, other=0.0)
        s = s_raw.to(tl.float32) * tl.exp(cum_last)
        s = _replay_history(s, k, cum_last, cum_row,
                            old_dt_ptr + rbuf * stride_odt_r + slot * stride_odt_s + h * stride_odt_h, x_row,
                            old_B_ptr + rbuf * stride_oB_r + slot * stride_oB_s + (h // heads_per_group) * stride_oB_g,
                            offs_p, mp, offs_n, mn, stride_ocs_t, stride_odt_t, stride_ox_t, stride_ox_p,
                            stride_oB_t, stride_oB_n, BLOCK_H, SPLIT, DOT_PRECISION)
        if USE_PDL:
            gdc_wait()  # the output kernel has read every state and history it needs
        state_ptrs = (state_ptr + slot * stride_state_s + h * stride_state_h + offs_p[:, None] * stride_state_p
                      + offs_n[None, :] * stride_state_n)
        _store_state(s, state_ptrs, tile_mask, slot, h, nheads, offs_p, offs_n, seed_ptr, P, N, STOCHASTIC_ROUND)
        # every thread has read its old x (the replay, possibly in another thread layout) before
        # any thread overwrites positions 0..T-1
        tl.debug_barrier()
        tl.store(x_row + offs_p[:, None] * stride_ox_p + offs_t[None, :] * stride_ox_t,
                 x_T.to(old_x_ptr.dtype.element_ty), mask=mask_pt)
        b, slot, k, rbuf, h, pb = nb, nslot, nk, nrbuf, nh, npb


@triton.jit
def _replay_checkpoint_tma_kernel(
    state_desc, old_x_desc, old_B_desc, x_desc,
    state_ptr, old_x_ptr, old_dt_ptr, old_cumA_ptr, seed_ptr, ckpt_count_ptr, ckpt_list_ptr,
    T, heads_per_group, nheads, capacity, n_slots,
    stride_state_s, stride_state_h, stride_state_p: tl.constexpr, stride_state_n: tl.constexpr,
    stride_ox_s, stride_ox_t: tl.constexpr, stride_ox_h, stride_ox_p: tl.constexpr,
    stride_odt_r, stride_odt_s, stride_odt_t: tl.constexpr, stride_odt_h: tl.constexpr,
    stride_ocs_r, stride_ocs_s, stride_ocs_t: tl.constexpr, stride_ocs_h: tl.constexpr,
    STOCHASTIC_ROUND: tl.constexpr,
    P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr, USE_PDL: tl.constexpr, STAGES: tl.constexpr,
):
    # _replay_checkpoint_kernel as a persistent loop whose tiles arrive by TMA (tensor descriptors
    # over 2-d views of contiguous tensors: the state [S*H*P, N], the history x [S*C_h, H*P], the
    # history B [2*S*C_h, G*N], x [B*T, H*P]), so that the pipeliner prefetches the next tile's
    # state and whole history into shared memory while this one replays. The history is one
    # tl.dot over all C_h positions, rows c >= k zeroed on both operands (whatever they hold).
    p_blocks: tl.constexpr = P // BLOCK_P
    per_request = nheads * p_blocks
    n_tiles = tl.load(ckpt_count_ptr) * per_request
    offs_c = tl.arange(0, BLOCK_C)
    offs_n = tl.arange(0, N)
    offs_t = tl.arange(0, BLOCK_T)
    mt = offs_t < T
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        b, slot, k, rbuf, h, pb = _checkpoint_record(ckpt_list_ptr, tile, n_tiles, per_request, p_blocks)
        g = h // heads_per_group
        p0 = pb * BLOCK_P
        offs_p = p0 + tl.arange(0, BLOCK_P)
        col = (h * P + p0).to(tl.int32)
        s_raw = state_desc.load([((slot * nheads + h) * P + p0).to(tl.int32), 0])
        x_old = tl.trans(old_x_desc.load([(slot * capacity).to(tl.int32), col]))  # [BLOCK_P, BLOCK_C]
        B_old = old_B_desc.load([((rbuf * n_slots + slot) * capacity).to(tl.int32), (g * N).to(tl.int32)])
        x_T = tl.trans(x_desc.load([(b * T).to(tl.int32), col]))  # [BLOCK_P, BLOCK_T]
        mc = offs_c < k
        cum_row = old_cumA_ptr + rbuf * stride_ocs_r + slot * stride_ocs_s + h * stride_ocs_h
        cum_last = tl.load(cum_row + (k - 1) * stride_ocs_t, mask=k > 0, other=0.0)
        w = _history_weights(cum_row, old_dt_ptr + rbuf * stride_odt_r + slot * stride_odt_s + h * stride_odt_h,
                             offs_c, mc, cum_last, stride_ocs_t, stride_odt_t)
        a = tl.where(mc[None, :], x_old.to(tl.float32) * w[None, :], 0.0)
        s = s_raw.to(tl.float32) * tl.exp(cum_last)
        s = _dot_split(a, tl.where(mc[:, None], B_old, tl.zeros_like(B_old)), s, SPLIT, DOT_PRECISION)
        if USE_PDL:
            gdc_wait()  # the output kernel has read every state and history it needs
        state_ptrs = (state_ptr + slot * stride_state_s + h * stride_state_h + offs_p[:, None] * stride_state_p
                      + offs_n[None, :] * stride_state_n)
        _store_state(s, state_ptrs, (offs_p < P)[:, None] & (offs_n < N)[None, :], slot, h, nheads, offs_p, offs_n,
                     seed_ptr, P, N, STOCHASTIC_ROUND)
        # this tile's history arrived by TMA and was consumed above; positions 0..T-1 of it now
        # take this step's x (a new history)
        tl.store(old_x_ptr + slot * stride_ox_s + h * stride_ox_h + offs_p[:, None] * stride_ox_p
                 + offs_t[None, :] * stride_ox_t, x_T.to(old_x_ptr.dtype.element_ty),
                 mask=(offs_p < P)[:, None] & mt[None, :])


def launch_replay_checkpoint(
    state, old_x, old_B, old_dt, old_cumA, x, seed, ckpt_count, ckpt_list, *, block_p: int, num_warps: int, programs: int,
    use_pdl: bool = False,
):
    """The split path's checkpoint kernel on a persistent grid of ``programs`` programs: the
    requests listed in ckpt_list[:ckpt_count] ((B, 4) int32 records [request, slot, k, rbuf], from
    the precompute kernel). Shapes as ``launch_replay_main``."""
    nreq, ntok, nheads, headdim = x.shape
    ngroups, dstate = old_B.shape[3], old_B.shape[4]
    lean(_replay_checkpoint_kernel)[(programs,)](
        state, old_x, old_B, old_dt, old_cumA, x, seed, ckpt_count, ckpt_list,
        ntok, nheads // ngroups, nheads,
        *state.stride(), *old_x.stride(), *old_B.stride(), *old_dt.stride(), *old_cumA.stride(), *x.stride(),
        STOCHASTIC_ROUND=seed is not None,
        P=headdim, N=dstate, BLOCK_P=block_p, BLOCK_N=dot_dim(dstate),
        BLOCK_T=dot_dim(ntok), BLOCK_H=HISTORY_CHUNK,
        DOT_PRECISION=_dot_precision(x.dtype, "tf32x3"), SPLIT=x.dtype == torch.bfloat16 and not _interpreting(),
        USE_PDL=use_pdl, num_warps=num_warps, launch_pdl=use_pdl,
    )


def checkpoint_tma_usable(state, old_x, old_B, x, block_p: int) -> bool:
    """Whether ``launch_replay_checkpoint_tma`` can take this call: bf16 activations, a history of
    at most 64 positions (the whole history is one tile in shared memory and registers; the default
    history is 64 at T=16), and ``_tma_views_ok``."""
    if x.dtype != torch.bfloat16 or old_x.dtype != x.dtype or old_B.dtype != x.dtype:
        return False
    N = old_B.shape[4]
    rows = max(state.numel() // N, old_x.shape[0] * old_x.shape[1], old_B.numel() // (old_B.shape[3] * N))
    return old_x.shape[1] <= 64 and _tma_views_ok((state, old_x, old_B, x), x, N, block_p, rows)


def launch_replay_checkpoint_tma(
    state, old_x, old_B, old_dt, old_cumA, x, seed, ckpt_count, ckpt_list, *, block_p: int, num_warps: int,
    programs: int, stages: int, maxnreg: int | None = None, use_pdl: bool = False,
):
    """``launch_replay_checkpoint`` as ``_replay_checkpoint_tma_kernel`` (``checkpoint_tma_usable``
    must hold): ``programs`` persistent programs, ``stages`` pipeline stages."""
    nreq, ntok, nheads, headdim = x.shape
    ngroups, dstate = old_B.shape[3], old_B.shape[4]
    capacity = old_x.shape[1]
    block_t = dot_dim(ntok)
    block_c = dot_dim(capacity)
    lean(_replay_checkpoint_tma_kernel)[(max(1, programs),)](
        _view_desc(state, dstate, [block_p, dstate]),
        _view_desc(old_x, nheads * headdim, [block_c, block_p]),
        _view_desc(old_B, ngroups * dstate, [block_c, dstate]),
        _view_desc(x, nheads * headdim, [block_t, block_p]),
        state, old_x, old_dt, old_cumA, seed, ckpt_count, ckpt_list,
        ntok, nheads // ngroups, nheads, capacity, old_x.shape[0],
        *state.stride(), *old_x.stride(), *old_dt.stride(), *old_cumA.stride(),
        STOCHASTIC_ROUND=seed is not None,
        P=headdim, N=dstate, BLOCK_P=block_p, BLOCK_T=block_t, BLOCK_C=block_c,
        DOT_PRECISION="tf32x3", SPLIT=True, USE_PDL=use_pdl, STAGES=stages,
        num_warps=num_warps, launch_pdl=use_pdl, **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )
