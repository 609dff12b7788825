"""The dtypes of a model's caches (issue 52): the SSM state dtype follows config.json's
``mamba_ssm_cache_dtype`` unless the user chooses one (``Engine(ssm_dtype=)``, ``--ssm-dtype``),
with stochastic rounding for 16-bit states either way; the K/V page dtype is the model's setting
(float8 for a checkpoint with K/V scales) unless ``kv_cache_dtype`` / ``--kv-cache-dtype`` says;
the engine, the CLI and the server's start-up line say which and why."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import SamplingParams
from fastmamba.models.checkpoint_config import ssm_cache_dtype_of, ssm_state_dtype
from fastmamba.models.nemotron_h import PRESETS, NemotronHConfig, NemotronHLM, random_init
from fastmamba.models.quantization import KV_CACHE_DTYPES
from fastmamba.ops._common.dispatch import interpreter_enabled

INTERPRETER_AT_START = interpreter_enabled()  # Triton reads TRITON_INTERPRET once, at import

TINY = PRESETS["nemotron-h-tiny"]


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the model tests' rule: the ops' PyTorch paths


def tiny(**cfg_change) -> NemotronHLM:
    return random_init(NemotronHLM(dataclasses.replace(TINY, **cfg_change), device="cpu", dtype=torch.float32)).eval()


def engine(model, **kw) -> Engine:
    return Engine(model, max_batch=2, max_seq_len=32, kv_page_size=4, **kw)


@pytest.mark.parametrize("value, want", [("float32", "fp32"), ("bfloat16", "bf16"), ("float16", "fp16"),
                                         ("torch.bfloat16", "bf16"), (None, None)])
def test_mamba_ssm_cache_dtype_is_read(value, want):
    assert ssm_cache_dtype_of({"mamba_ssm_cache_dtype": value}) == want
    raw = {"model_type": "nemotron_h", "vocab_size": 64, "hidden_size": 32, "hybrid_override_pattern": "M*",
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "mamba_num_heads": 4,
           "mamba_head_dim": 8, "n_groups": 1, "ssm_state_size": 8, "mamba_ssm_cache_dtype": value}
    assert NemotronHConfig.from_dict(raw).ssm_cache_dtype == want


@pytest.mark.parametrize("value", ["float8", 16, "int8"])
def test_bad_mamba_ssm_cache_dtype_is_named(value):
    with pytest.raises(ValueError, match=r"NemotronHConfig: config.json: 'mamba_ssm_cache_dtype' expected one of "
                                         r"'float32', 'bfloat16', 'float16', got"):
        ssm_cache_dtype_of({"mamba_ssm_cache_dtype": value})


def test_ssm_state_dtype_rule():
    ckpt = dataclasses.replace(TINY, ssm_cache_dtype="fp16")
    assert ssm_state_dtype(TINY) == (torch.float32, "fp32 (default)")
    assert ssm_state_dtype(ckpt) == (torch.float16, "fp16 (config.json mamba_ssm_cache_dtype)")
    assert ssm_state_dtype(ckpt, torch.float32) == (torch.float32, "fp32 (chosen)")  # the user's wins
    assert ssm_state_dtype(ckpt, "bf16") == (torch.bfloat16, "bf16 (chosen)")
    with pytest.raises(ValueError, match="ssm_dtype: expected torch.float32, torch.bfloat16 or torch.float16"):
        ssm_state_dtype(ckpt, torch.float64)


def test_engine_follows_the_checkpoints_ssm_dtype_unless_chosen():
    model = tiny(ssm_cache_dtype="bf16")
    eng = engine(model)
    assert eng.cache.ssm[0].dtype == torch.bfloat16 and eng.ssm_dtype == torch.bfloat16 and eng.config.ssm_dtype is None
    assert eng.ssm_dtype_source == "bf16 (config.json mamba_ssm_cache_dtype)"
    rounded = engine(model, stochastic_rounding=True)  # 16-bit states from the checkpoint: rounding allowed
    assert rounded.rounding is not None and rounded.cache.ssm[0].dtype == torch.bfloat16
    out = rounded.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(out[0]) == 3
    chosen = engine(model, ssm_dtype=torch.float32)
    assert chosen.cache.ssm[0].dtype == torch.float32 and chosen.ssm_dtype_source == "fp32 (chosen)"
    plain = tiny()
    assert engine(plain).cache.ssm[0].dtype == torch.float32
    with pytest.raises(ValueError, match="stochastic_rounding=True rounds 16-bit SSM states"):
        engine(plain, stochastic_rounding=True)  # the checkpoint's fp32 (default) is not 16-bit


def test_engine_kv_cache_dtype_option():
    model = tiny()
    eng = engine(model)
    assert eng.cache.kv.k[0].dtype == torch.float32 and eng.kv_cache_note == "float32 (the model's dtype)"
    fp8 = engine(model, kv_cache_dtype="fp8")
    assert {t.dtype for t in fp8.cache.kv.k + fp8.cache.kv.v} == {torch.float8_e4m3fn}
    assert fp8.kv_cache_note == "float8_e4m3fn (k_scale = v_scale = 1.0: the checkpoint ships no K/V scales)"
    out = fp8.generate([[5, 6, 7, 8, 9]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(out[0]) == 3
    # the engine set the model's choice: a later engine without the option keeps it, "auto" undoes it
    assert engine(model).cache.kv.k[0].dtype == torch.float8_e4m3fn
    assert engine(model, kv_cache_dtype="auto").cache.kv.k[0].dtype == torch.float32
    with pytest.raises(ValueError, match="Engine: kv_cache_dtype must be None or one of"):
        engine(model, kv_cache_dtype="e5m2")


def test_cli_says_which_dtypes(capsys):
    from fastmamba import cli

    assert cli.KV_CACHE_DTYPES == KV_CACHE_DTYPES  # spelled out there (no torch import in the parser)
    from fastmamba.serve import cli as serve_cli

    assert serve_cli.KV_CACHE_DTYPES == KV_CACHE_DTYPES
    rc = cli.main(["generate", "--model", "nemotron-h-tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "2",
                   "--device", "cpu", "--kv-cache-dtype", "fp8", "--ssm-dtype", "bf16", "--stochastic-rounding"])
    err = capsys.readouterr().err
    assert rc == 0
    assert "[SSM states bf16 (chosen); K/V pages float8_e4m3fn (k_scale = v_scale = 1.0" in err
    rc = cli.main(["generate", "--model", "nemotron-h-tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "2",
                   "--device", "cpu"])
    assert rc == 0 and "[SSM states fp32 (default); K/V pages float32 (the model's dtype)]" in capsys.readouterr().err


def test_server_start_up_line_names_the_dtypes():
    from fastmamba.serve.worker import describe_engine, log_lines

    info = describe_engine(engine(tiny(ssm_cache_dtype="fp16"), kv_cache_dtype="fp8"))
    line = log_lines(info, "tiny")
    assert "SSM states fp16 (config.json mamba_ssm_cache_dtype)" in line
    assert "K/V pages float8_e4m3fn (k_scale = v_scale = 1.0" in line


def test_capacity_plans_float8_pages_at_one_byte(tmp_path):
    """The capacity planner counts what the caches will hold: a loaded model's meta twin keeps its
    K/V page dtype (an fp32 model's float8 page costs a quarter), and the server's plan, made from
    config.json before any weight is read, sees an FP8-K/V checkpoint's choice or --kv-cache-dtype."""
    from fastmamba.generation.capacity import meta_model, meta_twin, per_request_bytes
    from fastmamba.models.quantization import plan_kv_cache_dtype, set_kv_cache_dtype
    from tests.models.test_fp8_checkpoints import write_checkpoint

    model = tiny()
    slot32, page32 = per_request_bytes(meta_twin(model))
    set_kv_cache_dtype(model, "fp8")
    slot8, page8 = per_request_bytes(meta_twin(model))
    assert page8 * 4 == page32 and slot8 == slot32
    root = tmp_path / "ckpt"
    write_checkpoint(root, "modelopt-fp8")  # kv_cache_quant_algo FP8 in hf_quant_config.json
    meta = meta_model(str(root))
    _, page16 = per_request_bytes(meta)
    assert plan_kv_cache_dtype(meta, root, None) == "float8_e4m3fn (k_scale / v_scale from the checkpoint)"
    assert per_request_bytes(meta)[1] * 2 == page16
    assert plan_kv_cache_dtype(meta, root, "bf16") == "bfloat16 (the model's dtype)"
    assert per_request_bytes(meta)[1] == page16


@pytest.mark.skipif(not INTERPRETER_AT_START,
                    reason="the Triton kernels run on the CPU only with TRITON_INTERPRET=1 set before Python starts")
def test_fp8_pages_through_the_triton_kernels(monkeypatch):
    """The tiny hybrid with float8 pages and scales other than 1 on the real kernels (interpreter):
    greedy tokens through the engine (prefill kernel, decode kernel, chunked prefill over cached
    float8 context) equal greedy full forwards, which round K and V through e4m3 the same way. The
    full forwards are the yardstick and run the ops' references (this module's rule; on the
    interpreter they took 17 of the test's 29 s); the engine runs the kernels."""
    from fastmamba.models.quantization import set_kv_cache_dtype
    from tests.generation.test_engine_hybrid import build_model, greedy_reference

    model = build_model()
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8]]
    with torch.no_grad():
        plain = model(torch.tensor([prompts[0]]))
    set_kv_cache_dtype(model, "fp8")
    for block in model.backbone.layers:
        if block.kind == "*":
            block.mixer.k_scale.fill_(0.02)  # scales other than 1 (values beyond 448 x scale saturate, in
            block.mixer.v_scale.fill_(0.005)  # the forward as in the pages)
    with torch.no_grad():
        assert not torch.allclose(model(torch.tensor([prompts[0]])), plain, atol=1e-4)  # the rounding shows
    want = [greedy_reference(model, p, 4) for p in prompts]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # chunks of 4 take all three kernels: the first chunk is a prefill with no context, the later ones
    # read the float8 pages the first wrote, then decode steps (unchunked adds no kernel path)
    eng = Engine(model, max_batch=2, max_seq_len=32, kv_page_size=4, prefill_chunk=4)
    assert eng.cache.kv.k[0].dtype == torch.float8_e4m3fn
    assert eng.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True)) == want


def test_serve_kv_cache_dtype_flag_reaches_the_engine():
    """``fastmamba serve --kv-cache-dtype fp8``: parsed (a bad value is argparse's error) and handed to
    the engine process's ``build_engine`` with the other Engine options."""
    import argparse

    from fastmamba.serve import cli as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    assert parser.parse_args(["--model", "m", "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    assert parser.parse_args(["--model", "m"]).kv_cache_dtype is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--kv-cache-dtype", "int8"])
    eng = serve_cli.build_engine("nemotron-h-tiny", None, "cpu", {"max_batch": 1, "cuda_graphs": False,
                                                                   "kv_cache_dtype": "fp8"})
    assert eng.cache.kv.k[0].dtype == torch.float8_e4m3fn


def test_fp8_pages_speculative_verify_keeps_greedy_tokens():
    """Speculative decoding over float8 pages (verify writes the drafts' K/V, the rejected ones are
    rolled back): the same greedy tokens as plain decoding over the same pages."""
    from tests.generation.test_engine_hybrid import build_model

    model = build_model()
    prompts = [[3, 1, 4, 1, 3, 1, 4, 1, 3, 1], [2, 7, 2, 7, 2, 7, 2]]  # repeats: the n-gram drafter drafts
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    plain = engine(model, kv_cache_dtype="fp8")
    want = plain.generate(prompts, params)
    spec = engine(model, kv_cache_dtype="fp8", speculate=2)
    assert spec.cache.kv.k[0].dtype == torch.float8_e4m3fn
    assert spec.generate(prompts, params) == want
    assert spec.stats["drafts_proposed"] > 0


def test_bench_e2e_kv_cache_dtype(tmp_path, capsys):
    """``bench e2e --kv-cache-dtype fp8`` on a hybrid preset: the header and rows say which pages,
    and a step's bytes count the K/V at one byte (the roofline the tok/s are held to)."""
    import json

    from fastmamba.bench import targets

    def rows(name, extra):
        path = tmp_path / f"{name}.jsonl"
        argv = ["e2e", "--model", "nemotron-h-tiny", "--batch", "1", "--gen-len", "2", "--prompt-len", "4",
                "--json", str(path), *extra]
        assert targets.main(argv) == 0
        return [json.loads(line) for line in path.read_text().splitlines()]

    (plain,) = rows("plain", [])
    (fp8,) = rows("fp8", ["--kv-cache-dtype", "fp8"])
    assert "K/V pages float8_e4m3fn (k_scale = v_scale = 1.0" in capsys.readouterr().out
    model_dtype = "bfloat16" if torch.cuda.is_available() else "float32"  # the bench's default dtype there
    assert plain["kv_cache"] == f"{model_dtype} (the model's dtype)" and fp8["kv_cache"].startswith("float8_e4m3fn")
    assert 0 < fp8["step_bytes"] < plain["step_bytes"] and fp8["decode_tok_s"] > 0
    assert targets.main(["e2e", "--model", "mamba2-tiny", "--batch", "1", "--gen-len", "2", "--prompt-len", "4",
                         "--kv-cache-dtype", "fp8"]) == 2  # no attention layers: said, not ignored
    assert "--kv-cache-dtype: kv_cache_dtype: 'fp8' sets the dtype of K/V pages" in capsys.readouterr().err
