"""End of sequence, read by one rule for every model family (issue 47 point 2), on tiny checkpoints
written by transformers' save_pretrained: config.json's ``eos_token_id``, overridden by
generation_config.json's (null there: none), else the tokenizer files' ``eos_token``; ids outside
the vocabulary refused naming the file; ``max_position_embeddings`` parsed (None when absent); and
the engine stops at the loaded checkpoint's EOS. The same tests for Mamba-2 and Nemotron-H."""
from __future__ import annotations

import json

import pytest
import torch

from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import SamplingParams
from fastmamba.models import load_model

transformers = pytest.importorskip("transformers")
VOCAB = 64
PROMPT = [5, 17, 40, 2, 33]


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch):
    """The ops run their PyTorch references (the model is what is tested here; the kernels have
    their own tests), so the engine runs below take a fraction of a second."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def save_mamba2(path, eos):
    cfg = transformers.Mamba2Config(hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, expand=2,
                                    state_size=16, n_groups=1, vocab_size=VOCAB, conv_kernel=4, chunk_size=8,
                                    eos_token_id=eos, bos_token_id=0, pad_token_id=0)
    return transformers.Mamba2ForCausalLM(cfg)


def save_nemotron_h(path, eos):
    cfg = transformers.NemotronHConfig(vocab_size=VOCAB, hidden_size=32, hybrid_override_pattern="M*E",
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                       mamba_num_heads=2, mamba_head_dim=16, n_groups=1, ssm_state_size=16,
                                       chunk_size=8, n_routed_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
                                       eos_token_id=eos, bos_token_id=0, pad_token_id=0,
                                       max_position_embeddings=2048)
    return transformers.NemotronHForCausalLM(cfg)


FAMILIES = {"mamba2": save_mamba2, "nemotron_h": save_nemotron_h}


@pytest.fixture(params=list(FAMILIES), ids=list(FAMILIES))
def family(request):
    return request.param


def checkpoint(family, path, eos=7):
    """A random tiny model of ``family`` with config.json eos_token_id ``eos`` (weights scaled up so
    greedy decoding moves), saved with save_pretrained; returns the directory."""
    torch.manual_seed(0)
    model = FAMILIES[family](path, eos).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    return path


def write_json(path, data):
    path.write_text(json.dumps(data))


def test_config_json_eos(family, tmp_path):
    d = checkpoint(family, tmp_path / "ckpt", eos=7)
    (d / "generation_config.json").unlink(missing_ok=True)
    assert load_model(d, device="cpu").cfg.eos_token_ids == (7,)
    cfg = json.loads((d / "config.json").read_text())
    write_json(d / "config.json", {**cfg, "eos_token_id": [9, 7, 9]})
    assert load_model(d, device="cpu").cfg.eos_token_ids == (9, 7)


def test_generation_config_overrides(family, tmp_path):
    d = checkpoint(family, tmp_path / "ckpt", eos=7)
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == 7  # save_pretrained wrote it
    write_json(d / "generation_config.json", {"eos_token_id": [11, 12]})
    assert load_model(d, device="cpu").cfg.eos_token_ids == (11, 12)
    write_json(d / "generation_config.json", {"eos_token_id": None})
    assert load_model(d, device="cpu").cfg.eos_token_ids == ()
    write_json(d / "generation_config.json", {"do_sample": False})  # names none: config.json's stands
    assert load_model(d, device="cpu").cfg.eos_token_ids == (7,)


def test_tokenizer_eos_when_no_config_names_one(family, tmp_path):
    from tokenizers import Tokenizer, models

    d = checkpoint(family, tmp_path / "ckpt", eos=None)
    (d / "generation_config.json").unlink(missing_ok=True)
    assert json.loads((d / "config.json").read_text()).get("eos_token_id") is None
    assert load_model(d, device="cpu").cfg.eos_token_ids == ()
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB - 1)} | {"</s>": VOCAB - 1}, unk_token="t0")).save(
        str(d / "tokenizer.json"))
    write_json(d / "tokenizer_config.json", {"eos_token": "</s>"})
    assert load_model(d, device="cpu").cfg.eos_token_ids == (VOCAB - 1,)


@pytest.mark.parametrize("where", ["config.json", "generation_config.json"])
def test_eos_outside_the_vocabulary_names_the_file(family, tmp_path, where):
    d = checkpoint(family, tmp_path / "ckpt", eos=7)
    f = d / where
    write_json(f, {**json.loads(f.read_text()), "eos_token_id": VOCAB + 3})
    with pytest.raises(ValueError, match="eos_token_id") as e:
        load_model(d, device="cpu")
    assert str(VOCAB + 3) in str(e.value)
    if where == "generation_config.json":
        assert "generation_config.json" in str(e.value)


def test_max_position_embeddings(family, tmp_path):
    d = checkpoint(family, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    want = cfg.get("max_position_embeddings")
    assert (want is None) == (family == "mamba2")  # transformers' Mamba2Config has none
    assert load_model(d, device="cpu").cfg.max_position_embeddings == want
    write_json(d / "config.json", {**cfg, "max_position_embeddings": 8192})
    assert load_model(d, device="cpu").cfg.max_position_embeddings == 8192
    write_json(d / "config.json", {**cfg, "max_position_embeddings": 0})
    with pytest.raises(ValueError, match="max_position_embeddings"):
        load_model(d, device="cpu")


def test_engine_stops_at_the_checkpoints_eos(family, tmp_path):
    d = checkpoint(family, tmp_path / "ckpt", eos=None)
    (d / "generation_config.json").unlink(missing_ok=True)
    free = Engine(load_model(d, device="cpu"), max_batch=1).generate([PROMPT], SamplingParams(max_new_tokens=4))[0]
    assert len(free) == 4 and free[1] not in free[:1], free  # the second token is the first of its kind
    write_json(d / "generation_config.json", {"eos_token_id": [free[1], VOCAB - 1]})
    model = load_model(d, device="cpu")
    assert model.cfg.eos_token_ids == (free[1], VOCAB - 1)
    engine = Engine(model, max_batch=2)
    rid = engine.add_request(PROMPT, SamplingParams(max_new_tokens=4))
    rid_on = engine.add_request(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    stopped, ran_on = engine.pop_finished(rid), engine.pop_finished(rid_on)
    assert stopped.output == free[:2] and stopped.finish_reason == "eos"
    assert ran_on.output == free and ran_on.finish_reason == "length"
