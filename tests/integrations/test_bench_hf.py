"""``python -m fastmamba.bench hf`` at a tiny shape on the CPU: the table and JSON rows for every
batch and provider, fastmamba's greedy tokens equal to the torch path's (fp32), and the torch-path
switch that the GPU run needs to separate transformers' torch code from mamba_ssm's."""
from __future__ import annotations

import json

import pytest
import torch

from fastmamba.bench.targets import main

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def references(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a generate loop: the ops' PyTorch references


@pytest.mark.parametrize("preset", ["mamba2-tiny", "nemotron-3-tiny"])
def test_bench_hf_table_and_rows(preset, tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    # the providers named: on a GPU machine the default list adds mamba_ssm's row, and a default row
    # where transformers' hooks resolved to mamba_ssm (an earlier test in the process may have loaded
    # mamba_ssm's model as a peer, after which `import mamba_ssm` works)
    rc = main(["hf", "--model", preset, "--batch", "1,2", "--new-tokens", "3", "--prompt-len", "5", "--dtype", "fp32",
               "--providers", "torch,fastmamba-eager,fastmamba", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["batch"], r["provider"]) for r in rows] == [(b, p) for b in (1, 2)
                                                           for p in ("torch", "fastmamba-eager", "fastmamba")]
    for r in rows:
        assert r["model"] == preset and r["new_tokens"] == 3 and r["dtype"] == "float32"
        assert r["seconds"] > 0 and r["tok_s"] == pytest.approx(r["batch"] * 3 / r["seconds"])
        assert r["same_tokens_as_torch"] == 1.0  # fp32: the provider's greedy tokens are transformers'
        assert r["logits_rel_err_vs_torch"] <= 1e-4
        assert f"| {preset} | float32 | {r['batch']} | {r['provider']} |" in text
    assert rows[0]["transformers"] == transformers.__version__
    if not torch.cuda.is_available():  # transformers sends CPU tensors to its torch code whatever imported
        assert rows[0]["default_ops"] == "torch"


def test_bench_hf_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["hf", "--providers", "cuda"])
    assert main(["hf", "--model", "mamba2-tiny", "--new-tokens", "0"]) == 2
    assert "--new-tokens must be >= 1" in capsys.readouterr().err


def test_force_torch_path_switches_and_restores(tmp_path):
    """The torch row forces transformers' PyTorch code behind the four function hooks (per mixer
    where kernels gives mixers their wrappers, else in the modeling module) and puts it back."""
    import inspect

    from fastmamba.bench.hf_provider import force_torch_path, release_torch_path, write_checkpoint
    from transformers.models.mamba2 import modeling_mamba2 as mm

    write_checkpoint("mamba2-tiny", str(tmp_path), torch.float32, torch.device("cpu"))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, use_kernels=False).eval()
    module_before = {n: getattr(mm, n) for n in ("causal_conv1d_fn", "mamba2_chunk_scan")}
    ids = torch.randint(1, 200, (2, 5))
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=3, do_sample=False)
        changed = force_torch_path(model)
        kinds = {kind for kind, _, _ in changed}
        if kinds == {"instance"}:
            assert len(changed) == 4 * model.config.num_hidden_layers
            assert all("forward" in w.__dict__ for _, w, _ in changed)
        else:
            assert kinds == {"module"} and len(changed) == 4
            assert mm.mamba2_chunk_scan is inspect.unwrap(mm.mamba2_chunk_scan)  # the plain torch function
        assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), ref)
        release_torch_path(changed)
    assert not any("forward" in w.__dict__ for kind, w, _ in changed if kind == "instance")
    assert {n: getattr(mm, n) for n in module_before} == module_before


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the row exists")
def test_bench_hf_mamba_ssm_row_needs_a_gpu(tmp_path, capsys):
    """The mamba_ssm row (its Triton scan ops in transformers' hooks) is left out on a CPU, saying why."""
    rc = main(["hf", "--model", "mamba2-tiny", "--batch", "1", "--new-tokens", "2", "--prompt-len", "4",
               "--dtype", "fp32", "--providers", "torch,mamba_ssm"])
    assert rc == 0
    cap = capsys.readouterr()
    assert "no mamba_ssm row: mamba_ssm's Triton ops need a CUDA device" in cap.err
    assert "| torch |" in cap.out and "| mamba_ssm |" not in cap.out


def test_forced_hooks_run_the_override_and_are_released(tmp_path):
    """force_torch_path with overrides: the scan hook runs the given function (called with only the
    keyword arguments it declares, as transformers calls mamba_ssm's), the other hooks transformers'
    torch code; release_torch_path restores the hooks."""
    import math

    import torch

    from fastmamba.bench.hf_provider import force_torch_path, release_torch_path
    from fastmamba.integrations import hf_ops
    from tests.integrations import tiny_hf

    model = tiny_hf.load(tiny_hf.build("mamba2", tmp_path / "ckpt"))
    ids, mask = tiny_hf.prompts(1)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
    seen = []

    def scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, dt_softplus=False,
             dt_limit=(0.0, math.inf), return_final_states=False):  # mamba_ssm's keywords, no **kwargs
        seen.append(x.shape)
        return hf_ops.chunk_scan(x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_softplus, dt_limit,
                                 return_final_states, z=z)

    before = [w.__dict__.get("forward") for m in model.modules() for w in getattr(m, "_kernel_funcs", {}).values()]
    changed = force_torch_path(model, {"mamba_chunk_scan_combined": scan})
    try:
        with torch.no_grad():
            got = model(ids, attention_mask=mask).logits
    finally:
        release_torch_path(changed)
    assert len(seen) == model.config.num_hidden_layers
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    after = [w.__dict__.get("forward") for m in model.modules() for w in getattr(m, "_kernel_funcs", {}).values()]
    assert after == before
