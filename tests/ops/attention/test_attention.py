"""Attention ops over a paged KV cache against their plain-PyTorch references: the Triton decode
kernel (GQA, block table, per-request lengths, pad rows), the K/V page write and the varlen
prefill attention."""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops.attention import paged_decode_attention, paged_kv_write, varlen_prefill_attention
from fastmamba.ops.attention.ref import (
    paged_decode_attention_ref, paged_kv_write_ref, varlen_prefill_attention_ref,
)
from tests.helpers import nan_like, seeded, tol


def paged_pool(*, S, Np, PAGE, Hkv, Dh, lens, dtype=torch.float32, seed=0):
    """Random pools (every page, used or not, holds random values) and a block table that hands
    each request a shuffled set of pages; pages never handed out stay random."""
    g = seeded(seed)
    k = torch.randn(Np, PAGE, Hkv, Dh, generator=g).to(dtype)
    v = torch.randn(Np, PAGE, Hkv, Dh, generator=g).to(dtype)
    Pmax = max(1, max((n + PAGE - 1) // PAGE for n in lens))
    perm = torch.randperm(Np - 1, generator=g).tolist()  # the last page is the scratch page
    bt = torch.full((S, Pmax), -1, dtype=torch.int32)
    for s, n in enumerate(lens):
        for p in range((n + PAGE - 1) // PAGE):
            bt[s, p] = perm.pop()
    seq_lens = torch.tensor(list(lens) + [0] * (S - len(lens)), dtype=torch.int32)
    return k, v, bt, seq_lens


# base row, then rows that each change one thing
DECODE_ROWS = [
    pytest.param(dict(Hq=4, Hkv=2, Dh=16, PAGE=4), id="Hq4-Hkv2-D16-P4"),
    pytest.param(dict(Hq=6, Hkv=2, Dh=16, PAGE=4), id="G3"),
    pytest.param(dict(Hq=4, Hkv=4, Dh=16, PAGE=4), id="MHA"),
    pytest.param(dict(Hq=4, Hkv=1, Dh=24, PAGE=8), id="MQA-D24-P8"),
    pytest.param(dict(Hq=4, Hkv=2, Dh=16, PAGE=4, dtype=torch.float16), id="fp16"),
    pytest.param(dict(Hq=4, Hkv=2, Dh=16, PAGE=4, num_splits=2), id="split2"),
    pytest.param(dict(Hq=6, Hkv=2, Dh=24, PAGE=4, num_splits=4), id="G3-D24-split4"),  # splits with no pages
]


@pytest.mark.parametrize("shape", DECODE_ROWS)
def test_paged_decode_attention_matches_ref(shape, device):
    shape = dict(shape)
    dtype = shape.pop("dtype", torch.float32)
    num_splits = shape.pop("num_splits", 1)
    Hq, Hkv, Dh, PAGE = shape["Hq"], shape["Hkv"], shape["Dh"], shape["PAGE"]
    lens = (13, 1, 0, 7, 4)  # request 2 has nothing cached; 4 fills its page exactly
    k, v, bt, seq_lens = paged_pool(S=6, Np=16, PAGE=PAGE, Hkv=Hkv, Dh=Dh, lens=lens, dtype=dtype)
    slots = torch.tensor([3, 0, -1, 4, 1, 2], dtype=torch.int32)  # shuffled, a pad row, slot 5 unused
    q = torch.randn(6, Hq, Dh, generator=seeded(1)).to(dtype)
    k, v, bt, seq_lens, slots, q = (t.to(device) for t in (k, v, bt, seq_lens, slots, q))
    out = nan_like(q)
    got = paged_decode_attention(q, k, v, bt, seq_lens, slots, num_splits=num_splits, out=out)
    assert got is out
    want = paged_decode_attention_ref(q, k, v, bt, seq_lens, slots)
    torch.testing.assert_close(got.float(), want, **tol(dtype))
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # pad row
    assert torch.equal(got[5], torch.zeros_like(got[5]))  # nothing cached


def test_paged_decode_attention_is_independent_of_pages_and_batch(device):
    """Exact: the same request on other pages, in another slot, next to other requests."""
    Hq, Hkv, Dh, PAGE = 4, 2, 16, 4
    k, v, bt, seq_lens = paged_pool(S=3, Np=12, PAGE=PAGE, Hkv=Hkv, Dh=Dh, lens=(9, 5, 3))
    q = torch.randn(3, Hq, Dh, generator=seeded(2))
    alone_k, alone_v = torch.zeros_like(k), torch.zeros_like(v)
    pages = bt[0, :3].long()
    new_pages = torch.tensor([7, 2, 10])  # request 0 copied to other pages of a fresh pool, slot 1
    alone_k[new_pages], alone_v[new_pages] = k[pages], v[pages]
    bt2 = torch.full_like(bt, -1)
    bt2[1, :3] = new_pages.int()
    lens2 = torch.tensor([0, 9, 0], dtype=torch.int32)
    dev = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    batch = paged_decode_attention(*dev(q, k, v, bt, seq_lens, torch.tensor([0, 1, 2], dtype=torch.int32)))
    alone = paged_decode_attention(*dev(q[:1], alone_k, alone_v, bt2, lens2, torch.tensor([1], dtype=torch.int32)))
    assert torch.equal(batch[0], alone[0])


def test_paged_kv_write_matches_ref_and_pads_write_scratch_only(device):
    Hkv, Dh, PAGE = 2, 8, 4
    k_pool, v_pool, bt, _ = paged_pool(S=4, Np=10, PAGE=PAGE, Hkv=Hkv, Dh=Dh, lens=(6, 3, 0, 8))
    g = seeded(3)
    # tokens of requests in rows 0..2 (slots 3, -1, 0): positions 5..7 of slot 3, two pad tokens, 0..2 of slot 0
    slots = torch.tensor([3, -1, 0], dtype=torch.int32)
    token_rows = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2], dtype=torch.int32)
    positions = torch.tensor([5, 6, 7, 0, 1, 0, 1, 2], dtype=torch.int32)
    k = torch.randn(8, Hkv, Dh, generator=g)
    v = torch.randn(8, Hkv, Dh, generator=g)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    paged_kv_write_ref(k, v, want_k, want_v, bt, slots, positions, token_rows)
    got_k, got_v = k_pool.clone().to(device), v_pool.clone().to(device)
    paged_kv_write(*(t.to(device) for t in (k, v)), got_k, got_v, bt.to(device), slots.to(device),
                   positions.to(device), token_rows.to(device))
    assert torch.equal(got_k[:-1].cpu(), want_k[:-1]) and torch.equal(got_v[:-1].cpu(), want_v[:-1])
    assert not torch.equal(got_k[-1].cpu(), k_pool[-1])  # the pads landed on the scratch page


@pytest.mark.parametrize("k_dtype,pool_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                 (torch.float32, torch.float16)], ids=["fp32", "bf16-into-fp32",
                                                                                       "fp32-into-fp16"])
def test_paged_kv_write_strided_odd_heads_and_bad_pages(k_dtype, pool_dtype, device, monkeypatch):
    """K and V as strided column slices of one fused projection row (what a fused QKV GEMM gives),
    odd Hkv and Dh, one token per request (no token_rows): the reference's values cast to the pool's
    dtype; a token whose block-table entry is -1 or past the pool, or whose position lies beyond the
    block table, lands on the scratch page only; one kernel launch on the kernels' path."""
    from fastmamba.ops._common.dispatch import use_triton
    from fastmamba.ops.attention import kernel as attention_kernel

    Hkv, Dh, PAGE, Np = 3, 24, 4, 12
    k_pool, v_pool, bt, _ = paged_pool(S=6, Np=Np, PAGE=PAGE, Hkv=Hkv, Dh=Dh, lens=(5, 9, 2, 4, 1, 3),
                                       dtype=pool_dtype, seed=5)
    bt[3, 0] = -1       # request 3's page at position 2: never handed out
    bt[4, 0] = Np - 1   # request 4's: the scratch page itself (not a page a request may hold)
    fused = torch.randn(6, 7 + 2 * Hkv * Dh, generator=seeded(6)).to(k_dtype)  # [q | k | v] per token
    k = fused[:, 7:7 + Hkv * Dh].view(6, Hkv, Dh)
    v = fused[:, 7 + Hkv * Dh:].view(6, Hkv, Dh)
    assert not k.is_contiguous() and not v.is_contiguous()
    slots = torch.tensor([1, 0, 3, 4, 5, 2], dtype=torch.int64)
    positions = torch.tensor([8, 4, 2, 0, 3, 1 + PAGE * bt.shape[1]], dtype=torch.int32)  # the last: beyond
    keep = [0, 1, 4]  # tokens with a real page
    want_k, want_v = k_pool.clone(), v_pool.clone()
    paged_kv_write_ref(k[keep], v[keep], want_k, want_v, bt, slots[keep], positions[keep])
    launches = []
    real = attention_kernel.lean
    monkeypatch.setattr(attention_kernel, "lean", lambda fn: launches.append(fn.__name__) or real(fn))
    got_k, got_v = k_pool.clone().to(device), v_pool.clone().to(device)
    paged_kv_write(*(t.to(device) for t in (k, v)), got_k, got_v, bt.to(device), slots.to(device),
                   positions.to(device))
    assert torch.equal(got_k[:-1].cpu(), want_k[:-1]) and torch.equal(got_v[:-1].cpu(), want_v[:-1])
    assert not torch.equal(got_k[-1].cpu(), k_pool[-1])
    if use_triton(got_k):
        assert launches == ["_paged_kv_write_kernel"]


@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (3, 3)], ids=["GQA", "MHA"])
def test_varlen_prefill_attention_matches_ref(Hq, Hkv, device):
    Dh, PAGE = 16, 4
    ctx = [0, 5, 0]        # prompt 1 continues 5 cached tokens
    lens = [7, 3, 1]
    slots = torch.tensor([2, 0, 1], dtype=torch.int32)  # prompt b uses block-table row slots[b]
    held = [0] * 4  # each row's length: its prompt's context and tokens
    for b, s in enumerate(slots.tolist()):
        held[s] = ctx[b] + lens[b]
    k_pool, v_pool, bt, _ = paged_pool(S=4, Np=12, PAGE=PAGE, Hkv=Hkv, Dh=Dh, lens=held)
    cu = torch.tensor([0, 7, 10, 11], dtype=torch.int32)
    T = 11
    g = seeded(4)
    q = torch.randn(T, Hq, Dh, generator=g)
    k_new, v_new = torch.randn(T, Hkv, Dh, generator=g), torch.randn(T, Hkv, Dh, generator=g)
    positions = torch.tensor([i + c for c, n in zip(ctx, lens) for i in range(n)], dtype=torch.int32)
    rows = torch.repeat_interleave(torch.arange(3), torch.tensor(lens)).int()
    paged_kv_write(k_new, v_new, k_pool, v_pool, bt, slots, positions, rows)
    want = varlen_prefill_attention_ref(q, k_pool, v_pool, bt, slots, cu, torch.tensor(ctx))
    d = lambda t: t.to(device)  # noqa: E731
    out = nan_like(q).to(device)
    got = varlen_prefill_attention(d(q), d(k_pool), d(v_pool), d(bt), d(slots), d(cu), ctx,
                                   k_new=d(k_new), v_new=d(v_new), out=out)
    torch.testing.assert_close(got.cpu(), want, **tol(torch.float32))
    got_pages = varlen_prefill_attention(d(q), d(k_pool), d(v_pool), d(bt), d(slots), d(cu), ctx)
    torch.testing.assert_close(got_pages.cpu(), want, **tol(torch.float32))
    # the host's own values of cu_seqlens and slots (as the model passes them): the same result
    got_host = varlen_prefill_attention(d(q), d(k_pool), d(v_pool), d(bt), d(slots), d(cu), ctx, k_new=d(k_new),
                                        v_new=d(v_new), cu_seqlens_host=cu.tolist(), slots_host=slots.tolist())
    assert torch.equal(got_host, got)


def test_attention_ops_reject_bad_input():
    k, v, bt, seq_lens = paged_pool(S=2, Np=4, PAGE=4, Hkv=2, Dh=8, lens=(3, 2))
    with pytest.raises(ValueError, match="paged_decode_attention: `q` expected shape"):
        paged_decode_attention(torch.randn(2, 3, 8), k, v, bt, seq_lens, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="paged_decode_attention: `slots` values must lie in"):
        paged_decode_attention(torch.randn(2, 4, 8), k, v, bt, seq_lens, torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="paged_decode_attention: `seq_lens` expected shape"):
        paged_decode_attention(torch.randn(2, 4, 8), k, v, bt, seq_lens[:1], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="paged_decode_attention: `num_splits` expected a power of two"):
        paged_decode_attention(torch.randn(2, 4, 8), k, v, bt, seq_lens, torch.tensor([0, 1]), num_splits=3)
    with pytest.raises(ValueError, match="varlen_prefill_attention: `ctx_lens` expected 1 values"):
        varlen_prefill_attention(torch.randn(3, 4, 8), k, v, bt, torch.tensor([0]), torch.tensor([0, 3]), [0, 0])
    with pytest.raises(ValueError, match="varlen_prefill_attention: `cu_seqlens_host` has 3 values, its tensor 2"):
        varlen_prefill_attention(torch.randn(3, 4, 8), k, v, bt, torch.tensor([0]), torch.tensor([0, 3]), [0],
                                 cu_seqlens_host=[0, 1, 3])
    with pytest.raises(ValueError, match="varlen_prefill_attention: `slots_host` has 2 values, its tensor 1"):
        varlen_prefill_attention(torch.randn(3, 4, 8), k, v, bt, torch.tensor([0]), torch.tensor([0, 3]), [0],
                                 slots_host=[0, 1])
    with pytest.raises(ValueError, match=r"varlen_prefill_attention: `slots_host` values must lie in \[0, 2\).*got \[5\]"):
        varlen_prefill_attention(torch.randn(3, 4, 8), k, v, bt, torch.tensor([0]), torch.tensor([0, 3]), [0],
                                 slots_host=[5])
    with pytest.raises(ValueError, match="paged_kv_write: `k` expected shape"):
        paged_kv_write(torch.randn(2, 3, 8), torch.randn(2, 3, 8), k, v, bt, torch.tensor([0, 1]),
                       torch.tensor([0, 1]))


@pytest.mark.gpu
@pytest.mark.parametrize("B,ctx,dtype", [(1, 4096, torch.bfloat16), (32, 2000, torch.bfloat16),
                                         (7, 333, torch.float16), (3, 1000, torch.float32)])
def test_paged_decode_attention_large_gpu(B, ctx, dtype):
    """Nemotron-H-8B's attention shape (32 query / 8 KV heads of 128), long contexts, 16-token pages."""
    Hq, Hkv, Dh, PAGE = 32, 8, 128, 16
    pages_per = -(-ctx // PAGE)
    k, v, bt, seq_lens = paged_pool(S=B + 1, Np=(B + 1) * pages_per + 1, PAGE=PAGE, Hkv=Hkv, Dh=Dh,
                                    lens=[ctx - b for b in range(B)], dtype=dtype)
    slots = torch.randperm(B, generator=seeded(5)).int()
    q = torch.randn(B, Hq, Dh, generator=seeded(6)).to(dtype)
    args = [t.cuda() for t in (q, k, v, bt, seq_lens, slots)]
    want = paged_decode_attention_ref(*args)
    for splits in (None, 1, 8):
        got = paged_decode_attention(*args, num_splits=splits)
        torch.testing.assert_close(got.float(), want, **tol(dtype))


# ---- the kernel's tiles: a loop trip of block_n tokens over block_n / PAGE pages ----------------

def dense_decode(q, keys, vals, scale):
    """fp32 attention of q [Hq, Dh] over keys / vals [n, Hkv, Dh] (every key, no mask)."""
    G = q.shape[0] // keys.shape[1]
    k, v = keys.float().repeat_interleave(G, 1), vals.float().repeat_interleave(G, 1)
    w = torch.einsum("hd,nhd->hn", q.float(), k).mul(scale).softmax(-1)
    return torch.einsum("hn,nhd->hd", w, v)


def poison_unused(k, v, bt, seq_lens):
    """NaN in every pool row no request owns (pages never handed out, the tail rows of each
    request's last page, the scratch page): a kernel that reads one fails the comparison."""
    PAGE = k.shape[1]
    used = torch.zeros(k.shape[:2], dtype=torch.bool)
    for s in range(bt.shape[0]):
        n = int(seq_lens[s])
        for t in range(n):
            used[int(bt[s, t // PAGE]), t % PAGE] = True
    k[~used] = float("nan")
    v[~used] = float("nan")


# base row, then rows that each change one thing: (Hq, Hkv, Dh, PAGE, block_n, num_splits)
TILE_ROWS = [
    pytest.param(4, 2, 16, 4, 16, 1, id="P4-N16"),
    pytest.param(4, 2, 16, 16, 16, 1, id="P16-N16"),          # one page per trip
    pytest.param(4, 2, 16, 16, 32, 1, id="P16-N32"),          # two pages per trip
    pytest.param(4, 2, 16, 4, 32, 1, id="P4-N32"),            # eight pages per trip
    pytest.param(4, 2, 16, 4, 64, 1, id="P4-N64-capped"),     # the launcher caps trips at 8 pages
    pytest.param(4, 2, 16, 64, 16, 1, id="P64-N16"),          # four trips per page
    pytest.param(4, 2, 16, 4, 16, 2, id="P4-N16-split2"),
    pytest.param(4, 2, 16, 16, 32, 4, id="P16-N32-split4"),   # runs past the short requests' ends
    pytest.param(4, 4, 16, 4, 16, 1, id="G1"),
    pytest.param(6, 2, 24, 4, 16, 2, id="G3-D24-split2"),
    pytest.param(8, 1, 16, 16, 16, 1, id="G8-MQA"),
]


@pytest.mark.parametrize("Hq,Hkv,Dh,PAGE,block_n,num_splits", TILE_ROWS)
def test_paged_decode_tiles_match_ref(Hq, Hkv, Dh, PAGE, block_n, num_splits, device):
    """Every tile / page / split combination against the reference, launched with an explicit
    config; lengths that end inside a page and inside a tile (45, 33), exactly one tile (16), one
    token, none; shuffled slots, a pad row; every pool row no request owns is NaN."""
    from fastmamba.ops.attention.configs import DecodeConfig
    from fastmamba.ops.attention.kernel import launch_paged_decode_attention

    lens = (45, 1, 0, 16, 33)
    k, v, bt, seq_lens = paged_pool(S=6, Np=-(-45 // PAGE) * 4 + 6, PAGE=PAGE, Hkv=Hkv, Dh=Dh, lens=lens)
    poison_unused(k, v, bt, seq_lens)
    slots = torch.tensor([4, 0, -1, 3, 2, 1], dtype=torch.int32)
    q = torch.randn(6, Hq, Dh, generator=seeded(7))
    k, v, bt, seq_lens, slots, q = (t.to(device) for t in (k, v, bt, seq_lens, slots, q))
    out = nan_like(q)
    launch_paged_decode_attention(q, k, v, bt, seq_lens, slots, out, Dh ** -0.5,
                                  DecodeConfig(block_n, 1, 1, num_splits))
    want = paged_decode_attention_ref(q, k, v, bt, seq_lens, slots)
    torch.testing.assert_close(out, want, **tol(torch.float32))
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # pad row
    assert torch.equal(out[4], torch.zeros_like(out[4]))  # slot 2: nothing cached


@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_decode_skips_out_of_pool_pages(num_splits, device):
    """A block-table entry outside [0, Np) inside a request's length is masked: the output equals
    attention over the tokens of its other pages; nothing else is read (unowned rows are NaN).
    Batch 1; 16-token pages."""
    Hq, Hkv, Dh, PAGE = 4, 2, 16, 16
    n = 70  # 5 pages, the last one partly filled
    k, v, bt, seq_lens = paged_pool(S=2, Np=9, PAGE=PAGE, Hkv=Hkv, Dh=Dh, lens=(n,))
    poison_unused(k, v, bt, seq_lens)
    bad = bt.clone()
    bad[0, 1] = 9 + 3   # past the pool
    bad[0, 3] = -7      # negative
    q = torch.randn(1, Hq, Dh, generator=seeded(8))
    keep = [p for p in range(5) if p not in (1, 3)]
    rows = [(int(bt[0, p]), t) for p in keep for t in range(PAGE) if p * PAGE + t < n]
    keys = torch.stack([k[pg, t] for pg, t in rows])
    vals = torch.stack([v[pg, t] for pg, t in rows])
    want = dense_decode(q[0], keys, vals, Dh ** -0.5)
    d = lambda t: t.to(device)  # noqa: E731
    got = paged_decode_attention(d(q), d(k), d(v), d(bad), d(seq_lens), d(torch.tensor([0], dtype=torch.int32)),
                                 num_splits=num_splits, out=nan_like(d(q)))
    torch.testing.assert_close(got[0].cpu(), want, **tol(torch.float32))


def test_paged_decode_mixed_dtypes_match_ref(device):
    """An fp32 query over bf16 pools (every product in fp32): the reference's result."""
    Hq, Hkv, Dh, PAGE = 4, 2, 16, 4
    k, v, bt, seq_lens = paged_pool(S=3, Np=12, PAGE=PAGE, Hkv=Hkv, Dh=Dh, lens=(19, 6, 1), dtype=torch.bfloat16)
    q = torch.randn(3, Hq, Dh, generator=seeded(9))
    slots = torch.tensor([2, 0, 1], dtype=torch.int32)
    args = [t.to(device) for t in (q, k, v, bt, seq_lens, slots)]
    got = paged_decode_attention(*args, out=nan_like(args[0]))
    want = paged_decode_attention_ref(*args)
    torch.testing.assert_close(got, want, **tol(torch.float32))


def test_launch_config_heuristic():
    """The launcher's choice: tiles that fit in shared memory (two programs per SM for bf16 at head
    dim 128), powers of two; more split-K runs the fewer (request, KV head) programs there are, none
    for a GPU-filling batch, and never runs shorter than MIN_SPLIT_TOKENS of the table's width."""
    from fastmamba.ops.attention import configs

    for dh, size in [(128, 2), (64, 2), (128, 4), (256, 2), (80, 2)]:
        c = configs.pick_config(8, 8192, dh, size, 132)
        assert c.block_n >= 16 and c.block_n & (c.block_n - 1) == 0
        assert configs.tile_smem_bytes(c.block_n, c.num_stages, dh, size) <= configs.SMEM_BYTES
    c = configs.pick_config(32 * 8, 8192, 128, 2, 132)
    assert 2 * configs.tile_smem_bytes(c.block_n, c.num_stages, 128, 2) <= configs.SMEM_BYTES
    sms = 132
    prev = configs.MAX_SPLITS
    for programs in (1, 8, 64, 256, 512, 2048, 8192):
        s = configs.pick_splits(programs, 32768, sms)
        assert 1 <= s <= prev and s & (s - 1) == 0
        assert s == 1 or 32768 // s >= configs.MIN_SPLIT_TOKENS
        assert s == configs.MAX_SPLITS or programs * s >= configs.SPLIT_TARGET_WAVES * sms or \
            32768 // (2 * s) < configs.MIN_SPLIT_TOKENS  # as many as the target asks for, or at the floor
        prev = s
    assert configs.pick_splits(8, 32768, sms) > 1  # batch 1 at the 8B shape: split
    assert configs.pick_splits(configs.SPLIT_TARGET_WAVES * sms, 32768, sms) == 1
    assert configs.pick_splits(8, 1024, sms) <= 1024 // configs.MIN_SPLIT_TOKENS  # short tables: long runs


@pytest.mark.gpu
def test_paged_decode_attention_cuda_graph_gpu():
    """Captured once with static block table, lengths and slots (the automatic config: split-K at
    this batch), replayed after the requests grew, moved to other slots and pages and one became
    a pad row: every replay equals the reference on the buffers' new contents (no host read)."""
    Hq, Hkv, Dh, PAGE, B, dtype = 32, 8, 128, 16, 4, torch.bfloat16
    S, Pmax, Np = 6, 80, 6 * 80 + 1
    g = seeded(10)
    k = torch.randn(Np, PAGE, Hkv, Dh, generator=g).to(dtype).cuda()
    v = torch.randn(Np, PAGE, Hkv, Dh, generator=g).to(dtype).cuda()
    bt = torch.full((S, Pmax), -1, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(S, dtype=torch.int32, device="cuda")
    slots = torch.zeros(B, dtype=torch.int32, device="cuda")
    q = torch.zeros(B, Hq, Dh, dtype=dtype, device="cuda")
    out = torch.empty_like(q)

    def fill(lens, slot_ids, seed):
        gen = seeded(seed)
        perm = torch.randperm(Np - 1, generator=gen)
        bt.copy_(perm[: S * Pmax].view(S, Pmax).int())
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        slots.copy_(torch.tensor(slot_ids, dtype=torch.int32))
        q.copy_(torch.randn(B, Hq, Dh, generator=gen).to(dtype))

    fill([100, 7, 1200, 0, 33, 16], [0, 1, 2, 3], 11)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        paged_decode_attention(q, k, v, bt, seq_lens, slots, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, k, v, bt, seq_lens, slots, out=out)
    for lens, slot_ids, seed in [([100, 7, 1200, 0, 33, 16], [0, 1, 2, 3], 11),
                                 ([1279, 8, 1201, 0, 34, 17], [2, 5, -1, 0], 12)]:
        fill(lens, slot_ids, seed)
        out.fill_(float("nan"))
        graph.replay()
        want = paged_decode_attention_ref(q, k, v, bt, seq_lens, slots)
        torch.testing.assert_close(out.float(), want, **tol(dtype))


def test_decode_slots_checked_on_the_device_report_at_the_next_call(device, monkeypatch):
    """An eager call on GPU tensors (here CPU ones with the switch on, under the interpreter) reads
    no slot on the host: a bad slot's row is skipped (zero output) and the next call raises."""
    import fastmamba.ops._common.checks as checks
    from fastmamba.ops.attention import api as attention_api
    from fastmamba.ops.attention.ref import paged_decode_attention_ref

    if device.type != "cuda":
        if not attention_api.use_triton(torch.empty(1)):
            pytest.skip("the kernel path needs TRITON_INTERPRET=1 on the CPU")
        monkeypatch.setattr(attention_api, "DEVICE_CHECK_CPU", True)
    k, v, bt, seq_lens = (t.to(device) for t in paged_pool(S=3, Np=8, PAGE=4, Hkv=2, Dh=8, lens=(5, 3, 7)))
    q = torch.randn(2, 4, 8, generator=seeded(1)).to(device)
    reads = []
    monkeypatch.setattr(checks, "host_list", lambda t, real=checks.host_list: reads.append(t) or real(t))
    out = paged_decode_attention(q, k, v, bt, seq_lens, torch.tensor([2, 5], dtype=torch.int32, device=device))
    assert reads == []
    if device.type == "cuda":
        torch.cuda.synchronize()
    want = paged_decode_attention_ref(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), seq_lens.cpu(), torch.tensor([2, -1]))
    torch.testing.assert_close(out.cpu(), want, **tol(torch.float32))
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # the bad row acts as a pad row
    good = torch.tensor([2, 0], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"paged_decode_attention: `slots` values must lie in \[0, 3\).*earlier "
                                         r"call.*\[5\]"):
        paged_decode_attention(q, k, v, bt, seq_lens, good)
    paged_decode_attention(q, k, v, bt, seq_lens, good)  # reported once


@pytest.mark.gpu
def test_gpu_decode_attention_never_synchronizes():
    dev = torch.device("cuda")
    k, v, bt, seq_lens = (t.to(dev) for t in paged_pool(S=3, Np=8, PAGE=4, Hkv=2, Dh=8, lens=(5, 3, 7)))
    q = torch.randn(2, 4, 8, device=dev)
    slots = torch.tensor([2, 0], dtype=torch.int32, device=dev)
    paged_decode_attention(q, k, v, bt, seq_lens, slots)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            paged_decode_attention(q, k, v, bt, seq_lens, slots)
    finally:
        torch.cuda.set_sync_debug_mode("default")
