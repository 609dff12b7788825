"""The provider's CUDA graphs of transformers' decode step (fastmamba.integrations.hf_graphs).

CPU: the decoder blocks are cut into runs at the attention blocks (and at MoE blocks whose experts
transformers runs), ``use`` routes the runs' blocks and ``unuse`` restores them, and a CPU model
never replays (its steps are counted as eager, with the reason). GPU: greedy ``generate`` with the
graphs equals the provider's eager steps (the same kernels: tokens equal, logits within fp32
rounding of a different allocation) and transformers' own PyTorch path, batch 1 and a left-padded batch of
3, twice (the second ``generate`` brings a new cache: a new capture), with the replays counted."""
from __future__ import annotations

import pytest
import torch

from tests.integrations import tiny_hf

transformers = pytest.importorskip("transformers")
from fastmamba.integrations import transformers as provider  # noqa: E402

KINDS = ("mamba2", "nemotron-h", "nemotron-3-moe")
# the decoder blocks of tiny_hf's checkpoints, by run: "M*M-" cuts at the attention block, "ME*ME" too
RUNS = {"mamba2": [[0, 1]], "nemotron-h": [[0], [2, 3]], "nemotron-3-moe": [[0, 1], [3, 4]]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {k: tiny_hf.build(k, tmp_path_factory.mktemp(k.replace("-", "_")) / "ckpt", fixed_routing=True)
            for k in KINDS}


def blocks(model):
    return list(model.backbone.layers if hasattr(model, "backbone") else model.model.layers)


@pytest.mark.parametrize("kind", KINDS)
def test_runs_cut_at_attention_and_unuse_restores_the_blocks(kind, checkpoints, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the ops' PyTorch references on CPU tensors
    model = tiny_hf.load(checkpoints[kind])
    ids, mask = tiny_hf.prompts(3)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    with provider.use(model) as p:
        runs = [[blocks(model).index(b) for b in r.blocks] for r in p.graphs.runs]
        assert runs == RUNS[kind]
        for r in p.graphs.runs:
            assert r.blocks[0].__dict__["forward"].__func__ == r.head
            assert all(b.__dict__["forward"].__func__ == r.tail for b in r.blocks[1:])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        assert p.graphs.stats.replays == 0 and p.graphs.stats.captures == 0
        # 2 decode steps per run: eager on a CPU; the prefill is not one token
        assert p.graphs.stats.eager["not a CUDA inference step"] == 2 * len(runs)
        assert p.graphs.stats.eager["not one token"] == len(runs)
    assert torch.equal(out, ref)
    assert all("forward" not in b.__dict__ for b in blocks(model))
    with provider.use(model, cuda_graphs=False) as p:
        assert p.graphs is None and all("forward" not in b.__dict__ for b in blocks(model))
    with pytest.raises(TypeError, match="cuda_graphs must be True or False, got 'false'"):
        provider.use(model, cuda_graphs="false")
    assert not provider.is_used(model) and all("forward" not in b.__dict__ for b in blocks(model))


def _generate(model, ids, mask, n=12):
    with torch.no_grad():
        g = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           return_dict_in_generate=True, output_logits=True)
    return g.sequences, torch.stack(g.logits, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3-left-padded"])
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_graphed_generate_equals_eager(kind, batch, checkpoints):
    from fastmamba.bench.hf_provider import force_torch_path, release_torch_path

    model = tiny_hf.load(checkpoints[kind]).cuda()
    ids, mask = (t.cuda() for t in tiny_hf.prompts(batch))
    # transformers' own PyTorch code: where mamba_ssm imports (the GPU machine carries its wheel),
    # transformers' hooks would pick its Triton ops, whose autotuning compiles took this test past
    # its 200 s limit inside the parallel GPU suite
    changed = force_torch_path(model)
    try:
        theirs_tokens, theirs_logits = _generate(model, ids, mask)
    finally:
        release_torch_path(changed)
    with provider.use(model, cuda_graphs=False):
        eager_tokens, eager_logits = _generate(model, ids, mask)
    with provider.use(model) as p:
        first = _generate(model, ids, mask)  # warm-up step, then a capture at the second step
        assert p.graphs.stats.captures == len(RUNS[kind]) and p.graphs.stats.replays > 0
        second = _generate(model, ids, mask)  # a new cache: captured again at its first decode step
        assert p.graphs.stats.captures == 2 * len(RUNS[kind])
        steps = 11  # 12 new tokens: the prefill, then 11 one-token steps per generate, every run
        assert p.graphs.stats.replays == (2 * steps - 1) * len(RUNS[kind]), p.graphs.stats
    for tokens, logits in (first, second):
        assert torch.equal(tokens, eager_tokens) and torch.equal(tokens, theirs_tokens)
        torch.testing.assert_close(logits, eager_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits, theirs_logits, atol=1e-4, rtol=1e-4)


def test_a_cache_whose_tensors_move_is_captured_at_most_twice():
    """A cache captured MAX_CAPTURES_PER_CACHE times (its tensors moved: beam search) gets no more
    captures; another cache still does, and a dead cache's count goes with it."""
    import gc

    from fastmamba.integrations import hf_graphs

    class Cache:  # stands in for transformers' cache object (weak-referenceable, hashed by identity)
        pass

    run = hf_graphs.Run.__new__(hf_graphs.Run)
    run.captures_of = __import__("weakref").WeakKeyDictionary()
    moving, other = Cache(), Cache()
    assert [run._may_capture(moving) for _ in range(4)] == [True] * hf_graphs.MAX_CAPTURES_PER_CACHE + [False] * 2
    assert run._may_capture(other)
    del moving
    gc.collect()
    assert len(run.captures_of) == 1
