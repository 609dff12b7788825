"""Prefix caching for hybrid models (NemotronHLM: Mamba-2 and attention layers, paged K/V): a
snapshot keeps the Mamba states and the K/V of its tokens; a hit restores both and prefills only
the rest, with the output of an engine without the cache (fp32: bit-equal logits for the same
split of the prefill); multi-turn conversations prefill only each turn's new tokens; the prefix
pool's pages stay bounded and the engine's pages all come back."""
from __future__ import annotations

import pytest
import torch

from fastmamba.cache.prefix_cache import PrefixCache, SnapshotPlan
from fastmamba.generation.sampling import SamplingParams
from tests.generation.test_engine_hybrid import PAGE, assert_all_free, build_model, engine_of

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=2)


def run(engine, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], list[float]]:
    """One request to its end: its tokens and each one's logprob (the logits' fingerprint: a wrong
    restored K/V or state moves them even where the greedy tokens survive it)."""
    rid = engine.add_request(prompt, params)
    out = []
    while engine.has_unfinished():
        out += [o for o in engine.step() if o.rid == rid]
    engine.pop_finished(rid)
    return [o.token for o in out], [o.logprob for o in out]


def scrub(engine) -> None:
    """NaN into every K/V page of an idle engine: a page that a hit reads without the restore having
    written it poisons the logits (freed pages come back in the same order, still holding the K/V
    of the request before)."""
    assert not engine.has_unfinished()
    for pool in engine.cache.kv.k + engine.cache.kv.v:
        pool.fill_(float("nan"))


def same_run(got, want) -> None:
    assert got[0] == want[0]
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def model():
    return build_model()


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill(model, cache, slot: int, ids: list[int], snapshots=None) -> torch.Tensor:
    return model.prefill_varlen(torch.tensor(ids), torch.tensor([0, len(ids)], dtype=torch.int32), cache,
                                torch.tensor([slot], dtype=torch.int32), cu_seqlens_host=[0, len(ids)],
                                slots_host=[slot], snapshots=snapshots)


def kv_rows(cache, slot: int, n: int) -> list[torch.Tensor]:
    """The K and V of slot ``slot``'s first ``n`` positions, every attention layer."""
    kv = cache.kv
    pages = kv.pages_of(slot)
    pos = torch.arange(n)
    page, row = torch.tensor(pages)[pos // PAGE], pos % PAGE
    return [pool[page, row] for pool in kv.k + kv.v]


def test_a_hit_restores_states_and_kv_and_gives_bit_equal_logits(model):
    """A snapshot taken inside a prefill (chunk end 16 of 21 tokens) holds the Mamba states and the
    K/V of its 16 tokens; restored into a fresh slot, prefilling the rest gives the logits that
    prefilling the rest in a slot holding exactly those 16 tokens gives, bit for bit."""
    cache = model.new_cache(4, page_size=PAGE, max_seq_len=64)
    pool = PrefixCache(cache, max_entries=2)
    shared, more, tail = tokens(16, 1), tokens(5, 2), tokens(7, 3)
    entry = pool.claim(shared)
    assert pool.claim_pages(entry) and len(entry.pages) == 16 // PAGE
    src, ref = cache.take(2)
    plan = SnapshotPlan((0,), (16,), (entry.index,), pool.conv, pool.ssm)
    prefill(model, cache, src, shared + more, snapshots=plan)  # the snapshot at 16 of 21 tokens
    pool.copy_kv_in(entry, cache, src)
    prefill(model, cache, ref, shared)  # a slot that holds exactly the 16 tokens
    for layer in range(len(cache.ssm)):  # another call, other row counts: last bits may differ
        torch.testing.assert_close(pool.ssm[layer][entry.index], cache.ssm[layer][ref], rtol=1e-5, atol=1e-6)
    hit = cache.take(1, zero=[False])[0]
    pool.restore(entry, cache, hit)
    assert cache.length(hit) == 16
    for got, want in zip(kv_rows(cache, hit, 16), kv_rows(cache, src, 16)):
        assert torch.equal(got, want)  # the K/V of the prefix, bit for bit
    for layer in range(len(cache.ssm)):
        assert torch.equal(cache.ssm[layer][hit], pool.ssm[layer][entry.index])
        assert torch.equal(cache.conv[layer][hit], pool.conv[layer][entry.index])
    # the restored slot continues exactly as a slot left after those 16 tokens by a split prefill
    split = cache.take(1)[0]
    prefill(model, cache, split, shared, snapshots=SnapshotPlan((0,), (16,), (entry.index,), pool.conv, pool.ssm))
    assert torch.equal(prefill(model, cache, hit, tail), prefill(model, cache, split, tail))
    cache.free([src, ref, hit, split])
    cache.kv.check()


def test_restore_and_save_refuse_slots_that_do_not_fit(model):
    cache = model.new_cache(2, page_size=PAGE, max_seq_len=64)
    pool = PrefixCache(cache, max_entries=2)
    a, b = cache.take(2)
    prefill(model, cache, a, tokens(8, 4))
    with pytest.raises(ValueError, match="holds the K/V of 8 tokens, fewer than the snapshot's 12"):
        pool.save(tokens(12, 5), cache, a)
    entry = pool.save(tokens(8, 4), cache, a)
    assert entry is not None and len(entry.pages) == 2
    with pytest.raises(ValueError, match="slot 0 holds 8 tokens already"):
        pool.restore(entry, cache, a)
    pool.restore(entry, cache, b)
    assert cache.length(b) == 8
    assert cache.num_slots == 2 and cache.kv_pages_in_use == 4  # what the server's metrics read
    cache.free([a, b])
    cache.kv.check()
    assert cache.kv_pages_in_use == 0


@pytest.mark.parametrize("prefill_chunk", [None, 8, 16])
def test_engine_hits_skip_the_cached_tokens_and_keep_the_output(model, prefill_chunk):
    shared = tokens(24, 7)
    first, second = shared + tokens(5, 8), shared + tokens(7, 9)
    plain = engine_of(model, max_batch=2, prefill_chunk=prefill_chunk)
    want = [run(plain, first), run(plain, second)]
    eng = engine_of(model, max_batch=2, prefill_chunk=prefill_chunk, prefix_cache_entries=8, prefix_block=8)
    same_run(run(eng, first), want[0])
    scrub(eng)
    before = eng.stats["prefill_tokens"]
    same_run(run(eng, second), want[1])
    assert eng.stats["prefill_tokens"] - before == len(second) - 24  # the block snapshot at 24 was hit
    st = eng.prefix_stats
    assert st["hits"] == 1 and st["hit_tokens"] == 24
    assert_all_free(eng)


def test_multi_turn_conversation_prefills_only_the_new_tokens(model):
    eng = engine_of(model, max_batch=2, prefix_cache_entries=16, prefix_block=32)
    ref = engine_of(model, max_batch=2)
    history: list[int] = []
    for turn in range(5):
        new = tokens(3 + 2 * turn, 20 + turn)
        prompt = history + new
        before = eng.stats["prefill_tokens"]
        params = SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=1)
        scrub(eng)
        got = run(eng, prompt, params)
        same_run(got, run(ref, prompt, params))
        reply = got[0]
        prefilled = eng.stats["prefill_tokens"] - before
        assert prefilled == (len(new) if turn == 0 else len(new) + 1), (turn, prefilled)
        history = prompt + reply
    assert eng.prefix_stats["hits"] == 4
    assert_all_free(eng)


def test_prefix_pages_stay_bounded_and_a_hit_waits_for_pages(model):
    """A prefix pool of 6 pages: older snapshots are evicted to make room. An engine pool of 12
    pages: two requests of 29 + 6 tokens (9 pages each) cannot both hold pages, so the second waits;
    it then hits the first one's snapshots (its restored prefix takes pages of its own) and both
    keep the output of an engine without the cache."""
    shared = tokens(24, 30)
    prompts = [shared + tokens(5, 31), shared + tokens(5, 32)]
    ref = engine_of(model, max_batch=2)
    want = [run(ref, p)[0] for p in prompts]
    eng = engine_of(model, max_batch=2, kv_num_pages=12, prefill_chunk=8, prefix_cache_entries=8, prefix_block=8)
    assert eng.prefix.kv_pages == 8 * 16  # default: every entry at the longest request
    small = engine_of(model, max_batch=2, kv_num_pages=12, prefill_chunk=8, prefix_block=8)
    small.prefix = PrefixCache(small.cache, max_entries=8, kv_pages=6)
    for e in (eng, small):
        assert e.generate(prompts, GREEDY) == want
        assert_all_free(e)
    assert small.prefix.stats["evictions"] > 0
    assert sum(len(x.pages) for x in small.prefix._by_key.values()) <= 6
    assert eng.prefix_stats["hits"] == 1 and eng.prefix_stats["hit_tokens"] == 24


def test_speculative_engine_takes_block_snapshots_and_hits_them(model):
    """With speculation (verify steps roll the K/V back): block snapshots only, as for Mamba2LM;
    the second prompt hits the shared prefix and keeps the output of the engine without a cache."""
    shared = tokens(16, 80)
    prompts = [shared + tokens(5, 81), shared + tokens(3, 82)]
    ref = engine_of(model, max_batch=2, speculate=2, prefill_chunk=8)
    eng = engine_of(model, max_batch=2, speculate=2, prefill_chunk=8, prefix_cache_entries=4, prefix_block=8)
    for p in prompts:
        scrub(eng)
        same_run(run(eng, p), run(ref, p))
    assert eng.prefix_stats["hit_tokens"] == 16
    assert all(e.length in (8, 16) for e in eng.prefix._by_key.values())  # no end-of-request snapshot
    assert_all_free(eng)


@pytest.mark.parametrize("prefill_chunk", [None, 8])
def test_requests_sharing_a_prefix_in_one_batch(model, prefill_chunk):
    """Four requests sharing a 16-token prefix arrive together: the first steps take the snapshots
    (one per prefix, however many requests pass it in one call), later admissions hit them while
    others are still prefilling; every output equals the engine's without a cache."""
    shared = tokens(16, 100)
    prompts = [shared + tokens(3 + i, 101 + i) for i in range(4)]
    ref = engine_of(model, max_batch=2, prefill_chunk=prefill_chunk)
    want = ref.generate(prompts, GREEDY)
    eng = engine_of(model, max_batch=2, prefill_chunk=prefill_chunk, prefix_cache_entries=8, prefix_block=8)
    assert eng.generate(prompts, GREEDY) == want
    assert eng.prefix_stats["hits"] >= 2  # max_batch 2: the last two start after snapshots exist
    assert all(len(e.tokens) in (8, 16) or e.tokens[:16] == tuple(shared) for e in eng.prefix._by_key.values())
    assert_all_free(eng)


@pytest.mark.gpu
def test_hybrid_prefix_cache_on_gpu_keeps_the_output():
    """The same hits on a GPU (the kernels' snapshot path, CUDA-graph decode with paged K/V)."""
    import fastmamba
    from fastmamba.generation.engine import Engine

    m = fastmamba.load_model("nemotron-h-tiny", dtype=torch.float32, device="cuda")
    shared = tokens(64, 70)
    prompts = [shared + tokens(9, 71), shared + tokens(20, 72), shared + tokens(3, 73)]
    ref = Engine(m, max_batch=4)
    eng = Engine(m, max_batch=4, prefix_cache_entries=8, prefix_block=32)
    want = [run(ref, p) for p in prompts]
    for p, w in zip(prompts, want):
        scrub(eng)
        same_run(run(eng, p), w)
    assert eng.prefix_stats["hit_tokens"] == 2 * 64
    assert eng.cache.kv_pages_in_use == 0


def test_pool_sizes_from_a_budget_and_page_eviction_order(model):
    """A byte budget: half for the snapshots' states, the rest for K/V pages. When the pages run
    short, the least recently used snapshots go first (their rows and pages both come back)."""
    cache = model.new_cache(2, page_size=PAGE, max_seq_len=64)
    per_entry = PrefixCache(cache, max_entries=1).bytes_per_entry
    page_bytes = 2 * len(cache.kv.k) * cache.kv.k[0][0].numel() * cache.kv.k[0].element_size()
    budget = 6 * per_entry + 5 * page_bytes
    pool = PrefixCache(cache, budget_bytes=budget)
    assert pool.max_entries == 3 and pool.kv_pages == (budget - 3 * per_entry) // page_bytes
    pool = PrefixCache(cache, max_entries=4, kv_pages=5)
    slot = cache.take(1)[0]
    ids = tokens(20, 90)
    prefill(model, cache, slot, ids)
    a = pool.save(ids[:8], cache, slot)  # 2 pages
    assert pool.save(ids[:4], cache, slot) is not None  # 1 page
    pool.lookup(ids[:8])  # a is now the most recently used
    c = pool.save(ids[:12], cache, slot)  # 3 pages: 2 free, so b (least recent) goes
    assert pool.lookup(ids[:4]) is None and pool.lookup(ids[:8]) is a and pool.lookup(ids[:12]) is c
    assert sorted(a.pages + c.pages) == sorted(set(a.pages + c.pages)) and len(pool._kv_free) == 0
    d = pool.save(ids[:20], cache, slot)  # all 5 pages: every other snapshot goes
    assert d is not None and len(pool) == 1 and len(d.pages) == 5 and pool.lookup(ids[:12]) is None
    small = PrefixCache(cache, max_entries=2, kv_pages=4)  # 5 pages can never fit: nothing is taken
    assert small.save(ids[:20], cache, slot) is None and len(small) == 0 and len(small._kv_free) == 4
    assert small.save(ids[:8], cache, slot) is not None and small.stats["saves"] == 1
    assert pool.lookup(ids[:4]) is None
    cache.free([slot])


def test_an_attention_only_cache_has_no_states_to_keep():
    from fastmamba.cache.hybrid_cache import HybridCache

    cache = HybridCache(2, mamba_cfg=None, n_attn_layers=1, n_kv_heads=1, head_dim=4, max_seq_len=16,
                        page_size=PAGE, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="no Mamba slots"):
        PrefixCache(cache, max_entries=2)


def test_max_request_tokens_is_the_kv_limit(model):
    """What the server checks requests against (400 before the engine): the KV positions one
    request may use; none for a pure Mamba-2 model."""
    import fastmamba
    from fastmamba.generation.engine import Engine

    assert engine_of(model, max_batch=2).max_request_tokens == 64  # max_seq_len 64
    assert engine_of(model, max_batch=2, speculate=2).max_request_tokens == 62  # verify holds 2 drafts
    assert engine_of(model, max_batch=2, kv_num_pages=5).max_request_tokens == 5 * PAGE  # the pool is smaller
    tiny = fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cpu")
    assert Engine(tiny, max_batch=2, cuda_graphs=False).max_request_tokens is None

