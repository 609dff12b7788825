"""Engine over a hybrid model (NemotronHLM: Mamba-2, attention, MLP layers; paged KV): greedy tokens
equal the model's own full-forward greedy continuation; a request's tokens do not depend on the
batch, slot or pages it got; chunked prefill equals unchunked; the KV pool is managed (requests
that can never fit are refused, requests wait for pages, an exhausted pool fails one request with
a clear error) and every slot and page comes back under churn, aborts and failed steps."""
from __future__ import annotations

import random
import weakref

import pytest
import torch

import fastmamba
from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import SamplingParams
from fastmamba.models.nemotron_h import NemotronHConfig, NemotronHLM, random_init
from fastmamba.ops._common.dispatch import interpreter_enabled

# every kind twice, attention first and last, GQA (4 query / 2 KV heads), 2 Mamba groups
CFG = NemotronHConfig(d_model=64, vocab_size=256, pattern="*M-M*-M*", n_heads=4, n_kv_heads=2, head_dim=16,
                      intermediate_size=96, mamba_nheads=8, mamba_headdim=16, n_groups=2, d_state=16, chunk_size=8)
PAGE = 4  # small pages: every request crosses several
G = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(0, 256, (n,), generator=G).tolist() for n in (1, 5, 13, 22, 3, 9)]


def build_model() -> NemotronHLM:
    """The tiny hybrid of these tests (fp32, CPU)."""
    m = random_init(NemotronHLM(CFG, device="cpu", dtype=torch.float32)).eval()
    with torch.no_grad():  # larger mixer weights than the random preset's: every layer moves the logits
        for block in m.backbone.layers:
            for p in block.mixer.parameters():
                if p.dim() == 2:
                    p.mul_(3)
    return m


@pytest.fixture(scope="module")
def model():
    return build_model()


# per model (weakly: a model's entries go with it, and a new model at a dead one's address starts
# empty), then per prompt: the tokens decoded so far
_REFERENCE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def greedy_reference(model, prompt, n):
    """Greedy decoding by full forwards of the whole sequence (no cache): the definition."""
    known = _REFERENCE.setdefault(model, {})
    key = tuple(prompt)
    ids = list(prompt) + known.get(key, [])
    while len(ids) - len(prompt) < n:
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    known[key] = ids[len(prompt):]
    return ids[len(prompt):len(prompt) + n]


def engine_of(model, **kw):
    kw.setdefault("kv_page_size", PAGE)
    kw.setdefault("max_seq_len", 64)
    return Engine(model, **kw)


def assert_all_free(engine):
    assert not engine.has_unfinished()
    assert engine.cache.free_slots == engine.max_batch
    kv = engine.cache.kv
    assert kv.free_pages == kv.num_pages
    kv.check()  # no page lost, shared or both held and free; device table and lengths agree


def test_greedy_equals_full_forward_greedy(model):
    """Six requests, two slots: requests join as others leave (continuous batching), prompts of
    1..22 tokens (pages of 4), different lengths out."""
    n_new = [6, 3, 7, 4, 5, 2]
    engine = engine_of(model, max_batch=2)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in n_new]
    outs = engine.generate(PROMPTS, params)
    for p, n, out in zip(PROMPTS, n_new, outs):
        assert out == greedy_reference(model, p, n)
    assert len(set(map(tuple, outs))) == len(outs)  # the model does not just repeat itself
    assert_all_free(engine)


def test_tokens_do_not_depend_on_batch_slot_or_pages(model):
    """A target request alone (slot 0, the first pages) and joining a busy engine (another slot,
    pages after and between others' after some left): the same greedy and seeded sampled tokens."""
    target = PROMPTS[3]
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=3)
    alone = [engine_of(model, max_batch=1).generate([target], sp)[0] for sp in (greedy, sampled)]

    engine = engine_of(model, max_batch=4)
    others = [engine.add_request(p, SamplingParams(max_new_tokens=k, ignore_eos=True))
              for p, k in zip(PROMPTS[:3], (2, 9, 4))]
    engine.step()  # the three others take slots 0..2 and the first pages
    engine.step()
    engine.step()  # the first other finished: its slot and pages are free again
    assert engine.cache.free_slots == 2
    rids = [engine.add_request(target, sp) for sp in (greedy, sampled)]
    engine.step()  # the targets' prefill
    placed = {r.rid: (r.slot, engine.cache.kv.pages_of(r.slot)) for r in engine.running if r.rid in rids}
    assert all(pages != list(range(len(pages))) for _, pages in placed.values())  # alone: pages 0, 1, ...
    assert {slot for slot, _ in placed.values()} != {0}
    while engine.has_unfinished():
        engine.step()
    got = [engine.finished[rid] for rid in rids]
    assert [r.output for r in got] == alone
    assert len(engine.pop_finished()) == len(others) + 2
    assert_all_free(engine)


def test_chunked_prefill_equals_unchunked(model):
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    want = engine_of(model, max_batch=3).generate(PROMPTS[1:4], params)
    for chunk in (1, 3, 8, 64):
        engine = engine_of(model, max_batch=3, prefill_chunk=chunk)
        assert engine.generate(PROMPTS[1:4], params) == want, f"prefill_chunk={chunk}"
        assert_all_free(engine)


@pytest.mark.parametrize("chunk", [None, 5])
def test_churn_frees_every_slot_and_page(model, chunk):
    """Hundreds of random joins and aborts with a KV pool too small for every slot: requests wait
    for pages; finished ones still equal the greedy reference; nothing leaks."""
    rng = random.Random(chunk or 0)
    engine = engine_of(model, max_batch=4, kv_num_pages=14, max_seq_len=32, prefill_chunk=chunk)
    live: list[int] = []
    expected = {}
    for it in range(60):
        if rng.random() < 0.6:
            p = PROMPTS[rng.randrange(len(PROMPTS))]
            n = rng.randint(1, 4)
            rid = engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
            live.append(rid)
            expected[rid] = (p, n)
        if live and rng.random() < 0.3:
            engine.abort(live.pop(rng.randrange(len(live))))
        engine.step()
        engine.cache.kv.check()
        held = sum(len(engine.cache.kv.pages_of(r.slot)) for r in engine.running + engine.prefilling)
        assert held + engine.cache.kv.free_pages == 14
    while engine.has_unfinished():
        engine.step()
    done = engine.pop_finished()
    assert len(done) == len(expected)
    reasons = [r.finish_reason for r in done]
    assert "abort" in reasons and "length" in reasons and "error" not in reasons
    for r in done:
        if r.finish_reason == "length":
            p, n = expected[r.rid]
            assert r.output == greedy_reference(model, p, n)
    assert_all_free(engine)


def test_requests_that_can_never_fit_are_refused(model):
    engine = engine_of(model, max_batch=2, max_seq_len=16)
    with pytest.raises(ValueError, match=r"Engine.add_request: .*10 tokens.*max_new_tokens=8 needs 17 KV "
                                         r"positions.*16"):
        engine.add_request(list(range(10)), SamplingParams(max_new_tokens=8))
    engine.add_request(list(range(10)), SamplingParams(max_new_tokens=7))  # 16 positions: fits
    small_pool = engine_of(model, max_batch=2, max_seq_len=64, kv_num_pages=3)  # 12 tokens in all
    with pytest.raises(ValueError, match=r"prompts\[1\]: .*needs 13 KV positions.*3 pages of 4"):
        small_pool.generate([[1], list(range(10))], SamplingParams(max_new_tokens=4))
    assert not small_pool.has_unfinished()  # generate checks every request before queueing any


def test_bad_kv_options(model):
    with pytest.raises(ValueError, match="kv_page_size must be None or an int >= 1"):
        Engine(model, kv_page_size=0)
    with pytest.raises(ValueError, match="page_size.*power of two"):
        Engine(model, kv_page_size=6)
    with pytest.raises(ValueError, match="num_pages.*kv_budget_bytes.*not both"):
        Engine(model, kv_num_pages=8, kv_budget_bytes=1 << 20)
    attention_only = NemotronHLM(NemotronHConfig(d_model=64, vocab_size=256, pattern="*-", n_heads=4, n_kv_heads=2,
                                                 head_dim=16, intermediate_size=96))
    with pytest.raises(ValueError, match="speculate needs Mamba layers"):
        Engine(attention_only, speculate=2)
    mamba = fastmamba.load_model("mamba2-tiny", device="cpu")
    with pytest.raises(ValueError, match="max_seq_len, kv_page_size configure a paged KV cache.*Mamba2LM"):
        Engine(mamba, max_seq_len=128, kv_page_size=16)


def test_exhausted_pool_fails_the_newest_request_cleanly(model):
    """Two requests that together outgrow the pool: both decode until the pages run out, then the
    newer one is finished with a clear error and its pages freed; the older one finishes with the
    reference tokens."""
    engine = engine_of(model, max_batch=2, max_seq_len=24, kv_num_pages=6)  # 24 tokens in all
    a, b = PROMPTS[1][:5] + [1, 2, 3], PROMPTS[2][:8]  # 8 prompt tokens each: 2 pages each
    params = SamplingParams(max_new_tokens=14, ignore_eos=True)  # 8 + 13 = 21 positions each: fits alone
    ra, rb = engine.add_request(a, params), engine.add_request(b, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    req_a, req_b = engine.finished[ra], engine.finished[rb]
    assert req_a.finish_reason == "length" and req_a.output == greedy_reference(model, a, 14)
    assert req_b.finish_reason == "error" and isinstance(req_b.error, RuntimeError)
    assert "out of pages" in str(req_b.error) and f"request {rb}" in str(req_b.error)
    assert len(req_b.output) == 5  # 8 + 4 fed tokens = 12 each = all 6 pages; its 5th token never fed
    assert req_b.output == greedy_reference(model, b, 5)
    assert [o.rid for o in outs if o.finished] == [ra]  # like an abort, the failed one gets no StepOutput
    assert_all_free(engine)
    with pytest.raises(RuntimeError, match="out of pages"):  # generate does not return a partial output
        engine.generate([a, b], params)
    assert_all_free(engine)


def test_a_request_waits_for_a_page_while_others_advance(model):
    """One page left and two requests needing a new one: the older takes it and advances, the
    newer waits that step (no token, state untouched) and goes on once pages come back."""
    engine = engine_of(model, max_batch=3, max_seq_len=32, kv_num_pages=7)
    # c (4 tokens, ends after 1) keeps a page; a and b (4 tokens each) fill their pages exactly
    pa, pb, pc = PROMPTS[3][:4], PROMPTS[2][:4], PROMPTS[5][:4]
    ra = engine.add_request(pa, SamplingParams(max_new_tokens=9, ignore_eos=True))
    rb = engine.add_request(pb, SamplingParams(max_new_tokens=9, ignore_eos=True))
    rc = engine.add_request(pc, SamplingParams(max_new_tokens=6, ignore_eos=True))
    first = engine.step()  # prefill: 3 pages used, 4 free, reserve ok
    assert sorted(o.rid for o in first) == [ra, rb, rc]
    saw_wait = False
    while engine.has_unfinished():
        running = [r.rid for r in engine.running]
        outs = engine.step()
        if len(outs) < len(running):
            saw_wait = True
            assert {o.rid for o in outs} < set(running)
    assert saw_wait
    for rid, p, n in ((ra, pa, 9), (rb, pb, 9), (rc, pc, 6)):
        req = engine.finished[rid]
        assert req.finish_reason == "length" and req.output == greedy_reference(model, p, n)
    assert_all_free(engine)


def test_abort_and_failed_steps_free_pages(model, monkeypatch):
    engine = engine_of(model, max_batch=3)
    rids = [engine.add_request(p, SamplingParams(max_new_tokens=20, ignore_eos=True)) for p in PROMPTS[2:5]]
    engine.step()
    engine.step()
    assert engine.cache.kv.free_pages < engine.cache.kv.num_pages
    assert engine.abort(rids[0])
    engine.cache.kv.check()

    def broken(*args, **kwargs):
        raise RuntimeError("injected decode failure")

    monkeypatch.setattr(model, "decode", broken)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    monkeypatch.undo()
    assert [engine.finished[r].finish_reason for r in rids] == ["abort", "error", "error"]
    assert_all_free(engine)
    # the engine keeps serving, from clean pages
    assert engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0] == \
        greedy_reference(model, PROMPTS[1], 3)
    assert_all_free(engine)


def test_stop_conditions(model):
    p = PROMPTS[2]
    ref = greedy_reference(model, p, 6)
    engine = engine_of(model, max_batch=2)
    out = engine.generate([p], SamplingParams(max_new_tokens=6, stop_token_ids=(ref[2],), ignore_eos=True))[0]
    assert out == ref[:ref.index(ref[2]) + 1]
    assert engine.finished == {} and engine.cache.kv.free_pages == engine.cache.kv.num_pages


INTERPRETER_AT_START = interpreter_enabled()  # Triton reads TRITON_INTERPRET once, at import


@pytest.mark.skipif(not INTERPRETER_AT_START, reason="the decode kernels on a CPU need TRITON_INTERPRET=1 at import")
def test_rounding_seeds_reach_the_mamba_layers(monkeypatch):
    """With 16-bit SSM states and the engine's seeds (``StochasticRounding``), a hybrid's Mamba
    layers round stochastically: the same seed reproduces the states, another one changes them."""
    from fastmamba.generation.rounding import StochasticRounding

    m = random_init(NemotronHLM(CFG, device="cpu", dtype=torch.float32)).eval()

    def states(seed):
        cache = m.new_cache(2, max_seq_len=32, page_size=PAGE, ssm_dtype=torch.bfloat16)
        slot = cache.alloc(1)
        m.prefill(torch.tensor([PROMPTS[3]]), cache, slot)  # the references (the fixture's TRITON_INTERPRET=0)
        rounding = StochasticRounding(m.cfg.n_layer, torch.device("cpu"), seed)
        rounding.advance()
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the decode step's kernels, in the interpreter
        m.decode(torch.tensor([5]), cache, slot, rand_seed=rounding.seeds)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        return [s.clone() for s in cache.ssm]

    a, again, other = states(1), states(1), states(2)
    assert all(torch.equal(x, y) for x, y in zip(a, again))
    assert not any(torch.equal(x, y) for x, y in zip(a, other))


@pytest.mark.skipif(not INTERPRETER_AT_START, reason="the decode kernels on a CPU need TRITON_INTERPRET=1 at import")
def test_graph_steps_read_nothing_on_the_host(monkeypatch):
    """What the CUDA graphs capture (decode and verify with grow=False, commit with rollback=False,
    a pad row in the batch; the staged prefill with a pad request, a continued prompt among them)
    reads no tensor value on the host: the CPU stand-in for capture, with the ops' own checks off as
    they are while capturing (trusted_inputs) and every host read raising. The eager prefill, given
    the host's copies of cu_seqlens and slots, reads nothing either."""
    import contextlib

    from fastmamba.ops._common.host_values import trusted_inputs

    m = random_init(NemotronHLM(CFG, device="cpu", dtype=torch.float32)).eval()

    @contextlib.contextmanager
    def no_host_reads():
        names = ("tolist", "item", "__bool__", "__int__", "__float__")

        def boom(self, *args, **kwargs):
            raise AssertionError("a host read inside a graph step")

        with monkeypatch.context() as mp, trusted_inputs():
            mp.setenv("TRITON_INTERPRET", "1")
            for name in names:
                mp.setattr(torch.Tensor, name, boom)
            yield

    for speculate in (0, 2):
        cache = m.new_cache(4, max_seq_len=64, page_size=PAGE, speculate=speculate)
        live = cache.alloc(2)
        m.prefill_varlen(torch.tensor(PROMPTS[1] + PROMPTS[2]), torch.tensor([0, 5, 18]), cache, live)
        a, b = live.tolist()
        slots = torch.tensor([a, -1, b], dtype=torch.int32)
        ntok = speculate + 1
        cache.grow([a, b], [ntok, ntok])
        with no_host_reads():
            if speculate:
                out = m.verify(torch.ones(3, ntok, dtype=torch.long), cache, slots, grow=False)
                m.commit(cache, slots, torch.tensor([2, 1, 3], dtype=torch.int32), rollback=False)
            else:
                out = m.decode(torch.ones(3, dtype=torch.long), cache, slots, grow=False)
        assert out.shape[0] == 3 and bool(torch.isfinite(out).all())
        cache.kv.check()

    from fastmamba.models.nemotron_h import StagedPrefill
    from fastmamba.ops.attention import PrefillWork, prefill_work

    cache = m.new_cache(4, max_seq_len=64, page_size=PAGE)
    a, b = cache.take(2)
    with no_host_reads():  # eager, first chunks: the host's lists, one upload
        m.prefill_varlen(torch.tensor(PROMPTS[3]), torch.tensor([0, 9, 22]), cache, torch.tensor([a, b]),
                         cu_seqlens_host=[0, 9, 22], slots_host=[a, b])
    ctx = cache.grow([b, a], [4, 2])  # the staged call: the caller grew the cache (b continues, then a)
    bm = m.prefill_block_tokens()
    cu = [0, 4, 6, 8]  # b: 4 tokens, a: 2, a pad request of 2
    work = PrefillWork(torch.tensor(prefill_work(cu, bm, capacity=4)).view(-1, 2), bm)
    staged = StagedPrefill(torch.tensor([ctx[0] + i for i in range(4)] + [ctx[1], ctx[1] + 1, 0, 0]),
                           torch.tensor([0, 0, 0, 0, 1, 1, 2, 2]), torch.tensor(ctx + [0]), work)
    with no_host_reads():
        out = m.prefill_varlen(torch.ones(8, dtype=torch.long), torch.tensor(cu), cache,
                               torch.tensor([b, a, -1], dtype=torch.int32), torch.tensor([True, True, False]),
                               cu_seqlens_host=cu, slots_host=[b, a, -1], staged=staged)
    assert out.shape[0] == 3 and bool(torch.isfinite(out).all())
    cache.kv.check()


@pytest.mark.gpu
def test_graphed_decode_equals_eager_on_gpu():
    """GraphedDecoder over a HybridCache (grown on the host before each replay, static block table
    and lengths; pad rows in the bucket) gives the eager decode's logits; the engine's tokens with
    graphs equal those without."""
    from fastmamba.generation.cuda_graphs import GraphedDecoder

    m = random_init(NemotronHLM(CFG, device="cuda", dtype=torch.float32)).eval()
    prompts = [torch.tensor(p, device="cuda") for p in PROMPTS[1:4]]
    caches, slots = [], []
    for _ in range(2):
        cache = m.new_cache(8, max_seq_len=64, page_size=PAGE)
        s = cache.alloc(3)
        cu = torch.tensor([0, 5, 18, 40], dtype=torch.int32, device="cuda")
        m.prefill_varlen(torch.cat(prompts), cu, cache, s)
        caches.append(cache)
        slots.append(s)
    graphed = GraphedDecoder(m, caches[1], 8)
    tok = torch.tensor([3, 77, 140], device="cuda")
    for step in range(12):  # buckets 4 (one pad row); pages crossed every 4 tokens
        want = m.decode(tok, caches[0], slots[0])
        caches[1].grow(slots[1].tolist(), [1, 1, 1])
        got = graphed.decode(tok, slots[1])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        tok = want.argmax(-1)
    caches[1].kv.check()
    prm = SamplingParams(max_new_tokens=8, ignore_eos=True)
    eager = engine_of(m, max_batch=4, cuda_graphs=False).generate(PROMPTS, prm)
    graphs = engine_of(m, max_batch=4, cuda_graphs=True)
    assert graphs.decoder is not None and graphs.prefiller is not None
    assert graphs.generate(PROMPTS, prm) == eager
    assert graphs.prefiller.captured.count > 0  # the prompts' prefills replayed from graphs


@pytest.mark.gpu
def test_8b_preset_through_the_engine_on_gpu():
    """nemotron-h-8b (bf16, random weights): the engine's graphed decode gives the eager decode's
    first tokens' logits (bf16 tolerance), generates with continuous batching, frees every page."""
    from fastmamba.models.nemotron_h import load_nemotron_h

    check_preset_engine_on_gpu(load_nemotron_h("nemotron-h-8b", device="cuda"))


def check_preset_engine_on_gpu(m) -> None:
    """A full-size bf16 hybrid on a GPU: the engine generates with continuous batching and CUDA
    graphs over three prompts (two slots) and frees every page; one decode step replayed from a
    graph gives the eager step's logits from identical caches (bf16 tolerance)."""
    from fastmamba.generation.cuda_graphs import GraphedDecoder

    prompts = [list(range(100, 100 + n)) for n in (17, 130, 64)]
    engine = Engine(m, max_batch=2, max_seq_len=256)
    assert engine.decoder is not None
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [len(o) for o in outs] == [8, 8, 8]
    assert_all_free(engine)
    caches = [m.new_cache(4, max_seq_len=256) for _ in range(2)]
    ids = torch.tensor(prompts[1], device="cuda")
    slots = [c.alloc(1) for c in caches]
    for c, s in zip(caches, slots):
        m.prefill(ids[None], c, s)
    tok = torch.tensor([7], device="cuda")
    want = m.decode(tok, caches[0], slots[0])
    caches[1].grow(slots[1].tolist(), [1])
    got = GraphedDecoder(m, caches[1], 4).decode(tok, slots[1])
    torch.testing.assert_close(got, want, atol=5e-2, rtol=1e-2)  # bf16 through every layer
