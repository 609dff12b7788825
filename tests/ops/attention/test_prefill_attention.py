"""The prefill attention kernel (``ops/attention/prefill_kernel.py``) against the plain-PyTorch
reference: GQA groups that are and are not powers of two, contexts continued from the cache, pad
prompts, odd lengths, non-contiguous q, a staged work table with unused items, pages that must
never be read; and the work table's host builder."""
from __future__ import annotations

import itertools

import pytest
import torch

from fastmamba.ops._common.host_values import trusted_inputs
from fastmamba.ops.attention import (
    PrefillWork, paged_kv_write, prefill_block_tokens, prefill_work, varlen_prefill_attention, work_items_bound,
)
from fastmamba.ops.attention.ref import varlen_prefill_attention_ref
from tests.helpers import nan_like, seeded, tol
from tests.ops.attention.test_attention import paged_pool

BAD_PAGE = 1 << 30  # a block-table entry no kernel may dereference


def prefill_case(*, Hq, Hkv, Dh, PAGE, ctx, lens, slots, S, dtype=torch.float32, seed=0):
    """Pools whose rows hold each prompt's context plus its tokens (its K/V written at its
    positions), the block table's unused entries set to BAD_PAGE, and strided q [T, Hq, Dh]."""
    held = [0] * S
    for b, s in enumerate(slots):
        if s >= 0:
            held[s] = ctx[b] + lens[b]
    k_pool, v_pool, bt, _ = paged_pool(S=S, Np=4 * S * (max(held) // PAGE + 2), PAGE=PAGE, Hkv=Hkv, Dh=Dh, lens=held,
                                       dtype=dtype, seed=seed)
    bt = torch.cat([bt, torch.full((S, 2), -1, dtype=bt.dtype)], dim=1)  # a wider table than needed
    bt[bt < 0] = BAD_PAGE
    g = seeded(seed + 1)
    T = sum(lens)
    q = torch.randn(T, Hq + 3, Dh, generator=g).to(dtype)[:, 1:Hq + 1]  # heads not contiguous
    k_new = torch.randn(T, Hkv, Dh, generator=g).to(dtype)
    v_new = torch.randn(T, Hkv, Dh, generator=g).to(dtype)
    positions = torch.tensor([c + i for c, n in zip(ctx, lens) for i in range(n)], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    slots_t = torch.tensor(slots, dtype=torch.int32)
    paged_kv_write(k_new, v_new, k_pool, v_pool, torch.where(bt == BAD_PAGE, -1, bt), slots_t, positions, rows)
    cu = torch.tensor(list(itertools.accumulate(lens, initial=0)), dtype=torch.int32)
    return q, k_pool, v_pool, bt, slots_t, cu


ROWS = [
    pytest.param(dict(Hq=4, Hkv=2, Dh=16, PAGE=4), id="G2-D16-P4"),
    pytest.param(dict(Hq=6, Hkv=2, Dh=16, PAGE=4), id="G3"),
    pytest.param(dict(Hq=3, Hkv=3, Dh=16, PAGE=8), id="MHA-P8"),
    pytest.param(dict(Hq=4, Hkv=1, Dh=24, PAGE=32), id="MQA-D24-P32"),
    pytest.param(dict(Hq=4, Hkv=2, Dh=16, PAGE=4, dtype=torch.float16), id="fp16"),
]


@pytest.mark.parametrize("shape", ROWS)
def test_prefill_attention_kernel_matches_ref(shape, device):
    dtype = shape.pop("dtype", torch.float32)
    # prompt 3 is a pad prompt; prompts 1 and 4 reach past the interpreter's 16-key trips (the
    # kernel's trips before a block's first query skip the causal mask)
    ctx, lens, slots = [0, 21, 0, 3, 0], [7, 3, 1, 9, 18], [2, 0, 4, -1, 1]
    q, k_pool, v_pool, bt, sl, cu = prefill_case(**shape, ctx=ctx, lens=lens, slots=slots, S=5, dtype=dtype)
    want = varlen_prefill_attention_ref(q, k_pool, v_pool, bt.clamp(max=k_pool.shape[0] - 1), sl, cu,
                                        torch.tensor(ctx))
    d = lambda t: t.to(device)  # noqa: E731
    out = nan_like(q).to(device)
    got = varlen_prefill_attention(d(q), d(k_pool), d(v_pool), d(bt), d(sl), d(cu), ctx, out=out)
    assert got is out
    torch.testing.assert_close(got.cpu().float(), want, **tol(dtype))
    assert torch.all(got[cu[3]:cu[4]] == 0)  # the pad prompt: zeros

    # a staged work table with unused items and the context on the device: the same values
    bm = prefill_block_tokens(shape["Hq"], shape["Hkv"], shape["Dh"], dtype, device)
    cap = work_items_bound(sum(lens), len(lens), bm) + 3
    table = torch.tensor(prefill_work(cu.tolist(), bm, capacity=cap), dtype=torch.int32).view(-1, 2)
    with trusted_inputs():
        staged = varlen_prefill_attention(d(q), d(k_pool), d(v_pool), d(bt), d(sl), d(cu),
                                          d(torch.tensor(ctx, dtype=torch.int32)), work=PrefillWork(d(table), bm))
    assert torch.equal(staged, got)


def test_prefill_attention_slot_outside_the_pool_is_a_pad_prompt(device):
    """Inside trusted_inputs() nothing reads the slots on the host: a slot outside [0, S) reads no
    page and gives zeros, and the other prompts are unchanged."""
    ctx, lens, slots = [2, 0], [5, 4], [1, 0]
    q, k_pool, v_pool, bt, sl, cu = prefill_case(Hq=4, Hkv=2, Dh=16, PAGE=4, ctx=ctx, lens=lens, slots=slots, S=2)
    d = lambda t: t.to(device)  # noqa: E731
    good = varlen_prefill_attention(d(q), d(k_pool), d(v_pool), d(bt), d(sl), d(cu), ctx)
    with trusted_inputs():
        bad = varlen_prefill_attention(d(q), d(k_pool), d(v_pool), d(bt), d(torch.tensor([1, 7], dtype=torch.int32)),
                                       d(cu), ctx, cu_seqlens_host=cu.tolist())
    assert torch.equal(bad[:5], good[:5]) and torch.all(bad[5:] == 0)


def test_prefill_work_table():
    assert prefill_work([0, 5, 6, 14], 4) == [0, 0, 0, 4, 1, 0, 2, 0, 2, 4]
    assert prefill_work([0, 3], 4, capacity=3) == [0, 0, -1, 0, -1, 0]
    assert work_items_bound(14, 3, 4) == 7 >= len(prefill_work([0, 5, 6, 14], 4)) // 2
    with pytest.raises(ValueError, match="prefill_work: 5 work items exceed the capacity 4"):
        prefill_work([0, 5, 6, 14], 4, capacity=4)


def test_prefill_attention_rejects_bad_work(device):
    ctx, lens, slots = [0], [3], [0]
    q, k_pool, v_pool, bt, sl, cu = prefill_case(Hq=4, Hkv=2, Dh=16, PAGE=4, ctx=ctx, lens=lens, slots=slots, S=1)
    d = lambda t: t.to(device)  # noqa: E731
    args = (d(q), d(k_pool), d(v_pool), d(bt), d(sl), d(cu), d(torch.tensor(ctx)))
    if device.type == "cpu" and not __import__("fastmamba.ops._common.dispatch", fromlist=["x"]).interpreter_enabled():
        pytest.skip("the work table belongs to the Triton path; a plain CPU run takes SDPA and ignores it")
    bm = prefill_block_tokens(4, 2, 16, torch.float32, device)
    table = d(torch.tensor(prefill_work(cu.tolist(), bm), dtype=torch.int32).view(-1, 2))
    with pytest.raises(ValueError, match=f"built for blocks of {bm * 2} query tokens; this call's kernel takes {bm}"):
        varlen_prefill_attention(*args, work=PrefillWork(table, bm * 2))
    with pytest.raises(TypeError, match="`work` expected a PrefillWork or None, got tuple"):
        varlen_prefill_attention(*args, work=(table, bm))
    with pytest.raises(ValueError, match=r"`work.table` expected shape \(n, 2\), got \(2,\)"):
        varlen_prefill_attention(*args, work=PrefillWork(table.view(-1)[:2], bm))
    with pytest.raises(TypeError, match=r"`work.table` expected dtype in \(int32, int64\), got float32"):
        varlen_prefill_attention(*args, work=PrefillWork(table.float(), bm))
    with pytest.raises(TypeError, match=r"`ctx_lens` expected dtype in \(int32, int64\), got float32"):
        varlen_prefill_attention(*args[:6], d(torch.tensor([0.0])))
    with pytest.raises(ValueError, match=r"`ctx_lens` expected shape \(B=1\), got \(2\)"):
        varlen_prefill_attention(*args[:6], d(torch.tensor([0, 0])))
    with pytest.raises(TypeError, match=r"`cu_seqlens` expected dtype in \(int32, int64\), got float32"):
        varlen_prefill_attention(*args[:5], args[5].float(), [0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_attention_nemotron_shape_gpu(dtype):
    """Nemotron-H's attention shape (32 query heads, 8 KV heads, head dim 128, pages of 16) with
    long prompts and contexts, on the GPU tile."""
    ctx, lens, slots = [0, 700, 30, 0], [1, 300, 1000, 129], [3, 1, 0, 2]
    q, k_pool, v_pool, bt, sl, cu = prefill_case(Hq=32, Hkv=8, Dh=128, PAGE=16, ctx=ctx, lens=lens, slots=slots, S=4,
                                                 dtype=dtype)
    want = varlen_prefill_attention_ref(q.cuda(), k_pool.cuda(), v_pool.cuda(),
                                        bt.clamp(max=k_pool.shape[0] - 1).cuda(), sl.cuda(), cu.cuda(),
                                        torch.tensor(ctx))
    got = varlen_prefill_attention(q.cuda(), k_pool.cuda(), v_pool.cuda(), bt.cuda(), sl.cuda(), cu.cuda(), ctx)
    torch.testing.assert_close(got.float(), want, **tol(dtype))
