"""Public entries of the attention ops over a paged KV cache (GQA, no position embedding).

Layout (vLLM's): a layer's K and V pools are ``[Np, PAGE, Hkv, Dh]``; request ``s`` keeps its
token at position ``pos`` in page ``block_table[s, pos // PAGE]``, row ``pos % PAGE``; ``seq_lens[s]``
counts its cached tokens. The pool's last page (``Np - 1``) is a scratch page that
``fastmamba.cache.kv_pages.KVPages`` never hands out: pad tokens (slot -1) write there, so the
write needs no host sync and nothing lands outside the pool.

Three ops, in the order a layer calls them:
  ``paged_kv_write``            K/V of T new tokens into their pages: one Triton launch (PyTorch
                                index_put on a plain CPU); no host read
  ``varlen_prefill_attention``  packed prompts' causal attention over their pages: a Triton kernel
                                (a work table of query blocks; graph safe when the caller stages it),
                                PyTorch's ``scaled_dot_product_attention`` per prompt on a plain CPU
  ``paged_decode_attention``    one query per request over its pages: a Triton kernel (GQA,
                                block table, per-request lengths; CUDA-graph safe)

float8 K/V pages (``torch.float8_e4m3fn`` pools, half the bytes of bf16): each op then takes the
per-tensor ``k_scale`` and ``v_scale`` of the layer (a checkpoint's, or 1.0). The write stores
K / k_scale and V / v_scale saturated to e4m3's +-448 (round to nearest even); the attention
kernels convert each tile to the queries' dtype (exact) and apply the scales outside the
products: k_scale to the scores, v_scale to the output. Both scales are required with float8
pools and refused with others. float8 tiles need an sm_89+ GPU (Ada, Hopper) or the interpreter.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fastmamba.ops._common.checks import (
    FLOAT_DTYPES, INDEX_DTYPES, check_dtype, check_host_copies, check_index_values, check_indices, check_same_device,
    check_shape,
)
from fastmamba.ops._common.dispatch import use_triton
from fastmamba.ops._common import slot_errors
from fastmamba.ops._common.host_values import host_list, host_reads_allowed
from fastmamba.ops.attention.configs import (
    INTERPRET_CONFIG, DecodeConfig, PrefillTile, pick_prefill_tile, pick_splits, pick_tile, sm_count,
)
from fastmamba.ops.attention.kernel import launch_paged_decode_attention, launch_paged_kv_write
from fastmamba.ops.attention.prefill_kernel import group_pad, launch_paged_prefill_attention, prefill_work
from fastmamba.ops.attention.ref import paged_decode_attention_ref, quantize_kv_ref
from fastmamba.ops.fp8.ref import FP8_DTYPE

KV_DTYPES = FLOAT_DTYPES + (FP8_DTYPE,)


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _kv_scales(op: str, k_pages: torch.Tensor, v_pages: torch.Tensor, k_scale, v_scale):
    """(k_scale, v_scale) as one-element device tensors for float8 pools, None for others; raises
    ValueError when float8 pools lack a scale, other pools get one, or K and V pools disagree on
    float8. Tensor values are not read (no host sync): the loader checks a checkpoint's scales."""
    fp8 = k_pages.dtype == FP8_DTYPE
    if fp8 != (v_pages.dtype == FP8_DTYPE):
        raise ValueError(f"{op}: `k_pages` and `v_pages` must both be float8_e4m3fn or neither, got "
                         f"{k_pages.dtype} and {v_pages.dtype}")
    if fp8 and k_pages.is_cuda and _capability(k_pages.device.index) < (8, 9):
        raise ValueError(f"{op}: float8_e4m3fn K/V pages need an sm_89+ GPU (Ada, Hopper: Triton's e4m3 type); "
                         f"{k_pages.device} is sm_{''.join(map(str, _capability(k_pages.device.index)))}: use "
                         "16-bit pages (kv_cache_dtype 'bf16' / 'fp16')")
    if not fp8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"{op}: `k_scale` / `v_scale` go with float8_e4m3fn pools; the pools are {k_pages.dtype} "
                             "(pass None)")
        return None
    out = []
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"{op}: float8_e4m3fn pools need `k_scale` and `v_scale` (the pages hold K / k_scale "
                             f"and V / v_scale); `{name}` is None")
        if isinstance(s, (int, float)) and not isinstance(s, bool):
            if not 0 < float(s) < math.inf:
                raise ValueError(f"{op}: `{name}` expected a finite number > 0, got {s!r}")
            s = torch.full((), float(s), dtype=torch.float32, device=k_pages.device)
        elif not isinstance(s, torch.Tensor):
            raise TypeError(f"{op}: `{name}` expected a float or a one-element float tensor, got {type(s).__name__}")
        elif s.numel() != 1 or not s.is_floating_point():
            raise ValueError(f"{op}: `{name}` expected one float value (shape () or (1,)), got {s.dtype} of shape "
                             f"{tuple(s.shape)}")
        elif s.device != k_pages.device:
            raise ValueError(f"{op}: `{name}` is on {s.device}, the pools on {k_pages.device}")
        out.append(s)
    return out[0], out[1]


def _check_pool(op: str, q_or_k: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                *, q_heads: bool):
    if k_pages.dim() != 4:
        raise ValueError(f"{op}: `k_pages` expected shape (Np, PAGE, Hkv, Dh), got {tuple(k_pages.shape)}")
    Np, PAGE, Hkv, Dh = k_pages.shape
    check_shape(op, "v_pages", v_pages, [("Np", Np), ("PAGE", PAGE), ("Hkv", Hkv), ("Dh", Dh)])
    check_dtype(op, "k_pages", k_pages, KV_DTYPES)
    check_dtype(op, "v_pages", v_pages, KV_DTYPES)
    H = q_or_k.shape[1]
    if q_or_k.dim() != 3 or q_or_k.shape[2] != Dh or (H % Hkv if q_heads else H != Hkv):
        want = "(*, Hq, Dh) with Hq a multiple of Hkv" if q_heads else "(T, Hkv, Dh)"
        raise ValueError(f"{op}: `{'q' if q_heads else 'k'}` expected shape {want} = (*, {Hkv}k, {Dh}) for pages "
                         f"{tuple(k_pages.shape)}, got {tuple(q_or_k.shape)}")
    if block_table.dim() != 2:
        raise ValueError(f"{op}: `block_table` expected shape (S, Pmax), got {tuple(block_table.shape)}")
    check_dtype(op, "block_table", block_table, INDEX_DTYPES)
    return Np, PAGE, Hkv, Dh


def paged_kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    token_rows: torch.Tensor | None = None,
    *,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> None:
    """Write T tokens' K/V into their requests' pages.

    k, v         [T, Hkv, Dh]   read; cast to the pools' dtype (float8 pools: k / k_scale and
                 v / v_scale saturated to +-448, ``ref.quantize_kv_ref``)
    k_pages, v_pages [Np, PAGE, Hkv, Dh]   mutated in place at the tokens' (page, row)
    block_table  [S, Pmax] int32/int64   read
    slots        [B] int32/int64: request rows of block_table; -1 (or any value outside [0, S))
                 marks a pad request whose tokens go to the scratch page Np - 1
    positions    [T] int32/int64: each token's position in its request
    token_rows   [T] int32/int64 or None (T == B, token t is request t): token t's request
    k_scale, v_scale  float8_e4m3fn pools only (required there): one-element float tensors on the
                 pools' device (or floats > 0), the per-tensor scales of the layer
    No host read (graph safe): one launch of ``kernel._paged_kv_write_kernel`` on a GPU and
    in the interpreter. Reference: fastmamba.ops.attention.ref.paged_kv_write_ref
    """
    op = "paged_kv_write"
    Np, PAGE, Hkv, Dh = _check_pool(op, k, k_pages, v_pages, block_table, q_heads=False)
    scales = _kv_scales(op, k_pages, v_pages, k_scale, v_scale)
    T = k.shape[0]
    check_shape(op, "v", v, [("T", T), ("Hkv", Hkv), ("Dh", Dh)])
    check_dtype(op, "k", k, FLOAT_DTYPES)
    check_dtype(op, "v", v, FLOAT_DTYPES)
    check_dtype(op, "slots", slots, INDEX_DTYPES)
    check_dtype(op, "positions", positions, INDEX_DTYPES)
    check_shape(op, "positions", positions, [("T", T)])
    if token_rows is None:
        check_shape(op, "slots", slots, [("B=T", T)])
    else:
        check_dtype(op, "token_rows", token_rows, INDEX_DTYPES)
        check_shape(op, "token_rows", token_rows, [("T", T)])
    check_same_device(op, [("k", k), ("v", v), ("k_pages", k_pages), ("v_pages", v_pages),
                           ("block_table", block_table), ("slots", slots), ("positions", positions)]
                      + ([("token_rows", token_rows)] if token_rows is not None else []))
    if use_triton(k):
        launch_paged_kv_write(k, v, k_pages, v_pages, block_table, slots, positions, token_rows, scales)
        return
    s = slots.long() if token_rows is None else slots.long()[token_rows.long()]
    S, Pmax = block_table.shape
    pos = positions.long()
    col = pos // PAGE
    ok = (s >= 0) & (s < S) & (pos >= 0) & (col < Pmax)
    page = block_table[s.clamp(0, S - 1), col.clamp(0, Pmax - 1)].long()
    page = torch.where(ok & (page >= 0) & (page < Np - 1), page, Np - 1)
    row = pos.clamp(min=0) % PAGE
    if scales is not None:  # float8: quantised here, written as bytes (index_put has no float8 kernel everywhere)
        k_pages.view(torch.uint8)[page, row] = quantize_kv_ref(k, scales[0]).view(torch.uint8)
        v_pages.view(torch.uint8)[page, row] = quantize_kv_ref(v, scales[1]).view(torch.uint8)
        return
    k_pages[page, row] = k.to(k_pages.dtype)
    v_pages[page, row] = v.to(v_pages.dtype)


class PrefillWork(NamedTuple):
    """The work table of a packed prefill attention call, on the device: ``table`` [n, 2] int32/int64
    rows (prompt b, first token of a block of ``block_m`` query tokens), unused rows (-1, 0);
    ``prefill_work`` builds its values on the host and ``prefill_block_tokens`` gives ``block_m``."""

    table: torch.Tensor
    block_m: int


def _prefill_tile(n_heads: int, n_kv_heads: int, head_dim: int, itemsize: int, on_gpu: bool) -> tuple[PrefillTile, int]:
    """The prefill kernel's tile and its query tokens per work item (rows / the padded group)."""
    g_pad = group_pad(n_heads, n_kv_heads)
    tile = pick_prefill_tile(head_dim, itemsize, g_pad, on_gpu)
    return tile, tile.rows // g_pad


def prefill_block_tokens(n_heads: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                         device: torch.device | str) -> int:
    """Query tokens per work item of ``varlen_prefill_attention``'s kernel for this head layout,
    dtype and device: what a caller building its own ``PrefillWork`` passes to ``prefill_work``."""
    return _prefill_tile(n_heads, n_kv_heads, head_dim, dtype.itemsize, torch.device(device).type == "cuda")[1]


def varlen_prefill_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ctx_lens: torch.Tensor | list[int],
    *,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    cu_seqlens_host: list[int] | None = None,
    slots_host: list[int] | None = None,
    work: PrefillWork | None = None,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Causal attention of B packed prompts over their requests' pages (GQA).

    q            [T, Hq, Dh]   the prompts' queries back to back; read
    k_pages, v_pages [Np, PAGE, Hkv, Dh]   read: must already hold every prompt's K/V (``paged_kv_write``)
    block_table  [S, Pmax] int32/int64; slots [B] int32/int64 (-1: pad prompt, zero output)
    cu_seqlens   [B+1]: prompt b is q[cu_seqlens[b]:cu_seqlens[b+1]]
    ctx_lens     [B] (int tensor on q's device, or a list): tokens request b had cached before this
                 prompt; prompt b's tokens sit at positions ctx_lens[b] .. ctx_lens[b] + L_b - 1 and
                 attend to every earlier position of their request
    k_new, v_new [T, Hkv, Dh] or None: the prompts' own K/V; on the CPU path a prompt with
                 ctx_lens 0 then attends over them directly instead of gathering its pages (same values;
                 not with float8 pools, whose values are the pages' rounded ones: the pages are read)
    k_scale, v_scale  float8_e4m3fn pools only (required there): the scales the pages were written
                 with (``paged_kv_write``); one-element float tensors on the pools' device or floats
    cu_seqlens_host, slots_host  the values of ``cu_seqlens`` and ``slots`` as the host holds them
                 (the model does), or None: read from the tensors (a device-to-host read each)
    work         a ``PrefillWork`` (the work table on the device) or None: built here from the
                 host's cu_seqlens. With it and a ctx_lens tensor, the call reads nothing on the
                 host (CUDA-graph safe: the runtime's graphed prefill stages both)
    Returns [T, Hq, Dh] in q's dtype (``out`` when given).

    On a GPU (and under the Triton interpreter): one Triton kernel for every prompt
    (``prefill_kernel.py``: fp32 online softmax; GQA rows share their KV head's loads). A slot
    outside [0, S) is a pad prompt there (zero output); no page outside the pool is read. Plain
    CPU: ``torch.nn.functional.scaled_dot_product_attention`` once per prompt.
    Reference: fastmamba.ops.attention.ref.varlen_prefill_attention_ref
    """
    op = "varlen_prefill_attention"
    Np, PAGE, Hkv, Dh = _check_pool(op, q, k_pages, v_pages, block_table, q_heads=True)
    scales = _kv_scales(op, k_pages, v_pages, k_scale, v_scale)
    T, Hq, _ = q.shape
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"{op}: `cu_seqlens` expected shape (B+1,) with B >= 1, got {tuple(cu_seqlens.shape)}")
    B = cu_seqlens.shape[0] - 1
    check_dtype(op, "cu_seqlens", cu_seqlens, INDEX_DTYPES)
    check_indices(op, "slots", slots, B, block_table.shape[0], -1)
    check_host_copies(op, (("cu_seqlens_host", cu_seqlens_host, cu_seqlens), ("slots_host", slots_host, slots)))
    if slots_host is not None:  # the host copy indexes the block table below: its values too
        check_index_values(op, "slots_host", slots_host, block_table.shape[0], -1)
    triton_path = use_triton(q)
    if isinstance(ctx_lens, torch.Tensor):
        check_dtype(op, "ctx_lens", ctx_lens, INDEX_DTYPES)
        check_shape(op, "ctx_lens", ctx_lens, [("B", B)])
        check_same_device(op, [("q", q), ("ctx_lens", ctx_lens)])
    elif len(ctx_lens) != B:
        raise ValueError(f"{op}: `ctx_lens` expected {B} values (one per prompt), got {len(ctx_lens)}")
    cu = None
    if cu_seqlens_host is not None:
        cu = list(cu_seqlens_host)
    elif not (triton_path and work is not None) or host_reads_allowed(cu_seqlens):
        cu = host_list(cu_seqlens)
    if cu is not None and (cu[0] != 0 or cu[-1] != T or any(cu[b + 1] < cu[b] for b in range(B))):
        raise ValueError(f"{op}: `cu_seqlens` must start at 0, end at T={T} and not decrease; got {cu[:8]}...")
    if (k_new is None) != (v_new is None):
        raise ValueError(f"{op}: pass both `k_new` and `v_new` or neither")
    if k_new is not None:
        check_shape(op, "k_new", k_new, [("T", T), ("Hkv", Hkv), ("Dh", Dh)])
        check_shape(op, "v_new", v_new, [("T", T), ("Hkv", Hkv), ("Dh", Dh)])
    scale = scale if scale is not None else 1.0 / math.sqrt(Dh)
    if out is None:
        out = torch.empty_like(q)
    check_shape(op, "out", out, [("T", T), ("Hq", Hq), ("Dh", Dh)])
    if triton_path:
        tile, block_m = _prefill_tile(Hq, Hkv, Dh, q.element_size(), q.is_cuda)
        if work is not None:
            if not isinstance(work, PrefillWork):
                raise TypeError(f"{op}: `work` expected a PrefillWork or None, got {type(work).__name__}")
            if work.block_m != block_m:
                raise ValueError(f"{op}: `work` was built for blocks of {work.block_m} query tokens; this call's "
                                 f"kernel takes {block_m} (prefill_block_tokens)")
            table = work.table
            if table.dim() != 2 or table.shape[1] != 2:
                raise ValueError(f"{op}: `work.table` expected shape (n, 2), got {tuple(table.shape)}")
            check_dtype(op, "work.table", table, INDEX_DTYPES)
            check_same_device(op, [("q", q), ("work.table", table)])
        if work is None or not isinstance(ctx_lens, torch.Tensor):
            # one host-to-device copy: the work table (from the host's cu_seqlens) and ctx_lens
            ctx_vals = [] if isinstance(ctx_lens, torch.Tensor) else [int(c) for c in ctx_lens]
            table_vals = [] if work is not None else prefill_work(cu, block_m)
            packed = torch.tensor(ctx_vals + table_vals, dtype=torch.int64).to(q.device)
            if ctx_vals:
                ctx_lens = packed[:B]
            table = work.table if work is not None else packed[len(ctx_vals):].view(-1, 2)
        if T and table.shape[0]:
            launch_paged_prefill_attention(q, k_pages, v_pages, block_table, slots, cu_seqlens, ctx_lens, table,
                                           out, scale, block_m, tile, *(scales or (None, None)))
        return out
    ctx = host_list(ctx_lens) if isinstance(ctx_lens, torch.Tensor) else list(ctx_lens)
    sl = list(slots_host) if slots_host is not None else host_list(slots)
    for b in range(B):
        lo, hi = cu[b], cu[b + 1]
        if hi == lo:
            continue
        if not 0 <= sl[b] < block_table.shape[0]:  # a pad prompt (-1), or a slot no check read
            out[lo:hi] = 0
            continue
        qb = q[lo:hi].transpose(0, 1)[None]  # [1, Hq, L, Dh]
        if ctx[b] == 0 and k_new is not None and scales is None:
            kb, vb, mask, causal = k_new[lo:hi], v_new[lo:hi], None, True
        else:
            n = ctx[b] + hi - lo
            ids = block_table[sl[b], : (n + PAGE - 1) // PAGE].long()
            kb = k_pages[ids].reshape(-1, Hkv, Dh)[:n]
            vb = v_pages[ids].reshape(-1, Hkv, Dh)[:n]
            qpos = torch.arange(hi - lo, device=q.device)[:, None] + ctx[b]
            mask, causal = torch.arange(n, device=q.device)[None, :] <= qpos, False
            if scales is not None:  # float8 pages: stored value x scale
                kb, vb = kb.float() * scales[0].float().reshape(()), vb.float() * scales[1].float().reshape(())
        kb = kb.to(q.dtype).transpose(0, 1)[None]
        vb = vb.to(q.dtype).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=causal, scale=scale,
                                           enable_gqa=Hq != Hkv)
        out[lo:hi] = o[0].transpose(0, 1)
    return out


# Tests of the device check without a GPU: CPU slots (under the interpreter) checked on the device
# too; a real CPU run reads them on the host (no synchronize there).
DEVICE_CHECK_CPU = False
slot_errors.NAMES["paged_decode_attention"] = ("slots",)


def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    *,
    scale: float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """One query token per request attending over its cached tokens (GQA, paged, no mask needed).

    q            [B, Hq, Dh]   fp32, bf16 or fp16; read (query head h uses KV head h // (Hq/Hkv))
    k_pages, v_pages [Np, PAGE, Hkv, Dh]   read; PAGE a power of two; q and the pools may differ
                 in dtype (then every product runs in fp32); float8_e4m3fn pools are read as their
                 values times k_scale / v_scale (the products then run in q's dtype)
    block_table  [S, Pmax] int32/int64: request s's pages; only the first ceil(seq_lens[s]/PAGE)
                 entries are read (a page id outside [0, Np) is read as masked, never dereferenced)
    seq_lens     [S] int32/int64: tokens cached for request s, the current one included
    slots        [B] int32/int64: request b's row; -1 (any value outside [0, S)) marks a pad row:
                 zero output, nothing read
    num_splits   split-K: each request's context is cut into this many runs of about equal length
                 (from its own seq_lens, on the device), attended by separate programs and merged
                 by a second kernel (a power of two, 1 to 64). None: the launch config's choice
                 (``fastmamba.ops.attention.configs.pick_config``): enough runs for a few programs
                 per SM when B x Hkv is small, 1 under the interpreter
    k_scale, v_scale  float8_e4m3fn pools only (required there): one-element float tensors on the
                 pools' device (graph safe) or floats
    Returns [B, Hq, Dh] in q's dtype (``out`` when given). fp32 softmax and accumulation.
    Reads nothing on the host (graph safe: block_table, seq_lens and slots can be static buffers).
    The slots' range is checked on the host for CPU tensors; an eager call on GPU tensors checks
    them on the device (one small launch, no synchronize): a bad row is skipped (zero output) and
    the op's next call raises the ValueError. Not checked under capture, compile or trusted_inputs().
    Reference: fastmamba.ops.attention.ref.paged_decode_attention_ref
    """
    op = "paged_decode_attention"
    Np, PAGE, Hkv, Dh = _check_pool(op, q, k_pages, v_pages, block_table, q_heads=True)
    scales = _kv_scales(op, k_pages, v_pages, k_scale, v_scale)
    B, Hq, _ = q.shape
    check_dtype(op, "q", q, FLOAT_DTYPES)
    S = block_table.shape[0]
    check_dtype(op, "seq_lens", seq_lens, INDEX_DTYPES)
    check_shape(op, "seq_lens", seq_lens, [("S", S)])
    check_same_device(op, [("q", q), ("k_pages", k_pages), ("v_pages", v_pages), ("block_table", block_table),
                           ("seq_lens", seq_lens), ("slots", slots)])
    on_device = slot_errors.checked_on_device(slots, DEVICE_CHECK_CPU) and use_triton(q)
    slot_errors.raise_pending(op, slots.device, slot_errors.NAMES[op])
    check_indices(op, "slots", slots, B, S, -1, read=not on_device)
    if PAGE & (PAGE - 1):
        raise ValueError(f"{op}: the page size (k_pages.shape[1]) must be a power of two, got {PAGE}")
    scale = scale if scale is not None else 1.0 / math.sqrt(Dh)
    if out is None:
        out = torch.empty_like(q)
    check_shape(op, "out", out, [("B", B), ("Hq", Hq), ("Dh", Dh)])
    if num_splits is not None and not (isinstance(num_splits, int) and 1 <= num_splits <= 64
                                       and num_splits & (num_splits - 1) == 0):
        raise ValueError(f"{op}: `num_splits` expected a power of two in [1, 64], got {num_splits!r}")
    if not use_triton(q):
        ks, vs = scales or (None, None)
        out.copy_(paged_decode_attention_ref(q, k_pages, v_pages, block_table, seq_lens, slots, scale=scale,
                                             k_scale=ks, v_scale=vs))
        return out
    if B:
        if on_device:  # the kernel treats a slot outside [0, S) as a pad row; this records it
            slot_errors.check_slots_on_device(op, slots, S, -1, which=1)
        config = _launch_config(q, B * Hkv, block_table.shape[1] * PAGE, Dh, k_pages.element_size())
        if num_splits is not None:
            config = config._replace(num_splits=num_splits)
        launch_paged_decode_attention(q, k_pages, v_pages, block_table, seq_lens, slots, out, scale, config,
                                      *(scales or (None, None)))
    return out


def _launch_config(q: torch.Tensor, programs: int, max_tokens: int, head_dim: int, itemsize: int) -> DecodeConfig:
    """The tile, warps and stages of ``configs.pick_tile`` (the smallest tile in the interpreter)
    with ``_auto_splits`` runs (``configs.pick_config``'s choice on a GPU, worked out once)."""
    splits = _auto_splits(q, programs, max_tokens)
    if not q.is_cuda:
        return INTERPRET_CONFIG._replace(num_splits=splits)
    return DecodeConfig(*pick_tile(head_dim, itemsize), splits)


def _auto_splits(q: torch.Tensor, programs: int, max_tokens: int) -> int:
    """Split-K runs for ``programs`` = rows x KV heads over a block table of ``max_tokens`` tokens:
    ``configs.pick_splits`` on a GPU, 1 in the interpreter (tests force splits through this hook)."""
    return pick_splits(programs, max_tokens, sm_count(q.device)) if q.is_cuda else 1
