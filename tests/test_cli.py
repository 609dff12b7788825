"""The ``fastmamba`` command line on first contact: one-line errors (exit 2, no traceback), ``--debug``
tracebacks, presets explained in ``generate --help`` and when they run, text through a checkpoint's
tokenizer. Tests call ``fastmamba.cli.main([...])`` in-process; one runs the real entry point."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastmamba
from fastmamba import cli
from fastmamba.models.config import PRESETS
from fastmamba.models.nemotron_h import PRESETS as NEMOTRON_H_PRESETS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_progress_bars(monkeypatch):
    monkeypatch.setenv("FASTMAMBA_PROGRESS", "0")


def run(argv, capsys):
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc, err, *fragments):
    assert rc == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fastmamba: error: "), err
    for f in fragments:
        assert f in lines[0], (f, err)


@pytest.fixture
def no_model_load(monkeypatch):
    """Errors the command line alone decides must come before the (slow, for big presets) model load."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the command line was checked")

    monkeypatch.setattr(fastmamba, "load_model", refuse)


def tiny_checkpoint(root: Path, *, tokenizer: bool) -> Path:
    """mamba2-tiny's random weights as an HF-format checkpoint; a word-level tokenizer w0..w255."""
    from safetensors.torch import save_file

    model = fastmamba.load_model("mamba2-tiny", device="cpu")
    c = PRESETS["mamba2-tiny"]
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({
        "model_type": "mamba2", "hidden_size": c.d_model, "num_hidden_layers": c.n_layer, "vocab_size": c.vocab_size,
        "state_size": c.d_state, "head_dim": c.headdim, "n_groups": c.ngroups, "chunk_size": c.chunk_size,
        "tie_word_embeddings": True}))
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
              str(root / "model.safetensors"))
    if tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers

        tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(c.vocab_size)}, unk_token="w0"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(root / "tokenizer.json"))
    return root


# ---------------------------------------------------------------------------------------------
# one-line errors


def test_missing_model_dir_is_one_line(tmp_path, capsys):
    rc, out, err = run(["generate", "--model", str(tmp_path / "nope"), "--prompt-ids", "1,2"], capsys)
    assert_one_line_error(rc, err, f"'{tmp_path / 'nope'}' is neither a directory nor a preset",
                          "presets (random weights): mamba2-tiny")
    assert out == ""


def test_debug_shows_the_traceback(tmp_path, capsys):
    for argv in (["--debug", "generate"], ["generate", "--debug"]):
        with pytest.raises(FileNotFoundError, match="is neither a directory nor a preset"):
            cli.main(argv + ["--model", str(tmp_path / "nope"), "--prompt-ids", "1"])


def test_debug_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTMAMBA_DEBUG", "1")
    with pytest.raises(FileNotFoundError):
        cli.main(["generate", "--model", str(tmp_path / "nope"), "--prompt-ids", "1"])


@pytest.mark.parametrize("config,fragment", [
    ({"hidden_size": 64, "num_hidden_layers": 2, "head_dim": 0, "vocab_size": 256},
     "'head_dim' expected an integer >= 1, got 0"),
    ({"hidden_size": 64, "num_hidden_layers": 2}, "required field 'vocab_size' is missing"),
    ({"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256, "use_conv_bias": "false"},
     "'use_conv_bias' expected true or false, got 'false'"),
], ids=["head_dim-0", "no-vocab_size", "conv-bias-str"])
def test_bad_config_is_one_line_naming_file_and_field(tmp_path, capsys, config, fragment):
    (tmp_path / "config.json").write_text(json.dumps(config))
    rc, _, err = run(["generate", "--model", str(tmp_path), "--prompt-ids", "1"], capsys)
    assert_one_line_error(rc, err, str(tmp_path / "config.json"), fragment)


def test_corrupt_weights_are_one_line(tmp_path, capsys):
    root = tiny_checkpoint(tmp_path / "ckpt", tokenizer=False)
    (root / "model.safetensors").write_bytes(b"\x00" * 7)
    rc, _, err = run(["generate", "--model", str(root), "--prompt-ids", "1"], capsys)
    assert_one_line_error(rc, err, f"'{root / 'model.safetensors'}' is not a readable safetensors file")


def test_corrupt_tokenizer_is_one_line(tmp_path, capsys):
    root = tiny_checkpoint(tmp_path / "ckpt", tokenizer=False)
    (root / "tokenizer.json").write_text("{broken")
    rc, _, err = run(["generate", "--model", str(root), "--prompt", "w1 w2"], capsys)
    assert_one_line_error(rc, err, f"{root / 'tokenizer.json'} is not a valid tokenizer.json")


@pytest.mark.parametrize("argv,fragments", [
    (["--model", "mamba2-2.7b", "--prompt", "hello"],
     ["--prompt needs a checkpoint with a tokenizer.json", "mamba2-2.7b is a preset", "random weights",
      "--prompt-ids"]),
    (["--model", "mamba2-tiny", "--prompt-ids", "1,x"], ["--prompt-ids expects comma-separated integers, got '1,x'"]),
    (["--model", "mamba2-tiny", "--prompt-ids", " , "], ["--prompt-ids holds no token ids"]),
    (["--model", "mamba2-tiny", "--prompt-ids", "3,-1"], ["--prompt-ids expects token ids >= 0"]),
    (["--model", "mamba2-tiny", "--prompt-ids", "1", "--temperature", "-1"], ["temperature", "-1"]),
    (["--model", "mamba2-tiny", "--prompt-ids", "1", "--top-p", "0"], ["top_p", "(0, 1]"]),
    (["--model", "mamba2-tiny", "--prompt-ids", "1", "--draft-model", "mamba2-tiny"],
     ["--draft-model goes with --speculate K --drafter model"]),
], ids=["prompt-with-preset", "ids-not-int", "ids-empty", "ids-negative", "temperature", "top-p", "draft-model"])
def test_command_line_errors_before_loading(capsys, no_model_load, argv, fragments):
    rc, _, err = run(["generate", *argv], capsys)
    assert_one_line_error(rc, err, *fragments)


def test_prompt_without_tokenizer_file(tmp_path, capsys, no_model_load):
    (tmp_path / "config.json").write_text("{}")
    rc, _, err = run(["generate", "--model", str(tmp_path), "--prompt", "hi"], capsys)
    assert_one_line_error(rc, err, f"--prompt needs {tmp_path / 'tokenizer.json'}, which does not exist")


@pytest.mark.parametrize("flag,value", [("--max-new-tokens", "0"), ("--batch", "-2"), ("--speculate", "-1"),
                                        ("--max-new-tokens", "x")])
def test_bad_numbers_are_usage_errors(capsys, no_model_load, flag, value):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", "mamba2-tiny", "--prompt-ids", "1", flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert re.search(rf"argument {flag}: expected an integer >= [01], got '?{re.escape(value)}'?", err), err


def test_runtime_bugs_still_show_a_traceback(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("an internal bug")

    monkeypatch.setattr(fastmamba, "load_model", boom)
    with pytest.raises(RuntimeError, match="an internal bug"):
        cli.main(["generate", "--model", "mamba2-tiny", "--prompt-ids", "1"])


# ---------------------------------------------------------------------------------------------
# help, presets, real runs


def test_generate_help_lists_presets(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for name in [*PRESETS, *NEMOTRON_H_PRESETS]:  # every family's presets, one line each
        family = "(Mamba-2|Nemotron-H hybrid|Nemotron-3 MoE hybrid)"
        assert re.search(rf"^  {re.escape(name)} +{family} +\d+ layers, d_model +\d+", out, re.M), name
        assert name in flat_usage(out)  # and in --model's help
    flat = " ".join(out.split())
    assert "RANDOM weights" in flat and "give the prompt as token ids (--prompt-ids 1,2,3)" in flat
    assert 'fastmamba generate --model ./mamba2-130m --prompt "The capital of France is"' in flat
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "--debug" in capsys.readouterr().out  # a top-level option (accepted after the sub-command too)


def flat_usage(text: str) -> str:
    return " ".join(text.split())


class _ScriptedEngine:
    """Stands in for the Engine (the real one runs in test_text_prompt_with_checkpoint_tokenizer):
    emits tokens 7, 9 for every request, then finishes."""

    ssm_dtype_source = "fp32 (default)"  # what the CLI's start-up line reads
    kv_cache_note = "none (no attention layers)"

    def __init__(self, model, max_batch, **kw):
        self.pending, self.rids = [[7, 9]], []

    def add_request(self, ids, params):
        self.rids.append(len(self.rids))
        return self.rids[-1]

    def has_unfinished(self):
        return bool(self.pending)

    def step(self):
        from fastmamba.generation.engine import StepOutput

        tokens = self.pending.pop()
        return [StepOutput(rid, t, i == len(tokens) - 1) for i, t in enumerate(tokens) for rid in self.rids]


def test_preset_run_says_random_weights(capsys, monkeypatch):
    from fastmamba.generation import engine

    monkeypatch.setattr(engine, "Engine", _ScriptedEngine)
    rc, out, err = run(["generate", "--model", "mamba2-tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "2",
                        "--device", "cpu"], capsys)
    assert rc == 0
    assert out == "7 9 \n"  # ids, streamed
    assert "mamba2-tiny is a preset: random weights" in err and "tokens below are ids" in err
    assert 'fastmamba generate --model DIR --prompt "..."' in err


def test_text_prompt_with_checkpoint_tokenizer(tmp_path, capsys):
    root = tiny_checkpoint(tmp_path / "ckpt", tokenizer=True)
    rc, out, err = run(["generate", "--model", str(root), "--prompt", "w5 w7 w9", "--max-new-tokens", "1",
                        "--device", "cpu"], capsys)
    assert rc == 0, err
    assert re.fullmatch(r"w\d+\n", out), out  # the token as text, not an id
    assert "is a preset" not in err
    model = fastmamba.load_model(root, device="cpu")  # the same greedy token as the model's own argmax
    expected = model(torch.tensor([[5, 7, 9]]))[0, -1].argmax().item()
    assert out.strip() == f"w{expected}"


def test_entry_point_prints_one_line(tmp_path):
    """The real process: ``python -m fastmamba.cli`` exits 2 with one stderr line, no traceback."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "fastmamba.cli", "generate", "--model", str(tmp_path / "x"),
                           "--prompt-ids", "1"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"fastmamba: error: load_model: '{tmp_path / 'x'}' is neither a directory nor a preset; presets "
        f"(random weights): {', '.join([*PRESETS, *NEMOTRON_H_PRESETS])}"]


# ---------------------------------------------------------------------------------------------
# the parser: light, versioned, every preset, dtype names, Hub ids


def cli_process(*argv: str, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, *extra, "-m", "fastmamba.cli", *argv], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


def test_version():
    proc = cli_process("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"fastmamba {fastmamba.__version__}", proc


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["serve", "--help"], ["--version"]],
                         ids=["help", "generate-help", "serve-help", "version"])
def test_help_imports_no_torch_and_answers_in_well_under_a_second(argv):
    import time

    proc = cli_process(*argv, extra=("-X", "importtime"))
    assert proc.returncode == 0, proc.stderr
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert not {"torch", "triton", "numpy", "fastapi"} & imported
    best = float("inf")
    for _ in range(3):  # the best of three: a loaded CI machine may stall one start
        t0 = time.perf_counter()
        assert cli_process(*argv).returncode == 0
        best = min(best, time.perf_counter() - t0)
    assert best < 1.0, f"fastmamba {' '.join(argv)} took {best:.2f} s"


def test_bench_still_parses_its_targets(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--help"])
    assert e.value.code == 0 and "kernels" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # a target's own options
        cli.main(["--debug", "bench", "e2e", "--help"])
    assert e.value.code == 0 and "--gen-len" in capsys.readouterr().out


def test_generate_help_names_the_dtypes(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    flat = flat_usage(capsys.readouterr().out)
    for name in ("auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32"):
        assert re.search(rf"\b{name}\b", flat), name


@pytest.mark.parametrize("dtype", ["bfloat16", "auto", "float32"])
def test_generate_takes_load_models_dtype_names(capsys, dtype):
    rc, out, err = run(["generate", "--model", "mamba2-tiny", "--prompt-ids", "1,2", "--max-new-tokens", "1",
                        "--device", "cpu", "--dtype", dtype], capsys)
    assert rc == 0 and len(out.split()) == 1, err
    rc, _, err = run(["generate", "--model", "mamba2-tiny", "--prompt-ids", "1", "--dtype", "float64"], capsys)
    assert_one_line_error(rc, err, "'float64' is not a supported dtype", "bfloat16 (bf16)", "'auto'")


def test_hub_id_is_answered_with_how_to_download_it(capsys, no_model_load):
    rc, _, err = run(["generate", "--model", "state-spaces/mamba2-130m", "--prompt", "hi"], capsys)
    assert_one_line_error(rc, err, "'state-spaces/mamba2-130m' is not a local directory",
                          "it looks like a Hugging Face Hub id",
                          "huggingface-cli download state-spaces/mamba2-130m --local-dir ./mamba2-130m",
                          "--model ./mamba2-130m")
    assert "did you mean" not in err
    rc, _, err = run(["generate", "--model", "mamba2-tiny", "--prompt-ids", "1", "--speculate", "2", "--drafter",
                      "model", "--draft-model", "state-spaces/mamba2-130m"], capsys)
    assert_one_line_error(rc, err, "--local-dir ./mamba2-130m), then pass --draft-model ./mamba2-130m")
