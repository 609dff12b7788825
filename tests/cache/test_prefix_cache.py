"""PrefixCache: snapshots of a slot's states keyed by the exact token prefix, LRU-bounded."""
from __future__ import annotations

import pytest
import torch

import fastmamba
from fastmamba.cache.prefix_cache import MAX_ENTRIES_FROM_BUDGET, PrefixCache, as_tokens, copy_rows


@pytest.fixture(scope="module")
def model():
    return fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cpu")


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # state bookkeeping, not kernels: the PyTorch references


def prefill(model, cache, slot, tokens, continue_=False):
    return model.prefill_varlen(torch.tensor(tokens), torch.tensor([0, len(tokens)], dtype=torch.int32), cache,
                                torch.tensor([slot], dtype=torch.int32), has_initial_state=continue_)


def test_keys_are_exact_token_tuples():
    import numpy as np

    assert as_tokens([5, 6, 7]) == (5, 6, 7) and as_tokens(np.array([5, 6])) == (5, 6)
    assert all(type(t) is int for t in as_tokens(np.array([5, 6])))
    assert as_tokens(torch.tensor([1, 2])) == (1, 2)
    assert all(type(t) is int for t in as_tokens([True, 3]))  # bool is not kept as a key element


def test_copy_rows_of_stacked_pools():
    """One row of every layer of stacked pools ([n_layer, rows, ...], bf16 and fp32) copied; other rows untouched."""
    g = torch.Generator().manual_seed(3)
    src = [torch.randn(3, 4, 3, 5, generator=g).to(torch.bfloat16), torch.randn(3, 4, 2, 2, generator=g)]
    dst = [torch.full((3, 6, *t.shape[2:]), float("nan"), dtype=t.dtype) for t in src]
    copy_rows(dst, 5, src, 2)
    for d, s in zip(dst, src):
        assert torch.equal(d[:, 5], s[:, 2]) and d[:, :5].isnan().all()


def test_take_leaves_restored_slots_unzeroed(model):
    cache = model.new_cache(3)
    for pool in cache.conv + cache.ssm:
        pool.fill_(7.0)
    a, b = cache.take(2, zero=[True, False])
    for pool in cache.conv + cache.ssm:
        assert (pool[a] == 0).all() and (pool[b] == 7).all()
    with pytest.raises(ValueError, match="`zero` expected 1 bools"):
        cache.take(1, zero=[True, False])
    with pytest.raises(ValueError, match=r"`zero` expected 1 bools \(one per slot\), got a bool"):
        cache.take(1, zero=True)
    assert cache.free_slots == 1  # nothing taken by the refused calls


def test_take_marks_every_speculative_slot_prefilled(model):
    """A slot taken for a prefix-cache restore (not zeroed) is still left ready for verify."""
    cache = model.new_cache(3, speculate=2)
    cache.conv_accepted.fill_(0)
    a, b = cache.take(2, zero=[False, False])
    assert cache.conv_accepted[[a, b]].tolist() == [cache.tokens_per_step] * 2


def test_hit_restores_the_exact_state(model):
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 256, (20,), generator=g).tolist()
    tail = torch.randint(0, 256, (7,), generator=g).tolist()
    cache = model.new_cache(4)
    pc = PrefixCache(cache, max_entries=2)
    prefill(model, cache, 0, shared)
    pc.save(shared, cache, 0)

    # without the cache: the same split (prefix, then the tail from its state) in slot 1
    prefill(model, cache, 1, shared)
    want = prefill(model, cache, 1, tail, continue_=True)
    # with it: slot 2 starts from the snapshot and prefills only the tail
    entry = pc.match(shared + tail)
    assert entry is not None and entry.length == 20
    pc.restore(entry, cache, 2)
    got = prefill(model, cache, 2, tail, continue_=True)
    assert torch.equal(got, want)  # bit-equal logits
    for layer in range(model.cfg.n_layer):
        assert torch.equal(cache.ssm[layer][2], cache.ssm[layer][1])
        assert torch.equal(cache.conv[layer][2], cache.conv[layer][1])
    # and close to one unsplit prefill of the whole prompt
    whole = prefill(model, cache, 3, shared + tail)
    torch.testing.assert_close(got, whole, atol=1e-4, rtol=1e-4)
    assert pc.stats["hits"] == 1 and pc.stats["hit_tokens"] == 20


def test_match_rules_and_lru(model):
    cache = model.new_cache(2)
    pc = PrefixCache(cache, max_entries=2)
    assert pc.match([1, 2, 3]) is None
    a = pc.save([1, 2, 3], cache, 0)
    assert pc.match([1, 2, 3]) is None  # the whole prompt cached: its last token must still run
    assert pc.match([1, 2, 3, 4]).index == a.index
    assert pc.match([1, 2, 4, 4]) is None  # a different prefix
    pc.save([1, 2], cache, 0)
    assert pc.match([1, 2, 3, 4]).length == 3  # the longest prefix wins
    pc.save([9, 9, 9], cache, 1)  # pool full: evicts the least recently used ([1, 2])
    assert len(pc) == 2 and pc.stats["evictions"] == 1
    assert pc.match([1, 2, 5]) is None
    assert pc.match([9, 9, 9, 1]).length == 3
    with pytest.raises(ValueError, match="evicted"):
        old = pc.match([1, 2, 3, 4])
        pc.save([7, 7, 7], cache, 0)  # evicts [9, 9, 9]? no: [1, 2, 3] was just used; [9, 9, 9] goes
        pc.save([8, 8, 8], cache, 0)  # now [1, 2, 3] goes
        pc.restore(old, cache, 1)


def test_sizing(model):
    cache = model.new_cache(1)
    pc = PrefixCache(cache, budget_bytes=10**9)
    assert pc.max_entries == min(10**9 // pc.bytes_per_entry, MAX_ENTRIES_FROM_BUDGET)
    with pytest.raises(ValueError, match="at least one snapshot"):
        PrefixCache(cache, budget_bytes=10)
    with pytest.raises(ValueError, match="max_entries or budget_bytes"):
        PrefixCache(cache)
