"""ModelDrafter: greedy drafts from a Mamba-2 draft model. Through the engine, greedy speculative
decoding emits the tokens of plain greedy decoding (requests joining and leaving), and the target
model drafting for itself gets every draft accepted; called directly, its proposals equal greedy
continuations of the draft model run from scratch on each request's whole history."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from fastmamba.generation.drafters import ModelDrafter, make_drafter
from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import SamplingParams
from fastmamba.models import Mamba2LM, random_init
from tests.helpers import run_to_completion, scaled_tiny_model

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT_LENS = (3, 9, 5)
REF_TOKENS = 6  # plain greedy tokens per prompt; greedy is prefix-consistent, tests use prefixes


@pytest.fixture(scope="module")
def target():
    """mamba2-tiny in fp32 with its mixers scaled up (tests.helpers.scaled_tiny_model)."""
    return scaled_tiny_model(DEV)


@pytest.fixture(scope="module")
def draft(target):
    """The target with noise on its out_proj weights: it agrees with the target often but not
    always (the engine test below sees 0, 1 and 2 of K=2 drafts accepted)."""
    d = copy.deepcopy(target)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in d.backbone.layers:
            w = layer.mixer.out_proj.weight
            w.add_(0.1 * w.std() * torch.randn(w.shape, generator=g).to(w.device))
    return d


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def plain(target, prompts):
    """Plain (non-speculative) greedy continuations, REF_TOKENS each."""
    return Engine(target, max_batch=len(prompts)).generate(prompts, SamplingParams(max_new_tokens=REF_TOKENS))


def run(engine, prompts, params):
    """Run to completion; returns (outputs, accepted-drafts-per-step lists) in prompt order."""
    reqs = run_to_completion(engine, prompts, params)
    return [r.output for r in reqs], [r.accepted for r in reqs]


class Req:
    """Stands in for the engine's Request: the drafter reads prompt and output only."""

    def __init__(self, prompt: list[int], output: list[int]):
        self.prompt, self.output = prompt, output


def greedy_from_scratch(model, history: list[int], k: int) -> list[int]:
    """k greedy tokens after ``history``: full forwards over the whole sequence, no state cache."""
    seq = list(history)
    for _ in range(k):
        seq.append(int(model(torch.tensor([seq], device=DEV))[0, -1].argmax()))
    return seq[len(history):]


def test_greedy_tokens_equal_plain_in_continuous_batch(target, draft, prompts, plain):
    """Two slots for three requests of different prompt lengths (the third joins a freed slot, in
    the engine and in the drafter, while another is mid-generation): the tokens are the plain
    greedy ones, and the noisy draft model's drafts are sometimes accepted, sometimes not."""
    K, n_new = 2, (3, 6, 5)
    drafter = ModelDrafter(draft, 2, target_vocab_size=target.cfg.vocab_size)
    engine = Engine(target, max_batch=2, speculate=K, drafter=drafter, cuda_graphs=False)
    outs, acc = run(engine, prompts, [SamplingParams(max_new_tokens=n) for n in n_new])
    assert outs == [p[:n] for p, n in zip(plain, n_new)]
    counts = {a for steps in acc for a in steps}
    assert counts <= set(range(K + 1)) and {0, K} <= counts
    assert drafter.tracked <= 2  # finished requests are freed at the next call
    assert drafter.cache.free_slots == 2 * 2 - 2 - drafter.tracked


def test_target_as_draft_model_accepts_every_draft(target, prompts, plain):
    """K=3 with the target drafting for itself: 4 tokens per verify step (1 from prefill + 4 + 1 of
    4 for the first request, cut by max_new_tokens; 1 + 4 for the second)."""
    K = 3
    engine = Engine(target, max_batch=2, speculate=K, drafter=make_drafter("model", model=target, max_batch=2),
                    cuda_graphs=False)
    outs, acc = run(engine, prompts[:2], [SamplingParams(max_new_tokens=REF_TOKENS),
                                          SamplingParams(max_new_tokens=5)])
    assert outs == [plain[0], plain[1][:5]]
    assert acc == [[K, K], [K]]


@pytest.mark.parametrize("decode_catch_up", [0, 3], ids=["prefill-only", "mixed"])
def test_proposals_equal_greedy_from_scratch(target, monkeypatch, decode_catch_up):
    """Direct calls with requests joining, growing by 1..4 tokens (not the drafts: as after
    rejections) and leaving, k varying; every proposal is the draft model's greedy continuation of
    the request's history, computed independently by full forwards (the PyTorch reference ops on
    the CPU: fast, and a different code path from the drafter's packed prefill + decode). Catch-ups
    all prefilled, or (decode_catch_up=3) those of 1..3 tokens as decode steps and the 4-token one
    and new requests prefilled, in the same call. The draft model here has one layer and half the
    width (interpreter time)."""
    cfg = dataclasses.replace(target.cfg, d_model=32, n_layer=1)
    draft = random_init(Mamba2LM(cfg, device=DEV, dtype=torch.float32), seed=2).eval()
    with torch.no_grad():
        draft.backbone.layers[0].mixer.in_proj.weight.mul_(10)
        draft.backbone.layers[0].mixer.out_proj.weight.mul_(30)
    g = torch.Generator().manual_seed(5)

    def toks(n):
        return torch.randint(0, 256, (n,), generator=g).tolist()

    def check(requests, k):
        got = drafter.propose(requests, k)
        with monkeypatch.context() as mp:
            mp.setenv("TRITON_INTERPRET", "0")
            want = [greedy_from_scratch(draft, r.prompt + r.output, k) for r in requests]
        assert got == want

    drafter = ModelDrafter(draft, 3, decode_catch_up=decode_catch_up)
    a, b = Req(toks(4), toks(1)), Req(toks(1), toks(1))  # a one-token prompt
    check([a, b], 3)  # both new: every sequence from zeros
    a.output += toks(1)
    b.output += toks(3)
    c = Req(toks(7), toks(1))
    check([a, c, b], 3)  # new and continuing mixed, order changed (short catch-ups not longest first)
    b.output += toks(2)
    c.output += toks(1)
    d = Req(toks(2), toks(1))  # a has finished: d takes its slot
    check([b, c, d], 1)  # k = 1: the catch-up prefill alone
    assert drafter.tracked == 3 and drafter.cache.free_slots == 6 - 3 - 3
    for r, n in ((b, 1), (c, 4), (d, 1)):
        r.output += toks(n)
    check([b, c, d], 2)  # every request continuing
    with pytest.raises(RuntimeError, match="no new tokens"):
        drafter.propose([b], 2)
    with pytest.raises(ValueError, match="max_batch=3"):
        drafter.propose([b, c, d, Req([1], [2])], 2)
    with pytest.raises(ValueError, match=r"k must be an int >= 1"):
        drafter.propose([b], 0)
    with pytest.raises(ValueError, match="decode_catch_up must be an int >= 0"):
        ModelDrafter(draft, 3, decode_catch_up=-1)


def test_vocab_mismatch(target):
    small = random_init(Mamba2LM(dataclasses.replace(target.cfg, vocab_size=128), device=DEV)).eval()
    with pytest.raises(ValueError, match=r"vocab_size \(128\) differs from the target model's \(256\)"):
        ModelDrafter(small, 2, target_vocab_size=target.cfg.vocab_size)
    with pytest.raises(ValueError, match="vocab_size"):
        make_drafter("model", model=small, max_batch=2, target_vocab_size=256)
    with pytest.raises(ValueError, match="vocab_size"):
        ModelDrafter(small, 2).check_target(target)
    ModelDrafter(target, 1).check_target(target)
    # unchecked, a history token outside the draft vocabulary is caught before any model runs
    with pytest.raises(ValueError, match=r"outside the draft model's vocabulary \[0, 128\)"):
        ModelDrafter(small, 2).propose([Req([5, 200], [7])], 2)


def test_cli_generate_drafter_model(capsys):
    """``--drafter model --draft-model mamba2-tiny`` with the same preset as target (identical
    weights): every draft accepted; a draft model of another vocabulary is refused up front."""
    from fastmamba.cli import main

    base = ["generate", "--model", "mamba2-tiny", "--prompt-ids", "5,6,7", "--max-new-tokens", "6",
            "--speculate", "2", "--device", DEV]
    assert main(base + ["--drafter", "model", "--draft-model", "mamba2-tiny"]) == 0
    out, err = capsys.readouterr()
    assert len(out.split()) == 6
    assert "speculate K=2 (model): 2 verify steps, 4 of 4 drafts accepted (100%)" in err
    assert main(base + ["--drafter", "model", "--draft-model", "mamba2-130m"]) == 2
    assert "vocab_size (50288) differs" in capsys.readouterr().err
    assert main(base + ["--drafter", "model"]) == 2
    assert "--draft-model" in capsys.readouterr().err
