"""MTP speculative decoding (fastmamba.generation.mtp_drafter, fastmamba.models.mtp): the MTP
block equals a plain-PyTorch reference written here (rows of several requests, K/V context of its
own); the drafter's drafts of a request's first step equal the reference run over every prompt
position (prompts prefilled whole or in chunks; after a prefix-cache hit, over the fed positions
only), then chained on its own hidden state; greedy speculative decoding with drafter="mtp"
emits plain greedy's tokens (fp32) with requests of different lengths in one batch, chunked
prefill and prefix-cache hits; aborting a request mid-speculation frees its slot, its K/V pages
and the MTP's pages; the same through the serving loop (in-process app); the speculation
policy's decisions on synthetic costs.

The ops run their PyTorch references (TRITON_INTERPRET=0 for these tests), as the other engine
tests over MoE hybrids do; the kernels have their own tests."""
from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from fastmamba.cache.kv_pages import KVPages
from fastmamba.generation.engine import Engine
from fastmamba.generation.mtp_drafter import MTPDrafter
from fastmamba.generation.sampling import SamplingParams
from fastmamba.generation.spec_policy import SpeculationPolicy, expected_tokens_per_step
from fastmamba.models.nemotron_h import PRESETS, NemotronHLM, random_init
from tests.helpers import tol

FP32 = tol(torch.float32)
CFG = PRESETS["nemotron-3-tiny-mtp"]
PAGE = 4
BOOST = 5  # a token the target and the MTP both favour now and then: drafts get accepted (see build_model)


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def build_model() -> NemotronHLM:
    """The tiny MoE hybrid with an MTP layer (fp32, CPU): larger mixer weights and routers than the
    preset's (every layer and each token's choice of experts moves the logits, the MTP's too), and
    an lm_head row that follows the hidden state's mean, so that target and MTP agree on token
    BOOST often enough for drafts to be accepted (else every run would test rejection only)."""
    m = random_init(NemotronHLM(CFG, device="cpu", dtype=torch.float32), seed=3).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for blocks in (m.backbone.layers, m.mtp.layers):
            for block in blocks:
                for name, p in block.mixer.named_parameters():
                    if name == "gate.weight":
                        p.normal_(0.0, 0.5, generator=g)
                    elif p.dim() >= 2:
                        p.mul_(3)
        m.mtp.layers[0].eh_proj.weight.mul_(3)
        m.lm_head.weight[BOOST] = 0.6
    return m


@pytest.fixture(scope="module")
def model():
    return build_model()


# -- the reference ----------------------------------------------------------------------------------

def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def relu2(x):
    return torch.relu(x).square()


def moe_ref(moe, x):
    """One token x [M] through a MoE layer: sigmoid router, top-k by score + bias (one group),
    renormalised weights times the scaling factor, relu² experts, plus the shared expert."""
    c = moe.cfg
    scores = torch.sigmoid(moe.gate.weight @ x)
    ids = torch.topk(scores + moe.gate.e_score_correction_bias, c.top_k).indices
    w = scores[ids]
    if c.norm_topk_prob:
        w = w / w.sum()
    w = w * c.routed_scaling_factor
    y = sum(w[j] * (moe.experts.down_proj[e] @ relu2(moe.experts.up_proj[e] @ x)) for j, e in enumerate(ids.tolist()))
    sh = moe.shared_experts
    return y + sh.down_proj.weight @ relu2(sh.up_proj.weight @ x)


def mtp_ref(model, token: int, h: torch.Tensor, ctx: list) -> torch.Tensor:
    """One MTP step of one request: token and the hidden h [M] before it -> the MTP's hidden [M];
    ``ctx`` (the request's earlier (k, v) [Hkv, Dh], in position order) gains this token's."""
    mtp, eps = model.mtp, model.cfg.norm_eps
    L0, L1 = mtp.layers
    att = L0.mixer
    e = model.backbone.embeddings.weight[token]
    x = L0.eh_proj.weight @ torch.cat([rms(e, L0.enorm.weight, eps), rms(h, L0.hnorm.weight, eps)])
    n = rms(x, L0.norm.weight, eps)
    Hq, Hkv, Dh = att.n_heads, att.n_kv_heads, att.head_dim
    q = (att.q_proj.weight @ n).view(Hq, Dh)
    ctx.append(((att.k_proj.weight @ n).view(Hkv, Dh), (att.v_proj.weight @ n).view(Hkv, Dh)))
    K = torch.stack([k for k, _ in ctx])  # [S, Hkv, Dh]
    V = torch.stack([v for _, v in ctx])
    heads = []
    for hq in range(Hq):
        g = hq // (Hq // Hkv)
        p = torch.softmax(K[:, g] @ q[hq] / Dh ** 0.5, dim=0)
        heads.append(p @ V[:, g])
    res = x + att.o_proj.weight @ torch.cat(heads)
    res = res + moe_ref(L1.mixer, rms(res, L1.norm.weight, eps))
    return rms(res, L1.final_layernorm.weight, eps)


def target_hidden(model, ids: list[int]) -> torch.Tensor:
    """The target's final-normed hidden states at every position of ``ids`` (a full forward, no cache) [L, M]."""
    model.keep_hidden = True
    model(torch.tensor([ids], device=model.backbone.embeddings.weight.device))
    return model.last_hidden[0].clone()


def ref_first_drafts(model, prompt: list[int], first: int, k: int, start: int = 0) -> list[int]:
    """The reference's k drafts after a prefill: the MTP run over prompt positions start..L-1 (position
    t: the token after it, prompt[t+1] or the first sampled token ``first`` for the last, and the
    target's hidden state h_t; causal over its own K/V), its last position's output giving draft 1,
    then drafts 2..k chained on its own hidden state and context."""
    hs, ctx = target_hidden(model, prompt), []
    nxt = prompt[1:] + [first]
    for t in range(start, len(prompt)):
        h = mtp_ref(model, nxt[t], hs[t], ctx)
    want = []
    for _ in range(k):
        tok = int((model.lm_head.weight @ h).argmax())
        want.append(tok)
        h = mtp_ref(model, tok, h, ctx)
    return want


class AlwaysK(SpeculationPolicy):
    """K drafts every step (the MTP drafter's default policy would weigh costs and acceptance)."""

    def choose(self, batch: int) -> int:
        super().choose(batch)
        return self.max_k


def first_drafts(engine) -> dict:
    """Spies on the engine's drafter: rid -> (its first token, its first call's drafts)."""
    d, seen = engine.drafter, {}
    propose = d.propose_device

    def spy(reqs, k):
        counts = d.draft_counts(reqs, k)
        drafts = propose(reqs, k)
        for r, c, row in zip(reqs, counts, drafts.tolist()):
            if c and r.rid not in seen:
                seen[r.rid] = (r.output[0], row[:c])
        return drafts

    d.propose_device = spy
    return seen


def test_block_equals_reference(model):
    """Rows of three requests in one call (two with two catch-up tokens each, positions after a
    context already in the pool), then a second call: hidden states equal the reference's."""
    pages = KVPages(1, 16, 4, 4, page_size=PAGE, n_kv_heads=CFG.n_kv_heads, head_dim=CFG.head_dim, device="cpu",
                    dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    rows, lens = [2, 0, 3], [2, 1, 2]
    ctx = {r: [] for r in rows}
    base = pages.grow(rows, lens)
    for step in range(2):
        toks = torch.randint(0, CFG.vocab_size, (sum(lens),), generator=g)
        hid = torch.randn(sum(lens), CFG.d_model, generator=g)
        row_of = torch.tensor([r for r, n in zip(rows, lens) for _ in range(n)], dtype=torch.int32)
        pos = torch.tensor([b + j for b, n in zip(base, lens) for j in range(n)])
        out = torch.full_like(hid, float("nan"))
        with torch.no_grad():
            out[:] = model.mtp.forward_rows(model.backbone.embeddings(toks), hid, pages, row_of, pos)
        want = torch.stack([mtp_ref(model, int(t), hh, ctx[int(r)]) for t, hh, r in zip(toks, hid, row_of)])
        torch.testing.assert_close(out, want, **FP32)
        base = pages.grow(rows, [1, 1, 1])
        lens = [1, 1, 1]


def test_pad_rows_touch_nothing(model):
    """Rows of pool row -1 (the CUDA-graph buckets' padding) leave the live rows' outputs and every
    real page as they are without them."""
    g = torch.Generator().manual_seed(2)
    toks = torch.randint(0, CFG.vocab_size, (3,), generator=g)
    hid = torch.randn(3, CFG.d_model, generator=g)
    outs, pools = [], []
    for pad in (0, 2):
        pages = KVPages(1, 8, 2, 4, page_size=PAGE, n_kv_heads=CFG.n_kv_heads, head_dim=CFG.head_dim, device="cpu",
                        dtype=torch.float32)
        pages.grow([0, 1], [2, 1])
        rows = torch.tensor([0, 0, 1] + [-1] * pad, dtype=torch.int32)
        pos = torch.tensor([0, 1, 0] + [0] * pad)
        t = torch.cat([toks, torch.zeros(pad, dtype=torch.int64)])
        h = torch.cat([hid, torch.zeros(pad, CFG.d_model)])
        with torch.no_grad():
            outs.append(model.mtp.forward_rows(model.backbone.embeddings(t), h, pages, rows, pos)[:3])
        pools.append((pages.k[0][:-1].clone(), pages.v[0][:-1].clone()))  # the last page is the scratch page
    torch.testing.assert_close(outs[1], outs[0], **FP32)
    # (close, not equal: the projections of 3 and 5 rows may round differently in their last bits)
    torch.testing.assert_close(pools[1], pools[0], **FP32)
    assert torch.equal(pools[1][0] == 0, pools[0][0] == 0)  # the same entries written, no others


@pytest.mark.parametrize("chunk,rows", [(None, 512), (None, 2), (3, 512)],
                         ids=["whole", "whole-pieces-of-2", "chunks-of-3"])
def test_first_drafts_equal_reference(model, chunk, rows):
    """After a prompt's prefill (whole, whole with the MTP's prompt pass in pieces of 2 rows, or in
    chunks of 3 tokens), the drafter's k=3 drafts equal the reference's: the MTP run over every
    prompt position (position t with token t+1, the last with the first emitted token; causal over
    its own K/V), then drafts 2-3 chained; three requests of different lengths in the batch."""
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
    engine = Engine(model, max_batch=3, speculate=3, drafter="mtp", cuda_graphs=False, kv_page_size=PAGE,
                    max_seq_len=64, spec_policy=AlwaysK(3), prefill_chunk=chunk)
    engine.drafter.prompt_rows = rows
    seen = first_drafts(engine)
    rids = [engine.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert sorted(seen) == sorted(rids)
    for rid, p in zip(rids, prompts):
        first, drafts = seen[rid]
        assert drafts == ref_first_drafts(model, p, first, 3), (rid, chunk)
    assert engine.drafter.stats["prompt_rows"] == sum(len(p) - 1 for p in prompts)
    assert engine.drafter.tracked == 0 and engine.drafter.pages_in_use == 0


def test_first_drafts_after_a_prefix_cache_hit(model):
    """A prompt whose first 16 tokens come from the prefix cache: the MTP's context is the fed
    positions 16..L-1 only (the cached ones have no hidden states), as the module docstring says:
    its first drafts are the reference's over those positions, not over the whole prompt."""
    prompt = PROMPTS[3][:20]
    engine = Engine(model, max_batch=2, speculate=3, drafter="mtp", cuda_graphs=False, kv_page_size=PAGE,
                    max_seq_len=64, spec_policy=AlwaysK(3), prefix_cache_entries=8, prefix_block=16)
    seen = first_drafts(engine)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    a = engine.generate([prompt], [params])
    rows = engine.drafter.stats["prompt_rows"]
    rid = engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    P = engine.prefix_stats["hit_tokens"]
    assert P == 16  # the one block-aligned prefix the first run saved
    assert engine.drafter.stats["prompt_rows"] - rows == len(prompt) - 1 - P
    first, drafts = seen[rid]
    assert len(drafts) == 3
    assert drafts == ref_first_drafts(model, prompt, first, 3, start=P)
    assert drafts != ref_first_drafts(model, prompt, first, 3)  # the whole prompt's context drafts otherwise
    assert engine.pop_finished(rid).output == a[0]


def greedy(model, prompts, n, **kw):
    engine = Engine(model, cuda_graphs=False, kv_page_size=PAGE, max_seq_len=64, **kw)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in n]
    return engine.generate(prompts, params), engine


G = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(0, 256, (n,), generator=G).tolist() for n in (1, 5, 13, 22, 3, 9)]
N_NEW = [9, 4, 12, 7, 10, 5]


@pytest.fixture(scope="module")
def plain(model):
    return greedy(model, PROMPTS, N_NEW, max_batch=4)[0]


@pytest.mark.parametrize("kw", [
    dict(speculate=3),
    dict(speculate=1),
    dict(speculate=4, prefill_chunk=6),
    dict(speculate=3, verify_path="legacy"),
    dict(speculate=3, spec_policy="adaptive"),
], ids=["K3", "K1", "K4-chunked-prefill", "K3-legacy", "K3-adaptive-policy"])
def test_greedy_equals_plain(model, plain, kw):
    """Six requests of 1..22 tokens, four slots (requests join as others leave), pages of 4."""
    kw.setdefault("spec_policy", None)
    out, engine = greedy(model, PROMPTS, N_NEW, max_batch=4, drafter="mtp", **kw)
    assert out == plain
    assert engine.stats["drafts_proposed"] > 0
    assert engine.stats["drafts_accepted"] > 0  # accepted runs, not only rejections
    assert engine.drafter.tracked == 0 and engine.drafter.pages_in_use == 0
    assert engine.cache.kv.free_pages == engine.cache.kv.num_pages
    if kw["spec_policy"] == "adaptive":
        assert set(engine.stats["policy"]["chosen"]) == {0, 1, 2, 3}


def test_prefix_cache_hits_keep_tokens(model, plain):
    """A second round of the same prompts hits the prefix cache (their first 16 tokens): same tokens."""
    engine = Engine(model, cuda_graphs=False, kv_page_size=PAGE, max_seq_len=64, max_batch=4, speculate=3,
                    drafter="mtp", spec_policy=None, prefix_cache_entries=16, prefix_block=16)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in N_NEW]
    assert engine.generate(PROMPTS, params) == plain
    assert engine.generate(PROMPTS, params) == plain
    assert engine.prefix_stats["hits"] >= 1
    assert engine.drafter.pages_in_use == 0


def test_abort_mid_speculation_frees_everything(model):
    engine = Engine(model, cuda_graphs=False, kv_page_size=PAGE, max_seq_len=64, max_batch=3, speculate=3,
                    drafter="mtp", spec_policy=None)
    rids = [engine.add_request(p, SamplingParams(max_new_tokens=30, ignore_eos=True)) for p in PROMPTS[:3]]
    for _ in range(3):  # prefill, then two verify steps: the MTP holds context for every request
        engine.step()
    assert engine.drafter.tracked == 3 and engine.drafter.pages_in_use > 0
    assert engine.abort(rids[1])
    assert engine.drafter.tracked == 2
    engine.step()
    for rid in (rids[0], rids[2]):
        engine.abort(rid)
    assert not engine.has_unfinished()
    assert engine.cache.free_slots == engine.max_batch
    assert engine.cache.kv.free_pages == engine.cache.kv.num_pages
    engine.cache.kv.check()
    assert engine.drafter.tracked == 0 and engine.drafter.pages_in_use == 0
    engine.drafter.pages.check()


class HostReads(torch.overrides.TorchFunctionMode):
    """Logs every read of a tensor's values on the host (``tolist``, ``item``, ``bool``, ``int``,
    ``float``, an index, ``cpu``, ``numpy``) with the fastmamba module that made it (the innermost
    fastmamba frame), between the marks that ``mark`` adds."""

    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}

    def __init__(self):
        super().__init__()
        self.log: list[tuple[str, str]] = []

    def mark(self, what: str) -> None:
        self.log.append(("mark", what))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            import traceback

            site = next((f.filename for f in reversed(traceback.extract_stack())
                         if "/fastmamba/" in f.filename and "/tests/" not in f.filename), "?")
            self.log.append(("read", site.split("/fastmamba/", 1)[-1] + f" ({func.__name__})"))
        return func(*args, **(kwargs or {}))

    def windows(self, start: str, end: str) -> list[list[str]]:
        """The reads between each ``start`` mark and the next ``end`` mark."""
        out, cur = [], None
        for kind, what in self.log:
            if kind == "mark" and what == start:
                cur = []
            elif kind == "mark" and what == end and cur is not None:
                out.append(cur)
                cur = None
            elif kind == "read" and cur is not None:
                cur.append(what)
        return out


def spy_on(obj, name: str, before: Callable | None = None, after: Callable | None = None) -> None:
    f = getattr(obj, name)

    def wrapped(*a, **kw):
        if before:
            before()
        out = f(*a, **kw)
        if after:
            after()
        return out

    setattr(obj, name, wrapped)


def test_no_host_read_between_draft_and_verify(model):
    """The MTP path reads nothing back between the drafter's call and the verify call (the drafts
    stay on the device; ``Speculator.device_inputs``), and one transfer after the verify decides
    acceptance (the drafts, the target's tokens and the sampled row's draws together). Reads made
    by the ops (fastmamba/ops: their CPU references, kernels on a GPU, where the gpu-marked test
    checks the same window under ``torch.cuda.set_sync_debug_mode("error")``) are left out."""
    engine = Engine(model, cuda_graphs=False, kv_page_size=PAGE, max_seq_len=64, max_batch=3, speculate=3,
                    drafter="mtp", spec_policy=None)
    reads = HostReads()
    for name in ("propose", "propose_device"):  # whichever the engine calls
        if hasattr(engine.drafter, name):
            spy_on(engine.drafter, name, before=lambda: reads.mark("draft"))
    spy_on(engine.spec, "verify", before=lambda: reads.mark("verify"), after=lambda: reads.mark("verified"))
    spy_on(engine.spec, "commit", before=lambda: reads.mark("commit"))
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True),
              SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8, seed=5),
              SamplingParams(max_new_tokens=12, ignore_eos=True)]
    for p, sp in zip(PROMPTS[:3], params):
        engine.add_request(p, sp)
    engine.step()  # prefill
    with reads:
        for _ in range(3):
            engine.step()
    drafted = reads.windows("draft", "verify")
    assert len(drafted) == 3  # every step drafted
    outside_ops = [[w for w in win if not w.startswith("ops/")] for win in drafted]
    assert outside_ops == [[]] * 3
    accepted = [[w for w in win if not w.startswith("ops/")] for win in reads.windows("verified", "commit")]
    assert accepted == [["generation/speculative.py (tolist)"]] * 3
    assert engine.stats["drafts_proposed"] >= 3 * 3  # (the MTP's default policy picks k per step)


def test_device_drafts_and_padding(model):
    """``propose_device`` gives the host lists' drafts as int64 [B, k] on the device, a row of
    zeros for a request with nothing observed (``draft_counts`` 0) among others; the verify inputs
    built from device drafts (``Speculator.device_inputs``) pad each row as the host lists are
    padded: the last real draft, or the last token where there is none."""
    from types import SimpleNamespace

    from fastmamba.generation.speculative import Speculator

    g = torch.Generator().manual_seed(6)
    hid = torch.randn(3, 2, CFG.d_model, generator=g)
    got = {}
    for form in ("host", "device"):
        d = MTPDrafter(model, 3, max_seq_len=64)
        reqs = [_Req([1, 2], [7, 3], 2), _Req([4], [9], 0), _Req([5, 5, 5], [11, 2], 1)]
        d.observe([reqs[0], reqs[2]], hid[[0, 2]], [2, 1])
        assert d.draft_counts(reqs, 3) == [3, 0, 3]
        if form == "host":
            got[form] = d.propose(reqs, 3)
        else:
            out = d.propose_device(reqs, 3)
            assert out.dtype == torch.int64 and tuple(out.shape) == (3, 3) and out.device == d.device
            got[form] = out.tolist()
        assert d.draft_counts(reqs, 3) == [0, 0, 0] and d.pages.length(2) == 2 and d.pages.length(1) == 1
    assert got["host"][1] == [] and got["device"][1] == [0, 0, 0]
    assert [got["device"][0], got["device"][2]] == [got["host"][0], got["host"][2]]

    class Fixed:  # a device drafter with fixed drafts
        def propose_device(self, reqs, k):
            return torch.tensor([[21, 22, 23], [31, 32, 33], [41, 42, 43]])

    spec = SimpleNamespace(K=4, device=torch.device("cpu"), drafter=Fixed())
    reqs = [_Req([0], [5], 0), _Req([0], [6], 1), _Req([0], [7], 2)]
    tokens = Speculator.device_inputs(spec, reqs, 3, [2, 0, 3])
    want = [[last] + d + [(d or [last])[-1]] * (4 - len(d)) for last, d in ((5, [21, 22]), (6, []), (7, [41, 42, 43]))]
    assert tokens.tolist() == want
    with pytest.raises(ValueError, match=r"propose_device must return int64 \[3, 2\]"):
        Speculator.device_inputs(spec, reqs, 2, [2, 0, 2])


class _EagerGraph:
    """Stands in for a captured CUDA graph on the CPU: a replay runs the captured function again on
    the static buffers as they are now and writes its result into the first run's output tensor."""

    def __init__(self, run):
        self.run, self.out, self.replays = run, run(), 0

    def replay(self):
        self.out.copy_(self.run())
        self.replays += 1


def test_graphed_drafts_equal_eager_on_cpu(model, monkeypatch):
    """The graphed draft's bookkeeping, on the CPU with an eager stand-in for the graph: one graph
    per (catch-up row bucket, request bucket, k), its static buffers filled and padded per call
    (3 catch-up rows in a bucket of 4, a request with nothing observed among three, a bucket of
    requests reused with other rows), give the eager drafter's drafts, step after step."""
    from fastmamba.generation import mtp_drafter

    monkeypatch.setattr(mtp_drafter, "_record", lambda run, pool: (g := _EagerGraph(run), g.out))
    monkeypatch.setattr(mtp_drafter, "warm_up_padded", lambda run, rows: None)
    g = torch.Generator().manual_seed(8)
    hid = torch.randn(3, 2, CFG.d_model, generator=g)
    got = {}
    for graphed in (False, True):
        d = MTPDrafter(model, 3, max_seq_len=64)
        if graphed:
            d.graphs, d.pool = {}, None
        reqs = [_Req([1, 2], [7, 3], 2), _Req([4], [9], 0), _Req([5, 5, 5], [11, 2], 1)]
        steps = []
        d.observe([reqs[0], reqs[2]], hid[[0, 2]], [2, 1])  # 3 rows, 2 of 3 requests draft
        steps.append(d.propose_device(reqs, 3).tolist())
        for r, x in zip(reqs, steps[-1]):
            r.output += x[:1]
        d.observe(reqs, hid[:, :1], [1, 1, 1])  # 3 rows, 3 requests: the same graph's bucket
        steps.append(d.propose_device(reqs, 3).tolist())
        for r, x in zip(reqs, steps[-1]):
            r.output += x[:2]
        d.observe(reqs, hid, [2, 2, 2])  # 6 rows: a bucket of 8
        steps.append(d.propose_device(reqs, 2).tolist())
        got[graphed] = steps
        if graphed:
            assert sorted(d.graphs) == [(4, 2, 3), (4, 4, 3), (8, 4, 2)]
            assert all(st["graph"].replays == 1 for st in d.graphs.values())
    assert got[True] == got[False]
    assert got[False][0][1] == [0, 0, 0] and got[False][1][1] != [0, 0, 0]


def test_through_the_server(model, plain):
    """The serving loop (``create_app`` around an engine with drafter="mtp", in-process): concurrent
    greedy completions of different lengths equal plain greedy's tokens; an aborted stream frees its
    slot and every page, the MTP's included."""
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from fastmamba.serve.app import create_app

    engine = Engine(model, cuda_graphs=False, kv_page_size=PAGE, max_seq_len=64, max_batch=4, speculate=3,
                    drafter="mtp", spec_policy=None)
    app = create_app(engine, model_name="tiny", shutdown_timeout=0.5)
    with TestClient(app) as client:
        def complete(i):
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPTS[i], "max_tokens": N_NEW[i],
                                                     "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(complete, range(len(PROMPTS))))
        assert got == plain
        with client.stream("POST", "/v1/completions", json={"prompt": PROMPTS[3], "max_tokens": 30, "stream": True,
                                                            "ignore_eos": True}) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    break  # hang up mid-generation
        deadline = time.time() + 20
        while engine.has_unfinished() and time.time() < deadline:
            time.sleep(0.01)
        assert not engine.has_unfinished() and engine.cache.free_slots == engine.max_batch
        assert engine.cache.kv.free_pages == engine.cache.kv.num_pages
        assert engine.drafter.tracked == 0 and engine.drafter.pages_in_use == 0
    assert engine.stats["drafts_proposed"] > 0


def test_catch_up_keeps_the_newest_positions(model):
    """While speculation is off (plain steps, one position each) a request's pending positions stop
    at max_catch_up: the next catch-up runs the newest ones only (positions after the MTP's context)."""
    d = MTPDrafter(model, 1, max_seq_len=64, max_catch_up=4)
    r = _Req([1, 2], [3], 0)
    g = torch.Generator().manual_seed(4)
    hs = [torch.randn(1, 1, CFG.d_model, generator=g) for _ in range(6)]
    d.observe([r], hs[0], [1])
    for h in hs[1:]:
        r.output.append(int(h[0, 0, 0] > 0))
        d.observe([r], h, [1])
    assert d.propose([r], 2) and d.stats["rows"] == 4 + 1
    assert d.pages.length(0) == 4  # the catch-up's positions stay, the second draft's went
    ctx, h, want = [], None, None
    for tok, hid in zip(r.output[-4:], hs[-4:]):
        h = mtp_ref(model, tok, hid[0, 0], ctx)
        want = int((model.lm_head.weight @ h).argmax())
    d2 = MTPDrafter(model, 1, max_seq_len=64, max_catch_up=4)
    d2.observe([r], torch.cat(hs[-4:], dim=1), [4])
    assert d2.propose([r], 1) == [[want]]


def test_cli_generate_drafter_mtp(capsys):
    """``fastmamba generate --speculate 3 --drafter mtp`` prints plain generation's tokens and the
    speculation summary; a preset without an MTP layer is a one-line error."""
    from fastmamba import cli

    argv = ["generate", "--model", "nemotron-3-tiny-mtp", "--prompt-ids", "1,2,3,4", "--max-new-tokens", "10",
            "--ignore-eos"]
    assert cli.main(argv) == 0
    plain = capsys.readouterr().out.splitlines()[0]
    assert cli.main(argv + ["--speculate", "3", "--drafter", "mtp"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == plain and "speculate K=3 (mtp)" in out + err
    assert cli.main(["generate", "--model", "nemotron-3-tiny", "--prompt-ids", "1,2", "--speculate", "2",
                     "--drafter", "mtp"]) == 2
    err = capsys.readouterr().err
    assert "fastmamba: error: drafter='mtp': NemotronHLM has no multi-token-prediction layer" in err
    assert "Traceback" not in err


def test_drafter_errors(model):
    with pytest.raises(ValueError, match="max_batch must be an int >= 1"):
        MTPDrafter(model, 0)
    with pytest.raises(ValueError, match="max_catch_up must be an int >= 1"):
        MTPDrafter(model, 2, max_catch_up=0)
    d = MTPDrafter(model, 2)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        d.propose([], 0)
    with pytest.raises(ValueError, match="drafter expected a Drafter object or 'mtp'"):
        Engine(model, max_batch=2, speculate=2, drafter="ngram", cuda_graphs=False)
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device"):
        MTPDrafter(model, 2, cuda_graphs=True)
    with pytest.raises(ValueError, match="prompt_rows must be an int >= 1"):
        MTPDrafter(model, 2, prompt_rows=0)
    r = _Req([1, 2, 3], [], 0)
    r.prefilled = 3
    with pytest.raises(ValueError, match=r"lengths summing to 3 and hidden of shape \(2, "):
        d.observe_prompt([r], torch.zeros(2, CFG.d_model), [3])
    with pytest.raises(ValueError, match="a completed prompt needs its first sampled token"):
        d.observe_prompt([r], torch.zeros(3, CFG.d_model), [3])
    r.prefilled = 2
    with pytest.raises(ValueError, match="3 positions ending at prefilled=2 of a 3-token prompt"):
        d.observe_prompt([r], torch.zeros(3, CFG.d_model), [3])
    assert d.tracked == 0 and d.pages_in_use == 0  # nothing kept from the refused calls


# -- the speculation policy -------------------------------------------------------------------------

def linear_costs(plain: float, draft: float, verify_token: float):
    """Synthetic step seconds: a plain step, k drafts at ``draft`` each, a verify of K+1 tokens at
    ``verify_token`` per token and request above the plain step (T = K+1 = 8 verified always)."""
    def cost(batch, k):
        return plain * (1 + batch / 64) if k == 0 else plain * (1 + batch / 64) + k * draft + 7 * verify_token * batch
    return cost


def test_policy_speculates_where_it_pays():
    """Batch 1, high acceptance, cheap drafts: k = K; the choice is the argmax of tokens per second."""
    cost = linear_costs(plain=1.0, draft=0.05, verify_token=0.02)
    pol = SpeculationPolicy(7, cost=cost, prior_accept=0.8)
    assert pol.choose(1) == 7
    rate = {k: expected_tokens_per_step(k + 1, 0.8) / cost(1, k) for k in range(8)}
    assert max(rate, key=rate.get) == 7
    assert pol.report()["last"] == {"batch": 1, "k": 7, "why": "best", "accept_rate": 0.8}


def test_policy_switches_off_at_high_concurrency_and_low_acceptance():
    cost = linear_costs(plain=1.0, draft=0.05, verify_token=0.02)
    pol = SpeculationPolicy(7, cost=cost, prior_accept=0.8, probe_every=1000)
    assert pol.choose(256) == 0  # the verify's per-request cost dominates at batch 256
    pol = SpeculationPolicy(7, cost=cost, prior_accept=0.8, probe_every=1000)
    for _ in range(30):  # acceptance seen falls to ~0.1: off at batch 8 too
        pol.record(8, 7, 1.0, proposed=56, accepted=6)
    assert pol.accept_rate < 0.15
    assert pol.choose(8) == 0
    assert pol.choose(1) in (0, 1)  # at most a short draft where acceptance is this low


def test_policy_probes_and_switches_back_on():
    cost = linear_costs(plain=1.0, draft=0.05, verify_token=0.02)
    pol = SpeculationPolicy(7, cost=cost, prior_accept=0.05, probe_every=4)
    picks = [pol.choose(4) for _ in range(4)]
    assert picks == [0, 0, 0, 7]  # the 4th plain step in a row probes with K drafts
    assert pol.report()["last"]["why"] == "probe"
    for _ in range(20):  # the probes find high acceptance: on again
        pol.record(4, 7, 1.0, proposed=28, accepted=26)
    assert pol.choose(4) > 0


def test_policy_measures_when_given_no_costs():
    pol = SpeculationPolicy(2)
    picks = []
    # every k is timed twice at the bucket (batch 3 -> 4) before weighing; the first time (a warm-up,
    # graph captures) is dropped
    for secs in (30.0, 3.0, 20.0, 2.0, 10.0, 1.0):
        picks.append(pol.choose(3))
        pol.record(3, picks[-1], secs, proposed=3 * picks[-1], accepted=0)
    assert picks == [2, 2, 1, 1, 0, 0]
    assert pol.report()["chosen"] == {0: 2, 1: 2, 2: 2}
    assert pol.step_cost(4, 0) == 1.0 and pol.step_cost(3, 2) == 3.0
    pol.record(3, 0, 2.0, proposed=0, accepted=0)  # then a moving average
    assert pol.step_cost(3, 0) == pytest.approx(1.0 + pol.ema * (2.0 - 1.0))
    assert pol.choose(3) == 0  # nothing accepted: drafting only costs
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        pol.choose(0)
    with pytest.raises(ValueError, match="max_k must be an int >= 1"):
        SpeculationPolicy(0)


def test_the_drafter_is_handed_the_targets_hidden_states():
    """CPU (fp32, references): after every verify step the drafter observes the target's hidden states
    at the positions the step consumed, as a full forward computes them (the GPU test checks the same
    through CUDA graphs); with requests joining and leaving (max_batch 3 < 6 prompts)."""
    m = build_model()
    engine = Engine(m, cuda_graphs=False, kv_page_size=PAGE, max_seq_len=64, max_batch=3, speculate=3,
                    drafter="mtp", spec_policy=None)
    seen = recorded_observations(engine)
    want, _ = greedy_on(m, PROMPTS, N_NEW, max_batch=3, cuda_graphs=False)
    assert engine.generate(PROMPTS, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in N_NEW]) == want
    assert max(got.shape[0] for _, got in seen) > 1  # accepted drafts: several positions in one observation
    assert_observed_hidden_states_are_the_targets(m, seen)


@pytest.mark.gpu
def test_gpu_greedy_equals_plain_and_graphed_drafts():
    """On a GPU (fp32): the engine with drafter="mtp" emits plain greedy's tokens, with CUDA graphs
    (verify steps and the MTP's steps; requests join and leave, so several buckets) and without, and
    every hidden state the drafter is handed after a step equals a full forward's over the tokens so far
    (the graphs' hidden states are the ones the drafts come from; comparing the two runs' acceptance
    counts instead flipped at near-ties of fp32 logits, GPU run 17); the drafter's graphed drafts
    (catch-up and drafts 2..3 from one graph per (row bucket, request bucket, k)) give the eager
    drafter's drafts, as lists and on the device."""
    m = build_model().to("cuda")
    prompts, n_new = PROMPTS, N_NEW
    want, _ = greedy_on(m, prompts, n_new, max_batch=4)
    for graphs in (False, True):
        engine = Engine(m, kv_page_size=PAGE, max_seq_len=64, max_batch=4, speculate=3, drafter="mtp",
                        spec_policy=None, cuda_graphs=graphs)
        seen = recorded_observations(engine)
        got = engine.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in n_new])
        assert got == want and engine.stats["drafts_accepted"] > 0
        assert (engine.verifier is not None) == graphs and engine.graph_captures["count"] >= (2 if graphs else 0)
        assert_observed_hidden_states_are_the_targets(m, seen)
    drafts = {}
    for graphs in (False, True):
        d = MTPDrafter(m, 2, max_seq_len=64, cuda_graphs=graphs)
        reqs = [_Req([1, 2, 3], [7], 0), _Req([4], [9], 1)]
        h = torch.randn(2, 2, CFG.d_model, generator=torch.Generator().manual_seed(0)).to("cuda")
        d.observe(reqs, h[:, :1], [1, 1])
        first = d.propose(reqs, 3)
        for r, x in zip(reqs, first):
            r.output += x[:2]
        d.observe(reqs, h, [2, 2])
        second = d.propose(reqs, 3)
        for r, x in zip(reqs, second):
            r.output += x[:1]
        d.observe(reqs, h[:, 1:], [1, 1])
        third = d.propose_device(reqs, 3)  # the graphs' static drafts buffer: each step's draft kept
        assert third.device.type == "cuda" and third.dtype == torch.int64
        drafts[graphs] = (first, second, third.tolist())
    assert drafts[True] == drafts[False]


@pytest.mark.gpu
def test_gpu_first_drafts_over_a_long_prompt():
    """On a GPU (fp32): a 700-token prompt, whole and in chunks of 256, with CUDA graphs and
    without: the MTP's prompt pass runs eagerly in pieces of 512 rows, the catch-up and drafts 2..3
    from one graph, whose row buckets stay at the catch-up's few rows (no graph per prompt length); the
    first drafts equal the reference's over all 700 positions."""
    m = build_model().to("cuda")
    prompt = torch.randint(0, 256, (700,), generator=torch.Generator().manual_seed(9)).tolist()
    got = {}
    for chunk in (None, 256):
        for graphs in (False, True):
            engine = Engine(m, max_batch=2, speculate=3, drafter="mtp", kv_page_size=PAGE, max_seq_len=1024,
                            spec_policy=AlwaysK(3), prefill_chunk=chunk, cuda_graphs=graphs)
            seen = first_drafts(engine)
            rid = engine.add_request(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
            got[chunk, graphs] = seen[rid]
            assert engine.drafter.stats["prompt_rows"] == len(prompt) - 1
            if graphs:
                # (catch-up row bucket, request bucket, k): not 1024 rows, no graph per prompt length
                assert engine.drafter.graphs and max(rows for rows, _, _ in engine.drafter.graphs) <= 8
    first, drafts = got[None, False]
    assert all(v == (first, drafts) for v in got.values()), got
    assert drafts == ref_first_drafts(m, prompt, first, 3)


@pytest.mark.gpu
def test_gpu_no_sync_between_draft_and_verify():
    """On a GPU with CUDA graphs (fp32): a second run of the same requests (the first one captures
    the graphs) drafts and verifies with nothing waiting for the host from the drafter's call to the
    end of the verify call (``torch.cuda.set_sync_debug_mode("warn")`` in that window: no warning
    in the windows that captured no graph), and emits plain greedy's tokens."""
    import warnings

    m = build_model().to("cuda")
    want, _ = greedy_on(m, PROMPTS, N_NEW, max_batch=4)
    # equal costs for every k: the policy drafts K=3 every step (acceptance seen above 0)
    policy = SpeculationPolicy(3, cost=lambda batch, k: 1.0, prior_accept=0.9)
    engine = Engine(m, kv_page_size=PAGE, max_seq_len=64, max_batch=4, speculate=3, drafter="mtp",
                    spec_policy=policy)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in N_NEW]
    assert engine.generate(PROMPTS, params) == want
    assert engine.verifier is not None and engine.drafter.graphs
    windows, open_ = [], {}

    def captures():
        return engine.verifier.captured.count, len(engine.drafter.graphs)

    def start():
        open_["caught"] = warnings.catch_warnings(record=True)
        open_["log"] = open_["caught"].__enter__()
        warnings.simplefilter("always")
        open_["captures"] = captures()
        torch.cuda.set_sync_debug_mode("warn")

    def end():
        torch.cuda.set_sync_debug_mode("default")
        open_["caught"].__exit__(None, None, None)
        # the sync warnings only: torch also warns, once, that the debug mode is a prototype
        syncs = [str(w.message) for w in open_["log"] if "synchronizing CUDA operation" in str(w.message)]
        windows.append((captures() != open_["captures"], syncs))

    spy_on(engine.drafter, "propose_device", before=start)
    spy_on(engine.spec, "verify", after=end)
    try:
        assert engine.generate(PROMPTS, params) == want
    finally:
        torch.cuda.set_sync_debug_mode("default")
    steady = [syncs for captured, syncs in windows if not captured]
    assert len(steady) >= 3, windows
    assert steady == [[]] * len(steady), steady


class _Req:
    def __init__(self, prompt, output, slot):
        self.prompt, self.output, self.slot, self.finished = prompt, output, slot, False


def recorded_observations(engine) -> list[tuple[list[int], torch.Tensor]]:
    """Wrap the engine's drafter's ``observe``: each call's (tokens the request consumed up to and including
    the observed positions, their hidden states [c, M] on the CPU) for every live request, kept for
    ``assert_observed_hidden_states_are_the_targets`` (checked after the run: a full forward inside the run
    would replace the model's ``last_hidden``, which the engine reads)."""
    drafter, seen = engine.drafter, []
    observe = drafter.observe

    def recording(requests, hidden, counts):
        rows = hidden if hidden.dim() == 3 else hidden[:, None]
        for i, (r, c) in enumerate(zip(requests, counts)):
            if c and not r.finished:  # the last c output tokens follow the c observed positions
                seen.append(((r.prompt + r.output)[:-1], rows[i, :c].float().cpu()))
        return observe(requests, hidden, counts)

    drafter.observe = recording
    return seen


def assert_observed_hidden_states_are_the_targets(model, seen) -> None:
    """Every recorded observation's hidden states equal the target's over its tokens (a full forward
    without a cache; fp32 on one device: a wrong row, a stale graph buffer or a pad row is off by O(1))."""
    assert seen
    for ids, got in seen:
        ref = target_hidden(model, ids)[-got.shape[0]:].float().cpu()
        torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3, msg=lambda m: f"{len(ids)} tokens: {m}")
    model.keep_hidden = False


def greedy_on(model, prompts, n, **kw):
    engine = Engine(model, kv_page_size=PAGE, max_seq_len=64, **kw)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in n]
    return engine.generate(prompts, params), engine
