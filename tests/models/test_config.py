"""Mamba2Config from config.json / generation_config.json: every field checked, errors name the file and field."""
from __future__ import annotations

import json
import math

import pytest

from fastmamba.models.config import Mamba2Config

HF = {"model_type": "mamba2", "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 8, "head_dim": 16,
      "expand": 2, "state_size": 16, "n_groups": 2, "vocab_size": 96, "conv_kernel": 4, "chunk_size": 8,
      "use_conv_bias": True, "use_bias": False, "tie_word_embeddings": True, "layer_norm_epsilon": 1e-5,
      "residual_in_fp32": True, "time_step_limit": [0.0, math.inf], "eos_token_id": 2}
SS = {"d_model": 64, "n_layer": 2, "vocab_size": 90, "pad_vocab_size_multiple": 16, "tie_embeddings": True,
      "rms_norm": True, "residual_in_fp32": True,
      "ssm_cfg": {"layer": "Mamba2", "d_state": 16, "headdim": 16, "ngroups": 2, "d_conv": 4, "expand": 2}}


def write(tmp_path, cfg, gen=None):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if gen is not None:
        (tmp_path / "generation_config.json").write_text(gen if isinstance(gen, str) else json.dumps(gen))
    return tmp_path


def with_ssm(**kw):
    return dict(SS, ssm_cfg=dict(SS["ssm_cfg"], **kw))


def test_valid_files_read(tmp_path):
    a = Mamba2Config.from_dir(write(tmp_path, HF))
    assert (a.d_model, a.n_layer, a.vocab_size, a.nheads, a.headdim, a.d_state, a.ngroups, a.chunk_size) == (
        64, 2, 96, 8, 16, 16, 2, 8)
    assert a.conv_bias is True and a.proj_bias is False and a.tie_embeddings is True
    assert a.eos_token_ids == (2,)
    b = Mamba2Config.from_dict(SS)
    assert b.vocab_size == 96 and b.eos_token_ids == ()  # padded to the multiple; no eos in the file
    assert (b.nheads, b.conv_dim, b.d_in_proj) == (a.nheads, a.conv_dim, a.d_in_proj)


def test_transformers_written_config_reads(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Mamba2Config(hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, expand=2,
                                    state_size=16, n_groups=1, vocab_size=96, eos_token_id=[5, 7])
    cfg.save_pretrained(tmp_path)
    ours = Mamba2Config.from_dir(tmp_path)
    assert (ours.d_model, ours.nheads, ours.vocab_size, ours.eos_token_ids) == (64, 8, 96, (5, 7))


def test_optional_fields_take_defaults(tmp_path):
    keep = ("hidden_size", "num_hidden_layers", "vocab_size")
    cfg = Mamba2Config.from_dir(write(tmp_path, {k: HF[k] for k in keep}))
    assert (cfg.d_state, cfg.d_conv, cfg.expand, cfg.headdim, cfg.ngroups, cfg.chunk_size) == (128, 4, 2, 64, 1, 256)
    assert (cfg.norm_eps, cfg.tie_embeddings, cfg.conv_bias, cfg.proj_bias) == (1e-5, False, True, False)
    assert cfg.dt_limit == (0.0, math.inf) and cfg.eos_token_ids == ()


# field, value, what the message must say; each row breaks one field of HF
HF_BAD = [
    ("vocab_size", None, r"required field 'vocab_size' is missing"),
    ("num_hidden_layers", None, r"required field 'num_hidden_layers' is missing"),
    ("head_dim", 0, r"'head_dim' expected an integer >= 1, got 0 \(int\)"),
    ("hidden_size", 32.7, r"'hidden_size' expected an integer >= 1, got 32.7 \(float\)"),
    ("hidden_size", "64", r"'hidden_size' expected an integer >= 1, got '64' \(str\)"),
    ("state_size", -16, r"'state_size' expected an integer >= 1, got -16"),
    ("n_groups", True, r"'n_groups' expected an integer >= 1, got True \(bool\)"),
    ("vocab_size", 0, r"'vocab_size' expected an integer >= 1, got 0"),
    ("conv_kernel", 4.0, r"'conv_kernel' expected an integer >= 1, got 4.0"),
    ("use_conv_bias", "false", r"'use_conv_bias' expected true or false, got 'false' \(str\)"),
    ("use_bias", 0, r"'use_bias' expected true or false, got 0 \(int\)"),
    ("residual_in_fp32", "yes", r"'residual_in_fp32' expected true or false"),
    ("layer_norm_epsilon", 0.0, r"'layer_norm_epsilon' expected a finite number > 0, got 0.0"),
    ("layer_norm_epsilon", "1e-5", r"'layer_norm_epsilon' expected a finite number > 0, got '1e-5'"),
    ("time_step_limit", [0.0], r"'time_step_limit' expected \[low, high\]"),
    ("time_step_limit", [1.0, 0.5], r"'time_step_limit' expected \[low, high\]"),
    ("head_dim", 24, r"'expand' \* 'hidden_size' = 128 is not a multiple of 'head_dim' = 24"),
    ("n_groups", 3, r"'n_groups' = 3 does not divide the number of heads 8"),
    ("num_heads", 7, r"num_heads=7 but expand \* hidden_size / head_dim = 8"),
    ("num_heads", "8", r"'num_heads' expected an integer >= 1"),
    ("eos_token_id", "2", r"'eos_token_id' expected a token id >= 0 or a list of them, got '2'"),
    ("eos_token_id", [2, -1], r"'eos_token_id' expected a token id >= 0"),
    ("eos_token_id", 96, r"'eos_token_id' \[96\] outside the vocabulary \(vocab_size = 96\)"),
    ("model_type", "mamba", r"'model_type' is 'mamba'; only 'mamba2'"),
]


@pytest.mark.parametrize("field,value,match", HF_BAD, ids=[f"{f}={v!r}" for f, v, _ in HF_BAD])
def test_hf_field_errors_name_file_and_field(tmp_path, field, value, match):
    cfg = dict(HF)
    if value is None:
        del cfg[field]
    else:
        cfg[field] = value
    path = write(tmp_path, cfg) / "config.json"
    with pytest.raises(ValueError, match=match) as e:
        Mamba2Config.from_dir(tmp_path)
    assert str(e.value).startswith(f"Mamba2Config: {path}: ")


SS_BAD = [
    (dict(SS, vocab_size=None), r"required field 'vocab_size' is missing"),
    (dict(SS, n_layer=2.5), r"'n_layer' expected an integer >= 1, got 2.5"),
    (dict(SS, pad_vocab_size_multiple=0), r"'pad_vocab_size_multiple' expected an integer >= 1, got 0"),
    (dict(SS, tie_embeddings="true"), r"'tie_embeddings' expected true or false, got 'true'"),
    (dict(SS, ssm_cfg=[1]), r"'ssm_cfg' should be a JSON object, got \[1\] \(list\)"),
    (with_ssm(headdim=0), r"'ssm_cfg.headdim' expected an integer >= 1, got 0"),
    (with_ssm(d_state=16.5), r"'ssm_cfg.d_state' expected an integer >= 1, got 16.5"),
    (with_ssm(conv_bias="false"), r"'ssm_cfg.conv_bias' expected true or false, got 'false'"),
    (with_ssm(ngroups=3), r"'ssm_cfg.ngroups' = 3 does not divide the number of heads 8"),
    (with_ssm(layer=None), r"'ssm_cfg.layer' is missing \(mamba_ssm then builds 'Mamba1'\)"),
    (with_ssm(layer="Mamba1"), r"'ssm_cfg.layer' is 'Mamba1'; only 'Mamba2'"),
    (with_ssm(d_ssm=64), r"'ssm_cfg.d_ssm'=64 differs from expand \* d_model = 128"),
    (dict(SS, d_intermediate=256), r"'d_intermediate' > 0 \(MLP blocks\) is not supported"),
    (dict(SS, attn_layer_idx=[1]), r"attention layers \('attn_layer_idx'\)"),
    (dict(SS, rms_norm=False), r"'rms_norm' false"),
]


@pytest.mark.parametrize("cfg,match", SS_BAD, ids=[m.split("'")[1] + f"-{i}" for i, (_, m) in enumerate(SS_BAD)])
def test_state_spaces_field_errors(tmp_path, cfg, match):
    cfg = {k: v for k, v in cfg.items() if v is not None}
    if cfg.get("ssm_cfg", {}) and isinstance(cfg["ssm_cfg"], dict):
        cfg["ssm_cfg"] = {k: v for k, v in cfg["ssm_cfg"].items() if v is not None}
    path = write(tmp_path, cfg) / "config.json"
    with pytest.raises(ValueError, match=match) as e:
        Mamba2Config.from_file(path)
    assert str(e.value).startswith(f"Mamba2Config: {path}: ")


def test_neither_format_and_not_an_object(tmp_path):
    with pytest.raises(ValueError, match=r"config.json has neither 'd_model'.*nor 'hidden_size'"):
        Mamba2Config.from_file(write(tmp_path, {"n_embd": 3}) / "config.json")
    with pytest.raises(ValueError, match=r"config.json: the file should be a JSON object, got \[1, 2\] \(list\)"):
        Mamba2Config.from_file(write(tmp_path, [1, 2]) / "config.json")


def test_invalid_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'} is not valid JSON"):
        Mamba2Config.from_dir(tmp_path)
    write(tmp_path, HF, gen="{oops")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'generation_config.json'} is not valid JSON"):
        Mamba2Config.from_dir(tmp_path)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"checkpoint directory '{tmp_path / 'nope'}' does not exist"):
        Mamba2Config.from_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=rf"no config.json in '{tmp_path}'"):
        Mamba2Config.from_dir(tmp_path)


@pytest.mark.parametrize("config_eos,gen,expected", [
    (2, None, (2,)),                                  # config.json alone
    ([2, 3, 2], None, (2, 3)),                        # a list, duplicates dropped, order kept
    (2, {"eos_token_id": [4, 5]}, (4, 5)),            # generation_config.json wins
    (2, {"eos_token_id": 7}, (7,)),
    (2, {"eos_token_id": None}, ()),                  # explicitly none
    (2, {"max_length": 20}, (2,)),                    # present but silent on eos
    (None, {"eos_token_id": 9}, (9,)),
    (None, None, ()),
], ids=["config-int", "config-list", "gen-list", "gen-int", "gen-null", "gen-silent", "gen-only", "none"])
def test_eos_token_ids(tmp_path, config_eos, gen, expected):
    cfg = dict(HF, eos_token_id=config_eos)
    assert Mamba2Config.from_dir(write(tmp_path, cfg, gen)).eos_token_ids == expected


@pytest.mark.parametrize("gen,match", [
    ({"eos_token_id": "x"}, r"generation_config.json: 'eos_token_id' expected a token id"),
    ({"eos_token_id": [1, 200]}, r"generation_config.json: 'eos_token_id' \[200\] outside the vocabulary"),
    ([1], r"generation_config.json: the file should be a JSON object"),
], ids=["str", "out-of-vocab", "list-file"])
def test_bad_generation_config(tmp_path, gen, match):
    with pytest.raises(ValueError, match=match):
        Mamba2Config.from_dir(write(tmp_path, HF, gen))


@pytest.mark.parametrize("kw,match", [
    (dict(d_model=0), r"d_model expected an integer >= 1, got 0"),
    (dict(headdim=16.0), r"headdim expected an integer >= 1, got 16.0"),
    (dict(conv_bias="false"), r"conv_bias expected a bool, got 'false'"),
    (dict(norm_eps=-1.0), r"norm_eps expected a finite number > 0"),
    (dict(eos_token_ids=[1]), r"eos_token_ids expected a tuple of ints"),
    (dict(eos_token_ids=(300,)), r"eos_token_ids \[300\] are outside the vocabulary \[0, 256\)"),
    (dict(headdim=48), r"d_inner=128 \(expand \* d_model\) is not a multiple of headdim=48"),
    (dict(ngroups=3), r"ngroups=3 must divide the number of heads 8"),
], ids=["d_model-0", "headdim-float", "conv_bias-str", "eps-neg", "eos-list", "eos-range", "headdim", "ngroups"])
def test_direct_construction_checks(kw, match):
    base = dict(d_model=64, n_layer=2, vocab_size=256, d_state=16, headdim=16)
    with pytest.raises(ValueError, match=match):
        Mamba2Config(**{**base, **kw})


GPT_NEOX_LIKE = {"added_tokens": [{"id": 0, "content": "<|endoftext|>", "special": True},
                                  {"id": 1, "content": "<|padding|>", "special": True}],
                 "model": {"type": "BPE", "vocab": {"<|endoftext|>": 0, "<|padding|>": 1, "a": 2, "</s>": 3}}}


@pytest.mark.parametrize("files,expected", [
    ({"tokenizer_config.json": {"eos_token": "<|endoftext|>"}}, (0,)),
    ({"special_tokens_map.json": {"eos_token": {"content": "<|endoftext|>", "lstrip": False}}}, (0,)),
    ({"tokenizer_config.json": {"eos_token": "</s>"}}, (3,)),  # from the model's vocab
    ({"tokenizer_config.json": {"eos_token": None}, "special_tokens_map.json": {"eos_token": "<|padding|>"}}, (1,)),
    ({"tokenizer_config.json": {"model_max_length": 2048}}, ()),
], ids=["tokenizer_config", "special_tokens_map-dict", "model-vocab", "second-file", "no-eos_token"])
def test_state_spaces_eos_from_tokenizer_files(tmp_path, files, expected):
    """state-spaces checkpoints name no eos_token_id: the tokenizer files' eos_token gives it."""
    write(tmp_path, SS)
    (tmp_path / "tokenizer.json").write_text(json.dumps(GPT_NEOX_LIKE))
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    assert Mamba2Config.from_dir(tmp_path).eos_token_ids == expected


def test_tokenizer_eos_is_only_a_fallback(tmp_path):
    write(tmp_path, dict(HF, eos_token_id=5))
    (tmp_path / "tokenizer.json").write_text(json.dumps(GPT_NEOX_LIKE))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    assert Mamba2Config.from_dir(tmp_path).eos_token_ids == (5,)  # config.json names one
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    assert Mamba2Config.from_dir(tmp_path).eos_token_ids == ()  # explicitly none
    (tmp_path / "tokenizer.json").unlink()
    write(tmp_path, dict(HF, eos_token_id=None))
    (tmp_path / "generation_config.json").unlink()
    assert Mamba2Config.from_dir(tmp_path).eos_token_ids == ()  # no tokenizer.json to map the name


@pytest.mark.parametrize("config,match", [
    ({"eos_token": "<missing>"}, r"tokenizer_config.json: 'eos_token' '<missing>' is not a token of .*tokenizer.json"),
    ({"eos_token": 5}, r"tokenizer_config.json: 'eos_token' expected a token string"),
], ids=["unknown-token", "not-a-string"])
def test_bad_tokenizer_eos(tmp_path, config, match):
    write(tmp_path, SS)
    (tmp_path / "tokenizer.json").write_text(json.dumps(GPT_NEOX_LIKE))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        Mamba2Config.from_dir(tmp_path)
