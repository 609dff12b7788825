"""``fastmamba serve`` flags: every bad value ends the command with one line,
``fastmamba serve: error: ...`` naming the flag, and status 2, before a port is bound or the model
loads; the dtype names ``load_model`` takes are accepted."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")

from fastmamba.serve import cli as serve_cli

BAD = [
    (["--port", "70000"], "--port"), (["--port", "-1"], "--port"), (["--port", "0"], "--port"),
    (["--host", "256.0.0.1"], "--host"), (["--host", "bad host!"], "--host"), (["--host", "::zz"], "--host"),
    (["--max-waiting", "0"], "--max-waiting"), (["--max-waiting", "-1"], "--max-waiting"),
    (["--max-model-len", "0"], "--max-model-len"), (["--max-model-len", "-5"], "--max-model-len"),
    (["--max-batch", "0"], "--max-batch"), (["--prefill-chunk", "-1"], "--prefill-chunk"),
    (["--tokenizer", "/nonexistent"], "--tokenizer"), (["--api-key", ""], "--api-key"),
    (["--api-key", "  "], "--api-key"),
    (["--prefix-cache-gb", "nan"], "--prefix-cache-gb"), (["--prefix-cache-gb", "inf"], "--prefix-cache-gb"),
    (["--prefix-cache-gb", "-1"], "--prefix-cache-gb"), (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["--shutdown-timeout", "nan"], "--shutdown-timeout"), (["--dtype", "float64"], "--dtype"),
    (["--chat-template", "/nonexistent.jinja"], "--chat-template"), (["--num-kv-pages", "0"], "--num-kv-pages"),
    (["--served-model-name", ""], "--served-model-name"),
    (["--quantization", "fp8", "--tensor-parallel-size", "2", "--device", "cpu"], "--quantization fp8 with"),
]


@pytest.fixture
def nothing_starts(monkeypatch):
    """A bad flag must be reported before a port is bound or the engine process starts."""
    def refuse(*a, **k):
        raise AssertionError("a port was bound or the engine started before the flags were checked")

    monkeypatch.setattr(serve_cli, "bind", refuse)
    monkeypatch.setattr(serve_cli, "build_app", refuse)


def assert_one_line(rc: int, err: str, flag: str) -> None:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastmamba serve: error: "), err
    assert flag in lines[0] and "Traceback" not in err


@pytest.mark.parametrize("argv, flag", BAD, ids=[" ".join(a) or "empty" for a, _ in BAD])
def test_bad_flag_is_one_line(argv, flag, capsys, nothing_starts):
    rc = serve_cli.main(["--model", "mamba2-tiny", *argv])
    assert_one_line(rc, capsys.readouterr().err, flag)


def test_tokenizer_dir_without_tokenizer_json(tmp_path, capsys, nothing_starts):
    rc = serve_cli.main(["--model", "mamba2-tiny", "--tokenizer", str(tmp_path)])
    err = capsys.readouterr().err
    assert_one_line(rc, err, "--tokenizer")
    assert "tokenizer.json" in err
    (tmp_path / "f").write_text("x")
    rc = serve_cli.main(["--model", "mamba2-tiny", "--tokenizer", str(tmp_path / "f")])
    assert_one_line(rc, capsys.readouterr().err, "--tokenizer")


def test_through_the_fastmamba_command(capsys, nothing_starts):
    from fastmamba import cli

    rc = cli.main(["serve", "--model", "mamba2-tiny", "--port", "70000"])
    assert_one_line(rc, capsys.readouterr().err, "--port")


def test_taken_port_is_one_line_before_the_model_loads(capsys, monkeypatch):
    """Also where a capacity plan is made (a GPU's memory; here given by flag), whose log line
    would otherwise come first: the port is bound before anything is planned."""
    def refuse(*a, **k):
        raise AssertionError("the engine started although the port is taken")

    monkeypatch.setattr(serve_cli, "build_app", refuse)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        rc = serve_cli.main(["--model", "mamba2-tiny", "--port", str(s.getsockname()[1]), "--device-memory-gib", "80"])
    err = capsys.readouterr().err
    assert_one_line(rc, err, "--host/--port")
    assert "in use" in err


@pytest.mark.parametrize("dtype", ["bfloat16", "bf16", "auto", "float32", "torch.float16"])
def test_load_model_dtype_names_are_accepted(dtype, monkeypatch):
    args = serve_cli.argparse.ArgumentParser()
    serve_cli.add_arguments(args)
    serve_cli.check_args(args.parse_args(["--model", "mamba2-tiny", "--dtype", dtype]))


def test_quantization_reaches_the_engine_and_the_plan(monkeypatch):
    """--quantization fp8: the engine process loads FP8 weights (block by block), and the capacity
    plan is made with the FP8 model's bytes (``meta_model(..., quantization="fp8")``)."""
    from fastmamba.layers.fp8_linear import FP8Linear

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    engine = serve_cli.build_engine("nemotron-3-tiny", "float32", "cpu", {"max_batch": 1, "cuda_graphs": False},
                                    quantization="fp8")
    assert any(isinstance(m, FP8Linear) for m in engine.model.modules())
    from fastmamba.generation import capacity

    seen = {}
    real = capacity.meta_model

    def spy(*a, **kw):
        seen.update(kw)
        return real(*a, **kw)
    monkeypatch.setattr(capacity, "meta_model", spy)
    args = serve_cli.argparse.ArgumentParser()
    serve_cli.add_arguments(args)
    parsed = args.parse_args(["--model", "nemotron-3-tiny", "--quantization", "fp8", "--device", "cpu",
                              "--device-memory-gib", "8"])
    serve_cli.check_args(parsed)
    assert serve_cli.plan_serving(parsed) is not None and seen.get("quantization") == "fp8"


def test_bfloat16_engine(monkeypatch):
    """--dtype bfloat16 reaches load_model as it is named (the engine process's build)."""
    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    engine = serve_cli.build_engine("mamba2-tiny", "bfloat16", "cpu", {"max_batch": 1, "cuda_graphs": False})
    assert engine.model.lm_head.weight.dtype == torch.bfloat16


def test_real_entry_point_exits_2_before_loading():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "fastmamba.serve", "--model", "mamba2-2.7b", "--port", "70000"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert_one_line(r.returncode, r.stderr, "--port")
    assert "70000" in r.stderr


def test_kv_sizing_clamps_to_memory(monkeypatch):
    """A hybrid's K/V: every slot at the length while memory allows; else the pages that fit (a
    default length shrinks to them, an explicit --max-model-len that one request cannot fit is an
    error naming it); a pure Mamba-2 model has no K/V options."""
    import fastmamba
    from fastmamba.cache.kv_pages import KVPages

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    lm = fastmamba.load_model("nemotron-h-tiny", device="cpu", dtype="fp32")
    c = lm.cfg
    page = KVPages.page_bytes(c.pattern.count("*"), 16, c.n_kv_heads, c.head_dim, lm.lm_head.weight.dtype)
    monkeypatch.setattr(serve_cli, "_free_bytes", lambda device: 10**12)
    assert serve_cli.kv_options(lm, 4, 8192, None, 0) == {"max_seq_len": 8192, "kv_page_size": 16, "kv_num_pages": 2048}
    # --num-kv-pages 10: a tight pool; the default length shrinks to what 10 pages hold
    assert serve_cli.kv_options(lm, 4, None, 10, 0) == {"max_seq_len": 160, "kv_page_size": 16, "kv_num_pages": 10}
    fits = 40  # pages
    monkeypatch.setattr(serve_cli, "_free_bytes", lambda device: int(fits * page / serve_cli.KV_MEMORY_FRACTION) + 1)
    got = serve_cli.kv_options(lm, 4, None, None, 0)
    assert got["kv_num_pages"] == fits and got["max_seq_len"] == min(fits * 16, serve_cli.DEFAULT_KV_LEN)
    with pytest.raises(ValueError, match="--max-model-len 8192"):
        serve_cli.kv_options(lm, 4, 8192, None, 0)
    assert serve_cli.kv_options(fastmamba.load_model("mamba2-tiny", device="cpu"), 4, 8192, None, 0) == {}


def test_plan_on_a_cuda_device_times_the_cards_memory_query(monkeypatch):
    """On a CUDA device (its memory query stubbed here: no GPU on CI) the plan asks the card's total
    memory once and keeps how long that took for the start-up log's timing line."""
    import torch

    asked = []
    monkeypatch.setattr(serve_cli, "_cuda_total_bytes", lambda device: asked.append(device) or 8 << 30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (the device check; nothing touches CUDA)
    monkeypatch.delenv("FASTMAMBA_DEVICE_MEMORY_GIB", raising=False)
    parser = serve_cli.argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    parsed = parser.parse_args(["--model", "nemotron-h-tiny", "--device", "cuda", "--dtype", "fp32"])
    serve_cli.check_args(parsed)
    plan = serve_cli.plan_serving(parsed)
    assert plan is not None and [d.type for d in asked] == ["cuda"]
    assert isinstance(parsed.card_memory_query_s, float) and parsed.card_memory_query_s >= 0
    assert serve_cli.plan_timing_line(2.04, parsed.card_memory_query_s) == (
        "fastmamba serve: capacity plan made in 2.0 s (torch's import included; the card's memory asked in a "
        f"child process in {parsed.card_memory_query_s:.1f} s)")
    assert serve_cli.plan_timing_line(2.04, None) == ("fastmamba serve: capacity plan made in 2.0 s "
                                                      "(torch's import included)")


def test_device_cuda_without_a_gpu_is_one_line():
    """``--device cuda`` where torch sees no CUDA GPU: one line naming --device, before the port is
    bound or anything loads (it was a traceback from the card's memory query)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTMAMBA_DEVICE_MEMORY_GIB")}
    r = subprocess.run([sys.executable, "-m", "fastmamba.serve", "--model", "nemotron-h-tiny", "--device", "cuda",
                        "--port", "1"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "fastmamba serve: error: --device: `device` 'cuda' asks for CUDA but torch sees no CUDA GPU; use "
        "device='cpu' (the kernels then need TRITON_INTERPRET=1)"], r.stderr
