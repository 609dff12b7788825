"""The ``e2e`` target with ``--speculate`` on the CPU: the plain run's greedy tokens feed the oracle
drafter, so every draft is accepted and the speculative tokens equal the plain ones; the rows and
JSON lines carry the speculative fields; prompts (random or repetitive) and the drafter checks.

Run: ``TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/bench``. Timings here mean nothing.
"""
from __future__ import annotations

import json

import pytest
import torch

from fastmamba.bench import e2e, e2e_spec, targets

SPEC_FIELDS = {"batch", "speculate", "decode_tok_s", "plain_decode_tok_s", "speedup", "verify_steps", "ms_per_step",
               "drafts_proposed", "drafts_accepted", "acceptance", "tokens_per_step", "tokens_match",
               "requests_matching", "drafter", "draft_model", "repetitive_prompt", "provider", "model", "device",
               "command"}


def test_e2e_speculate_oracle_cpu(tmp_path, capsys, monkeypatch):
    """K=2, batch 1, gen-len 6: 7 tokens = the prefill's + 2 verify steps of 3 (every draft accepted).
    The bench's plumbing is under test (rows, counts, the path per step), not the kernels: it runs the
    ops' PyTorch references (0.3 s instead of 19 s in the interpreter). Verify on the kernels equals
    decode steps in tests/models/test_nemotron_h_verify_kernels.py; the replay kernels in tests/ops/replay."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    path = tmp_path / "e2e.jsonl"
    argv = ["e2e", "--model", "mamba2-tiny", "--speculate", "2", "--drafter", "oracle", "--batch", "1", "--gen-len", "6",
            "--prompt-len", "8", "--json", str(path)]
    assert targets.main(argv) == 0
    out = capsys.readouterr().out
    assert "speculate K=2, drafter oracle, random prompts" in out
    spec_line = next(line for line in out.splitlines() if line.startswith("fastmamba speculative K=2 (oracle)"))
    assert spec_line.split()[-3:] == ["yes", "replay:2", "(auto)"] and "100%" in spec_line  # the path per step
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["provider"] for r in rows] == ["fastmamba", "fastmamba speculative K=2 (oracle)"]
    plain, spec = rows
    assert SPEC_FIELDS <= spec.keys()
    assert "tokens" not in plain  # the recorded tokens stay out of the rows
    assert spec["batch"] == 1 and spec["speculate"] == 2 and spec["drafter"] == "oracle"
    assert spec["verify_steps"] == 2 and spec["drafts_proposed"] == 4 and spec["drafts_accepted"] == 4
    assert spec["acceptance"] == 1.0 and spec["tokens_per_step"] == 3.0
    assert spec["tokens_match"] is True and spec["requests_matching"] == 1
    assert spec["verify_path"] == "auto" and spec["steps_by_path"] == {"replay": 2, "legacy": 0, "plain": 0}
    assert spec["plain_decode_tok_s"] == plain["decode_tok_s"] > 0
    assert spec["speedup"] == pytest.approx(spec["decode_tok_s"] / plain["decode_tok_s"])


def test_make_prompts():
    # default: the plain benchmark's prompts, unchanged (random ids seeded by the batch size)
    g = torch.Generator().manual_seed(3)
    assert torch.equal(e2e.make_prompts(256, 3, 20), torch.randint(0, 256, (3, 20), generator=g))
    rep = e2e.make_prompts(256, 3, 37, repetitive=True)  # not a multiple of the block
    B = e2e.REPEAT_BLOCK
    assert rep.shape == (3, 37) and rep.dtype == torch.int64 and int(rep.max()) < 256
    assert torch.equal(rep[:, B:2 * B], rep[:, :B]) and torch.equal(rep[:, 2 * B:], rep[:, :37 - 2 * B])
    assert not torch.equal(rep[0, :B], rep[1, :B])


def test_counting_drafter_and_make_bench_drafter():
    oracle = e2e.make_bench_drafter("oracle", prompts=[[1, 2]], plain_tokens=[[5, 6, 7]], draft_model=None,
                                    batch=1, vocab_size=256)

    class R:
        prompt, output = [1, 2], [5]

    counter = e2e_spec.CountingDrafter(oracle)
    assert counter.propose([R()], 3) == [[6, 7, 7]] and counter.propose([R(), R()], 2) == [[6, 7], [6, 7]]
    assert counter.calls == 2 and counter.proposed == 7
    assert e2e.make_bench_drafter("ngram", prompts=[], plain_tokens=[], draft_model=None, batch=1,
                                  vocab_size=256).propose([R()], 2) == [[5, 5]]
    with pytest.raises(ValueError, match="unknown drafter"):
        e2e.make_bench_drafter("nope", prompts=[], plain_tokens=[], draft_model=None, batch=1, vocab_size=256)


def test_e2e_speculate_errors(capsys):
    assert targets.main(["e2e", "--speculate", "-1", "--batch", "1"]) == 2
    assert "--speculate expects K >= 0" in capsys.readouterr().err
    # a draft model of another vocabulary is refused before anything runs
    assert targets.main(["e2e", "--model", "mamba2-tiny", "--speculate", "2", "--drafter", "model",
                         "--draft-model", "mamba2-130m", "--batch", "1"]) == 2
    assert "vocab_size (50288) differs from the target model's (256)" in capsys.readouterr().err
