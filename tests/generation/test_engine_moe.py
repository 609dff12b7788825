"""The engine over a Nemotron-3 MoE hybrid (Mamba-2, attention, MLP and MoE layers; paged K/V):
greedy tokens equal the model's own full-forward greedy continuation (teacher forcing through
continuous batching), chunked prefill equals unchunked, prefix-cache hits keep the output, and
speculative decoding (replay and legacy verify, drafts all accepted or partly rejected) equals
plain greedy; every slot and page comes back. Uses the dense hybrid's helpers
(tests/generation/test_engine_hybrid*.py) on a model with MoE layers: 8 routed experts, top-2
out of 2 groups keeping 1 (so routing decides), a shared expert, one LatentMoE case.

The ops run their PyTorch references (TRITON_INTERPRET=0 for these tests): what is tested is that
the engine's paths do not assume the dense kinds; the MoE kernels have their own tests
(tests/ops/moe/) and the decode kernels theirs."""
from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch

from fastmamba.generation.drafters import OracleDrafter
from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import SamplingParams
from fastmamba.models.nemotron_h import NemotronHConfig, NemotronHLM, random_init
from fastmamba.ops.moe import moe_route
from tests.generation.test_engine_hybrid import PAGE, assert_all_free, check_preset_engine_on_gpu, engine_of
from tests.generation.test_engine_hybrid_prefix import run, same_run, scrub, tokens
from tests.generation.test_engine_hybrid_spec import check_verify_across_commits
from tests.helpers import CorruptedOracle, run_to_completion, spread_moe_weights, tol

FP32 = tol(torch.float32)
CFG = NemotronHConfig(d_model=64, vocab_size=256, pattern="*ME-M*E", n_heads=4, n_kv_heads=2, head_dim=16,
                      intermediate_size=96, mamba_nheads=8, mamba_headdim=16, n_groups=2, d_state=16, chunk_size=8,
                      n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1, routed_scaling_factor=2.5)
G = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(0, 256, (n,), generator=G).tolist() for n in (1, 5, 13, 22, 3, 9)]


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def build_model(cfg: NemotronHConfig = CFG) -> NemotronHLM:
    """The tiny MoE hybrid (fp32, CPU) with larger mixer weights than the preset's, so every layer
    (and each token's choice of experts) moves the logits; a random selection bias."""
    return spread_moe_weights(random_init(NemotronHLM(cfg, device="cpu", dtype=torch.float32), seed=3).eval())


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


def test_routing_uses_many_experts(model):
    """The test model's routers spread tokens over their experts (the paths below see experts with
    and without tokens in a step)."""
    seen = set()
    for i in CFG.layers_of("E"):
        moe = model.backbone.layers[i].mixer
        hook = moe.gate.register_forward_hook(lambda mod, args, logits: seen.update(moe_route(
            logits, mod.e_score_correction_bias, top_k=2, n_group=2, topk_group=1).ids.unique().tolist()))
        model(torch.tensor([PROMPTS[3]]))
        hook.remove()
    assert len(seen) >= 6


@pytest.mark.parametrize("latent", [None, 24], ids=["moe", "latent-moe"])
def test_greedy_equals_full_forward_greedy(model, latent):
    """Six requests, two slots: requests join as others leave (continuous batching), prompts of
    1..22 tokens over pages of 4, different lengths out: each request's tokens equal greedy
    decoding by full forwards (teacher forcing of the cached path)."""
    m = model if latent is None else build_model(dataclasses.replace(CFG, moe_latent_size=latent))
    n_new = [6, 3, 7, 4, 5, 2]
    engine = engine_of(m, max_batch=2)
    outs = engine.generate(PROMPTS, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in n_new])
    for p, n, out in zip(PROMPTS, n_new, outs):
        assert out == greedy_reference(m, p, n)
    assert len(set(map(tuple, outs))) == len(outs)  # the model does not just repeat itself
    assert_all_free(engine)


def test_decode_logits_equal_full_forward(model):
    """Teacher forcing at the model: prefill then one decode step per token (two requests in slots
    2 and 0) give the full forward's logits at every position."""
    seqs = [PROMPTS[2], PROMPTS[3][:16]]
    cache = model.new_cache(3, max_seq_len=32, page_size=PAGE)
    cache.alloc(3)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    model.prefill_varlen(torch.tensor(seqs[0][:4] + seqs[1][:4]), torch.tensor([0, 4, 8], dtype=torch.int32),
                         cache, slots)
    full = [model(torch.tensor([s]))[0] for s in seqs]
    for t in range(4, 13):
        got = model.decode(torch.tensor([seqs[0][t], seqs[1][t]]), cache, slots)
        for b in range(2):
            torch.testing.assert_close(got[b], full[b][t], **FP32)


def test_chunked_prefill_equals_unchunked(model):
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    want = engine_of(model, max_batch=3).generate(PROMPTS[1:4], params)
    for chunk in (1, 3, 8):
        engine = engine_of(model, max_batch=3, prefill_chunk=chunk)
        assert engine.generate(PROMPTS[1:4], params) == want, f"prefill_chunk={chunk}"
        assert_all_free(engine)


@pytest.mark.parametrize("prefill_chunk", [None, 8])
def test_prefix_cache_hit_keeps_the_output(model, prefill_chunk):
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
    assert eng.prefix_stats["hits"] == 1
    assert_all_free(eng)


@pytest.mark.parametrize("path", ["replay", "legacy"])
def test_verify_equals_full_forward_across_commits(model, path):
    """Two requests: each verify's logits equal a full forward over the accepted history plus the
    step's inputs, after commits that kept 1..T of them (the dense hybrid's check, on MoE layers)."""
    check_verify_across_commits(model, path, PROMPTS)


@pytest.mark.parametrize("verify_path", ["replay", "legacy"])
@pytest.mark.parametrize("wrong_at", [None, lambda step: [1, 3, 0, 2][step % 4]], ids=["oracle", "partial"])
def test_speculative_greedy_equals_plain_greedy(model, verify_path, wrong_at):
    K = 3
    prompts = PROMPTS[1:4]
    n_new = (6, 9, 5)
    plain = [greedy_reference(model, p, n) for p, n in zip(prompts, n_new)]
    drafter = OracleDrafter.from_runs(prompts, plain)
    if wrong_at is not None:
        drafter = CorruptedOracle(drafter, wrong_at, CFG.vocab_size)
    engine = Engine(model, max_batch=2, speculate=K, drafter=drafter, verify_path=verify_path,
                    kv_page_size=PAGE, max_seq_len=64)
    reqs = run_to_completion(engine, prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in n_new])
    assert [r.output for r in reqs] == plain
    assert engine.stats["steps"][verify_path] > 0
    if wrong_at is not None:
        assert {a for r in reqs for a in r.accepted} >= {0, 1}
    assert_all_free(engine)


@pytest.mark.gpu
def test_graphed_engine_equals_eager_on_gpu():
    """On a GPU the MoE layers run inside the engine's CUDA graphs (decode, packed prefill, verify):
    greedy tokens with graphs equal those without, plain and speculative (drafts partly rejected)."""
    m = build_model().to("cuda")
    prm = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (6, 9, 5, 7)]
    eager = engine_of(m, max_batch=4, cuda_graphs=False).generate(PROMPTS[:4], prm)
    graphs = engine_of(m, max_batch=4, cuda_graphs=True)
    assert graphs.decoder is not None and graphs.prefiller is not None
    assert graphs.generate(PROMPTS[:4], prm) == eager
    assert graphs.prefiller.captured.count > 0
    drafter = CorruptedOracle(OracleDrafter.from_runs(PROMPTS[:4], eager), lambda step: [1, 3, 0, 2][step % 4],
                              CFG.vocab_size)
    spec = Engine(m, max_batch=2, speculate=3, drafter=drafter, verify_path="replay", cuda_graphs=True,
                  kv_page_size=PAGE, max_seq_len=64)
    assert spec.verifier is not None
    assert spec.generate(PROMPTS[:4], prm) == eager
    assert_all_free(spec)


@pytest.mark.gpu
def test_nano_preset_through_the_engine_on_gpu():
    """nemotron-3-nano (bf16, random weights, 30B parameters): the engine decodes with CUDA graphs,
    continuous batching over three prompts; the graphed step's logits equal the eager step's."""
    from fastmamba.models import load_model

    check_preset_engine_on_gpu(load_model("nemotron-3-nano", device="cuda"))
