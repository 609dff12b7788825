"""Checkpoint reading (safetensors / .bin, single / sharded), renaming, in-place loading, progress bar.

A tiny module tree with Hugging Face Mamba2 names stands in for the model (M=8, D=16, H=2, G=1,
N=4, W=4, V=32, 2 layers); files go to pytest's tmp_path, nothing is downloaded.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from fastmamba.models.weights import load_into, normalize_names, read_checkpoint
from fastmamba.utils import Progress

V, M, D, H, G, N, W = 32, 8, 16, 2, 1, 4, 4
E = D + 2 * G * N


class _Norm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


class _Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(M, D + E + H, bias=False)
        self.conv1d = nn.Conv1d(E, E, W, groups=E, padding=W - 1)
        self.dt_bias = nn.Parameter(torch.zeros(H))
        self.A_log = nn.Parameter(torch.zeros(H))
        self.D = nn.Parameter(torch.ones(H))
        self.norm = _Norm(D)
        self.out_proj = nn.Linear(D, M, bias=False)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = _Norm(M)
        self.mixer = _Mixer()


class _Backbone(nn.Module):
    def __init__(self, n_layer: int):
        super().__init__()
        self.embeddings = nn.Embedding(V, M)
        self.layers = nn.ModuleList(_Block() for _ in range(n_layer))
        self.norm_f = _Norm(M)


class TinyLM(nn.Module):
    """Hugging Face Mamba2ForCausalLM naming; lm_head.weight *is* the embedding Parameter when tied."""

    def __init__(self, *, n_layer: int = 2, tied: bool = True, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.backbone = _Backbone(n_layer)
        self.lm_head = nn.Linear(M, V, bias=False)
        if tied:
            self.lm_head.weight = self.backbone.embeddings.weight
        self.to(dtype)


def make_checkpoint(*, tied: bool = True, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights as a saver writes them: tied lm_head dropped (as HF's save_pretrained does)."""
    g = torch.Generator().manual_seed(seed)
    sd = {k: torch.randn(v.shape, generator=g).to(dtype) for k, v in TinyLM(tied=tied).state_dict().items()}
    if tied:
        del sd["lm_head.weight"]
    return sd


def assert_loaded(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    for name, t in sd.items():
        assert got[name].dtype == next(model.parameters()).dtype
        assert torch.equal(got[name], t.to(got[name].dtype)), name


def _shard_names(sd: dict[str, torch.Tensor]) -> dict[str, str]:
    """Name -> shard: layer 1 and the final norm go to the second of two shards."""
    return {k: ("2" if k.startswith(("backbone.layers.1.", "backbone.norm_f")) else "1") for k in sd}


def write_checkpoint(sd: dict[str, torch.Tensor], root: Path, fmt: str) -> Path:
    """Write ``sd`` in one of the four layouts read_checkpoint accepts; returns ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        save_file(sd, str(root / "model.safetensors"))
    elif fmt == "bin":
        torch.save(sd, root / "pytorch_model.bin")
    elif fmt in ("safetensors-sharded", "bin-sharded"):
        st = fmt == "safetensors-sharded"
        part = _shard_names(sd)
        pattern = "model-0000{}-of-00002.safetensors" if st else "pytorch_model-0000{}-of-00002.bin"
        file = {p: pattern.format(p) for p in "12"}
        for p in "12":
            shard = {k: v for k, v in sd.items() if part[k] == p}
            if st:
                save_file(shard, str(root / file[p]))
            else:
                torch.save(shard, root / file[p])
        index = {"metadata": {"total_size": 0}, "weight_map": {k: file[part[k]] for k in sd}}
        index_name = "model.safetensors.index.json" if st else "pytorch_model.bin.index.json"
        (root / index_name).write_text(json.dumps(index))
    else:
        raise AssertionError(fmt)
    return root


FORMATS = ["safetensors", "safetensors-sharded", "bin", "bin-sharded"]


# ---------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip(tmp_path, fmt):
    sd = make_checkpoint()
    read = read_checkpoint(write_checkpoint(sd, tmp_path / "ckpt", fmt))
    assert sorted(read) == sorted(sd)
    for k in sd:
        assert read[k].device.type == "cpu" and torch.equal(read[k], sd[k]), k
    model = TinyLM()
    load_into(model, read)
    assert_loaded(model, sd)
    assert torch.equal(model.lm_head.weight, sd["backbone.embeddings.weight"])


def test_prefers_safetensors_over_bin(tmp_path):
    sd = make_checkpoint(seed=1)
    write_checkpoint(sd, tmp_path, "safetensors")
    write_checkpoint({k: torch.zeros_like(v) for k, v in sd.items()}, tmp_path, "bin")
    read = read_checkpoint(tmp_path)
    assert all(torch.equal(read[k], sd[k]) for k in sd)


def test_state_spaces_names(tmp_path):
    sd = make_checkpoint()
    ss = {("backbone.embedding.weight" if k == "backbone.embeddings.weight" else k): v for k, v in sd.items()}
    read = read_checkpoint(write_checkpoint(ss, tmp_path, "safetensors"))
    with pytest.raises(ValueError, match=r"normalize_names\(\)"):  # the raw names get a hint
        load_into(TinyLM(), read)
    normalized = normalize_names(read)
    assert list(normalized)[0] == "backbone.embeddings.weight" and "backbone.embedding.weight" not in normalized
    assert normalized["backbone.embeddings.weight"] is read["backbone.embedding.weight"]
    model = TinyLM()
    load_into(model, normalized)
    assert_loaded(model, sd)


def test_normalize_names_keeps_hf_and_unknown_names():
    sd = {"backbone.embeddings.weight": torch.ones(1), "model.layers.0.foo": torch.ones(1)}
    assert list(normalize_names(sd)) == list(sd)


def test_normalize_names_rejects_both_schemes():
    sd = {"backbone.embedding.weight": torch.ones(1), "backbone.embeddings.weight": torch.ones(1)}
    with pytest.raises(ValueError, match="both 'backbone.embedding.weight'.*'backbone.embeddings.weight'"):
        normalize_names(sd)


def test_parameter_identity_preserved():
    model = TinyLM()
    before = {name: p for name, p in model.named_parameters()}
    emb = model.backbone.embeddings.weight
    load_into(model, make_checkpoint())
    after = dict(model.named_parameters())
    assert before.keys() == after.keys()
    assert all(after[k] is before[k] for k in before)
    assert model.lm_head.weight is emb and model.backbone.embeddings.weight is emb


def test_bf16_checkpoint_into_fp32_model(tmp_path):
    sd = make_checkpoint(dtype=torch.bfloat16)
    read = read_checkpoint(write_checkpoint(sd, tmp_path, "safetensors"))
    assert read["backbone.layers.0.mixer.A_log"].dtype == torch.bfloat16
    model = TinyLM(dtype=torch.float32)
    load_into(model, read)
    for name, t in model.state_dict().items():
        assert t.dtype == torch.float32
    assert_loaded(model, sd)  # bf16 -> fp32 is exact


def test_untied_model_loads_its_own_lm_head():
    sd = make_checkpoint(tied=False)
    model = TinyLM(tied=False)
    load_into(model, sd)
    assert_loaded(model, sd)
    assert not torch.equal(model.lm_head.weight, model.backbone.embeddings.weight)


def test_tied_model_accepts_equal_lm_head():
    sd = make_checkpoint()
    sd["lm_head.weight"] = sd["backbone.embeddings.weight"].to(torch.bfloat16).float()  # equal after cast to bf16
    model = TinyLM(dtype=torch.bfloat16)
    load_into(model, sd)
    assert model.lm_head.weight is model.backbone.embeddings.weight


def test_tied_model_accepts_lm_head_only():
    sd = make_checkpoint()
    sd["lm_head.weight"] = sd.pop("backbone.embeddings.weight")
    model = TinyLM()
    load_into(model, sd)
    assert torch.equal(model.backbone.embeddings.weight, sd["lm_head.weight"])


# ---------------------------------------------------------------------------------------------
# read_checkpoint errors


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'.*nope' does not exist"):
        read_checkpoint(tmp_path / "nope")


def test_path_is_a_file(tmp_path):
    write_checkpoint(make_checkpoint(), tmp_path, "safetensors")
    with pytest.raises(NotADirectoryError, match="pass the directory that holds it"):
        read_checkpoint(tmp_path / "model.safetensors")


def test_no_weight_file_lists_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "weights.pt").write_bytes(b"")
    (tmp_path / "sub").mkdir()
    with pytest.raises(FileNotFoundError) as e:
        read_checkpoint(tmp_path)
    msg = str(e.value)
    assert "model.safetensors, model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json" in msg
    assert "holds: config.json, sub/, weights.pt" in msg


@pytest.mark.parametrize("fmt", ["safetensors-sharded", "bin-sharded"])
def test_missing_shard(tmp_path, fmt):
    write_checkpoint(make_checkpoint(), tmp_path, fmt)
    shard = next(tmp_path.glob("*-00002-of-00002.*"))
    shard.unlink()
    expected = rf"names 1 shard\(s\) that do not exist.*'{shard.name}' \(holding e.g. 'backbone.layers.1"
    with pytest.raises(FileNotFoundError, match=expected):
        read_checkpoint(tmp_path)


def test_index_lists_tensor_its_shard_lacks(tmp_path):
    write_checkpoint(make_checkpoint(), tmp_path, "safetensors-sharded")
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["backbone.layers.2.norm.weight"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    expected = r"lists 1 tensor\(s\) its shards do not hold: 'backbone.layers.2.norm.weight'"
    with pytest.raises(ValueError, match=expected):
        read_checkpoint(tmp_path)


@pytest.mark.parametrize("text", ["{not json", '{"metadata": {}}', "[]"], ids=["bad-json", "no-weight_map", "list"])
def test_bad_index(tmp_path, text):
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError, match="model.safetensors.index.json"):
        read_checkpoint(tmp_path)


def test_bin_that_is_not_a_state_dict(tmp_path):
    torch.save([torch.ones(1)], tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"should hold a \{name: tensor\} dict, got list"):
        read_checkpoint(tmp_path)


# ---------------------------------------------------------------------------------------------
# load_into errors


def test_all_problems_in_one_message():
    sd = make_checkpoint()
    del sd["backbone.layers.1.mixer.D"]
    sd["backbone.layers.0.mixer.A_log"] = torch.zeros(H + 1)
    sd["backbone.layers.2.norm.weight"] = torch.zeros(M)
    model = TinyLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as e:
        load_into(model, sd)
    msg = str(e.value)
    assert "TinyLM (3 problem(s); nothing was copied)" in msg
    assert "missing from the checkpoint (1):\n    backbone.layers.1.mixer.D" in msg
    assert "unexpected in the checkpoint (not in the model) (1):\n    backbone.layers.2.norm.weight" in msg
    assert "shape mismatches (1):\n    backbone.layers.0.mixer.A_log: expected (2,), got (3,)" in msg
    assert "lm_head" not in msg  # tied: its absence is fine
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a failed load must copy nothing"


def test_long_lists_are_clipped():
    model = TinyLM(n_layer=4)
    with pytest.raises(ValueError) as e:
        load_into(model, {})
    msg = str(e.value)
    n_missing = len(dict(model.named_parameters()))  # tied pair counts once
    assert f"missing from the checkpoint ({n_missing}):" in msg
    assert f"... and {n_missing - 20} more" in msg
    assert "backbone.embeddings.weight = lm_head.weight" in msg


def test_untied_model_missing_lm_head():
    sd = make_checkpoint(tied=True)  # no lm_head.weight
    with pytest.raises(ValueError, match=r"missing from the checkpoint \(1\):\n    lm_head.weight"):
        load_into(TinyLM(tied=False), sd)


def test_tied_model_rejects_different_lm_head():
    sd = make_checkpoint(tied=False)
    with pytest.raises(ValueError, match="lm_head.weight differs from backbone.embeddings.weight.*ties it"):
        load_into(TinyLM(tied=True), sd)


def test_not_strict_skips_missing_and_unexpected_but_not_shapes():
    sd = make_checkpoint()
    del sd["backbone.norm_f.weight"]
    sd["extra"] = torch.zeros(1)
    model = TinyLM()
    load_into(model, sd, strict=False)
    assert torch.equal(model.backbone.layers[0].mixer.D, sd["backbone.layers.0.mixer.D"])
    sd["backbone.layers.0.mixer.D"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"backbone.layers.0.mixer.D: expected \(2,\), got \(5,\)"):
        load_into(model, sd, strict=False)


# ---------------------------------------------------------------------------------------------
# progress bar


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_non_tty_prints_few_lines():
    out = io.StringIO()
    with Progress(1000, "reading", stream=out, enabled=True) as bar:
        for _ in range(1000):
            bar.update(nbytes=2_000_000)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert 2 <= len(lines) <= 11  # start, each further 10 %, done
    assert lines[0] == "reading [....................] 0/1000 tensors"
    assert lines[-1].startswith("reading [####################] 1000/1000 tensors ")
    assert "B/s in " in lines[-1] and lines[-1].endswith(" s")
    counts = [int(ln.split()[2].split("/")[0]) for ln in lines]
    assert counts == sorted(set(counts))  # each line reports new progress


def test_progress_tty_redraws_one_line():
    out = _TTY()
    with Progress(50, "loading", stream=out, enabled=True, unit="shards") as bar:
        for _ in range(50):
            bar.update()
    text = out.getvalue()
    assert text.startswith("\rloading [") and text.endswith("\n") and text.count("\n") == 1
    final = text.rsplit("\r", 1)[1]
    assert final.startswith("loading [####################] 50/50 shards ") and "shards/s in" in final


def test_progress_stopped_early_reports_where():
    out = io.StringIO()
    with pytest.raises(RuntimeError):
        with Progress(10, "x", stream=out, enabled=True) as bar:
            bar.update(3)
            raise RuntimeError
    assert out.getvalue().splitlines()[-1].startswith("x [######..............] 3/10 tensors")


def test_progress_auto(monkeypatch):
    monkeypatch.delenv("FASTMAMBA_PROGRESS", raising=False)
    assert not Progress(2, "tiny", stream=io.StringIO()).enabled
    assert Progress(100, "big", stream=io.StringIO()).enabled
    monkeypatch.setenv("FASTMAMBA_PROGRESS", "0")
    out = io.StringIO()
    with Progress(100, "big", stream=out) as bar:
        bar.update(100)
    assert out.getvalue() == ""
    monkeypatch.setenv("FASTMAMBA_PROGRESS", "1")
    assert Progress(2, "tiny", stream=io.StringIO()).enabled


def test_progress_disabled_writes_nothing():
    out = _TTY()
    with Progress(100, "x", stream=out, enabled=False) as bar:
        bar.update(100)
    assert out.getvalue() == "" and bar.count == 100


def test_read_and_load_draw_progress(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FASTMAMBA_PROGRESS", "1")
    sd = make_checkpoint()
    load_into(TinyLM(), read_checkpoint(write_checkpoint(sd, tmp_path / "ckpt", "safetensors-sharded")))
    err = capsys.readouterr().err
    assert f"reading ckpt [####################] {len(sd)}/{len(sd)} tensors" in err
    assert f"loading weights [####################] {len(sd)}/{len(sd)} tensors" in err


# ---------------------------------------------------------------------------------------------
# corrupt files: the error names the file and says what is wrong


def _corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    path.write_bytes({"garbage": b"this is not a weight file at all", "empty": b"",
                      "truncated": data[: len(data) // 2]}[how])


@pytest.mark.parametrize("how", ["garbage", "empty", "truncated"])
@pytest.mark.parametrize("fmt", ["safetensors", "safetensors-sharded"])
def test_corrupt_safetensors_names_the_file(tmp_path, fmt, how):
    write_checkpoint(make_checkpoint(), tmp_path, fmt)
    bad = tmp_path / ("model.safetensors" if fmt == "safetensors" else "model-00002-of-00002.safetensors")
    _corrupt(bad, how)
    with pytest.raises(ValueError, match=rf"read_checkpoint: '{bad}' is not a readable safetensors file: \S"):
        read_checkpoint(tmp_path)


@pytest.mark.parametrize("how,reason", [
    ("garbage", r"torch.load: \S"), ("empty", "the file ends early"), ("truncated", r"torch.load: \S"),
])
@pytest.mark.parametrize("fmt", ["bin", "bin-sharded"])
def test_corrupt_bin_names_the_file(tmp_path, fmt, how, reason):
    write_checkpoint(make_checkpoint(), tmp_path, fmt)
    bad = tmp_path / ("pytorch_model.bin" if fmt == "bin" else "pytorch_model-00001-of-00002.bin")
    _corrupt(bad, how)
    with pytest.raises(ValueError, match=rf"read_checkpoint: '{bad}' is not a readable PyTorch checkpoint: {reason}"):
        read_checkpoint(tmp_path)


class _NotATensor:
    pass


def test_bin_with_python_objects_is_refused_with_reason(tmp_path):
    torch.save({"w": _NotATensor()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError) as e:
        read_checkpoint(tmp_path)
    msg = str(e.value)
    assert f"'{tmp_path / 'pytorch_model.bin'}' is not a readable PyTorch checkpoint" in msg
    assert "Python objects besides tensors" in msg and "_NotATensor" in msg and "\n" not in msg


@pytest.mark.parametrize("text", ["{not json", '{"version": "1.0"}', ""], ids=["bad-json", "not-a-tokenizer", "empty"])
def test_corrupt_tokenizer_names_the_file(tmp_path, text):
    pytest.importorskip("tokenizers")
    from fastmamba.generation.tokenizer import load_tokenizer

    assert load_tokenizer(tmp_path) is None  # no tokenizer.json: token ids only
    (tmp_path / "tokenizer.json").write_text(text)
    expected = rf"load_tokenizer: {tmp_path / 'tokenizer.json'} is not a valid tokenizer.json: \S"
    with pytest.raises(ValueError, match=expected):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------------------------------------
# load_model: dtype names, missing paths


TINY_HF_CONFIG = {"model_type": "mamba2", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256,
                  "state_size": 16, "head_dim": 16, "num_heads": 8, "n_groups": 1, "chunk_size": 16,
                  "tie_word_embeddings": True, "eos_token_id": 0}


def tiny_checkpoint(root: Path, *, dtype: torch.dtype = torch.float32) -> tuple[Path, dict[str, torch.Tensor]]:
    """The mamba2-tiny preset's random weights, saved as an HF-format checkpoint in ``dtype``."""
    import fastmamba

    model = fastmamba.load_model("mamba2-tiny", device="cpu")
    sd = {k: v.to(dtype).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    save_file(sd, str(root / "model.safetensors"))
    return root, sd


@pytest.mark.parametrize("dtype,expected", [
    (None, torch.bfloat16), ("auto", torch.bfloat16), ("float16", torch.float16), ("fp16", torch.float16),
    ("half", torch.float16), ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("BF16", torch.bfloat16),
    ("torch.float32", torch.float32), ("fp32", torch.float32), (torch.float16, torch.float16),
    (torch.float32, torch.float32),
])
def test_load_model_dtype_names(tmp_path, dtype, expected):
    import fastmamba

    path, sd = tiny_checkpoint(tmp_path / "ckpt", dtype=torch.bfloat16)
    model = fastmamba.load_model(path, dtype=dtype, device="cpu")
    assert model.dtype == expected and model.backbone.embeddings.weight.dtype == expected
    assert model.cfg.eos_token_ids == (0,)
    torch.testing.assert_close(model.backbone.layers[1].mixer.out_proj.weight,
                               sd["backbone.layers.1.mixer.out_proj.weight"].to(expected), atol=0, rtol=0)
    preset = fastmamba.load_model("mamba2-tiny", dtype=dtype, device="cpu")
    assert preset.dtype == (torch.float32 if dtype in (None, "auto") else expected)  # CPU default: fp32


@pytest.mark.parametrize("dtype,exc,match", [
    ("float64", ValueError, r"`dtype` 'float64' is not a supported dtype; expected one of float32 \(fp32\)"),
    ("int8", ValueError, r"`dtype` 'int8' is not a supported dtype"),
    (torch.float64, ValueError, r"`dtype` torch.float64 is not supported by the kernels"),
    (16, TypeError, r"`dtype` expected a torch.dtype or a name such as 'bf16', got int"),
])
def test_load_model_bad_dtype(dtype, exc, match):
    import fastmamba

    with pytest.raises(exc, match=rf"load_model: {match}"):
        fastmamba.load_model("mamba2-tiny", dtype=dtype, device="cpu")


def test_load_model_paths(tmp_path):
    import fastmamba

    with pytest.raises(FileNotFoundError, match=rf"'{tmp_path / 'nope'}' is neither a directory nor a preset; "
                                                r"presets \(random weights\): mamba2-tiny, mamba2-130m"):
        fastmamba.load_model(tmp_path / "nope", device="cpu")
    with pytest.raises(FileNotFoundError, match=r"did you mean 'mamba2-130m'\?"):
        fastmamba.load_model("mamba2-130M", device="cpu")
    with pytest.raises(FileNotFoundError, match=rf"no config.json in '{tmp_path}'"):
        fastmamba.load_model(tmp_path, device="cpu")
    path, _ = tiny_checkpoint(tmp_path / "ckpt")
    with pytest.raises(NotADirectoryError, match=rf"'{path / 'config.json'}' is a file; pass the checkpoint directory"):
        fastmamba.load_model(path / "config.json", device="cpu")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no weights in .*the directory holds: config.json"):
        fastmamba.load_model(path, device="cpu")


def test_load_model_bad_device():
    import fastmamba

    with pytest.raises(ValueError, match=r"load_model: `device` 'gpu0' is not a device"):
        fastmamba.load_model("mamba2-tiny", device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"`device` 'cuda' asks for CUDA but torch sees no CUDA GPU"):
            fastmamba.load_model("mamba2-tiny", device="cuda")
