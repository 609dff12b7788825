"""End of sequence and stop conditions on the real model (mamba2-tiny, Triton kernels under the
interpreter on CPU): the engine and ``fastmamba generate`` stop at the checkpoint's EOS by default,
at ``--stop-token-ids`` and ``--stop`` strings, and run on with ``ignore_eos``.

The model is the fp32 tiny preset with its mixers scaled up (``scaled_tiny_model``) so greedy
decoding does not just repeat a token; its EOS is set on a copy of its config, as the loader
sets it from config.json / generation_config.json. Kept to a few tokens: each decode step of the
interpreted model costs seconds.
"""
from __future__ import annotations

import copy

import pytest
import fastmamba
from fastmamba.cli import main
from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import SamplingParams
from tests.helpers import scaled_tiny_model

PROMPT = [17, 200, 3, 99, 42]
N = 3


@pytest.fixture(scope="module")
def model():
    return scaled_tiny_model("cpu")


@pytest.fixture(scope="module")
def ref(model):
    """N greedy tokens with no EOS known (the preset's config has none); test_engine.py checks
    the engine's greedy tokens against full forwards."""
    assert not getattr(model.cfg, "eos_token_ids", ())
    out = Engine(model, max_batch=1).generate([PROMPT], SamplingParams(max_new_tokens=N))[0]
    assert len(set(out)) == N, out  # distinct tokens: each stop test below is sharp
    return out


def with_eos(monkeypatch, model, eos: tuple[int, ...]):
    """``model`` with ``cfg.eos_token_ids = eos`` on a private copy of its config (the preset's is shared)."""
    cfg = copy.copy(model.cfg)
    object.__setattr__(cfg, "eos_token_ids", eos)  # frozen dataclass; works with or without the field
    monkeypatch.setattr(model, "cfg", cfg)
    return model


def char_tokenizer(vocab: int):
    """Token i decodes to "<i>" (a ``tokenizers`` WordLevel model with a Fuse decoder)."""
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab)}, unk_token="<0>"))
    tok.decoder = decoders.Fuse()
    return tok


def test_engine_stops_at_eos_and_ignore_eos_runs_on(model, ref, monkeypatch):
    with_eos(monkeypatch, model, (ref[1], 255))
    engine = Engine(model, max_batch=2)
    rid = engine.add_request(PROMPT, SamplingParams(max_new_tokens=N))
    rid_on = engine.add_request(PROMPT, SamplingParams(max_new_tokens=N, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    stopped, ran_on = engine.pop_finished(rid), engine.pop_finished(rid_on)
    assert stopped.output == ref[:2] and stopped.finish_reason == "eos" and stopped.stop_reason == ref[1]
    assert ran_on.output == ref and ran_on.finish_reason == "length"
    assert engine.cache.free_slots == 2 and not engine.finished


def generate_cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["generate", "--model", "mamba2-tiny", "--prompt-ids", ",".join(map(str, PROMPT)),
               "--max-new-tokens", str(N), "--device", "cpu", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def cli_model(model, ref, monkeypatch):
    """``fastmamba generate --model mamba2-tiny`` gets ``model`` with EOS = ref[1]."""
    with_eos(monkeypatch, model, (ref[1],))
    monkeypatch.setattr(fastmamba, "load_model", lambda *a, **k: model)
    return model


def test_cli_stops_at_eos_by_default(cli_model, ref, capsys):
    rc, out, _ = generate_cli(capsys)
    assert rc == 0 and [int(t) for t in out.split()] == ref[:2]


def test_cli_stop_token_ids(cli_model, ref, capsys):
    rc, out, _ = generate_cli(capsys, "--stop-token-ids", f"{ref[0]}, 7")
    assert rc == 0 and [int(t) for t in out.split()] == ref[:1]
    rc, _, err = generate_cli(capsys, "--stop-token-ids", "1,x")
    assert rc == 2 and "--stop-token-ids" in err


def test_cli_stop_strings(cli_model, ref, capsys, monkeypatch):
    rc, _, err = generate_cli(capsys, "--stop", "x")  # the preset has no tokenizer
    assert rc == 2 and "--stop" in err and "tokenizer" in err
    import fastmamba.generation.tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module, "load_tokenizer", lambda path: char_tokenizer(cli_model.cfg.vocab_size))
    stop = f"{ref[1]}><{ref[2]}"  # spans tokens 1 and 2: completed by token 2, after the EOS at token 1
    rc, out, _ = generate_cli(capsys, "--ignore-eos", "--stop", "never", "--stop", stop,
                              "--max-new-tokens", str(N + 2))
    assert rc == 0 and out.strip() == "".join(f"<{t}>" for t in ref[:3])
