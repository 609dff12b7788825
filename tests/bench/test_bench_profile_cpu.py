"""bench profile (CPU): the decode mode's arguments, its tables from a trace's kernel events, and the
refusal without a GPU (the profile itself runs on a GPU: ``python -m fastmamba.bench profile decode``)."""
from __future__ import annotations

import collections
import json

import pytest
import torch

from fastmamba.bench import prefill_profile as profile
from fastmamba.bench import targets

# (name, start µs, duration µs): three kernels of one step, 2 µs and 1 µs apart
EVENTS = [("_gate_kernel", 100.0, 3.0), ("_up_gemv_kernel", 105.0, 20.0), ("_down_gemv_kernel", 126.0, 24.0),
          ("_gate_kernel", 152.0, 3.0)]


def test_summary_and_timeline_tables():
    lines = profile.summary(EVENTS, top=2)
    assert lines[0].startswith("kernels 4, span 0.055 ms, busy 0.050 ms, idle between kernels 0.005 ms (1.67 µs a gap)")
    assert lines[3] == "| _down_gemv_kernel | 1 | 24.0 | 24.00 | 48.0% |" and len(lines) == 5  # top 2 names
    rows = profile.timeline(EVENTS, 3)
    assert rows[2:] == ["| 0 | _gate_kernel | 0.0 | 3.00 | 0.00 |", "| 1 | _up_gemv_kernel | 5.0 | 20.00 | 2.00 |",
                        "| 2 | _down_gemv_kernel | 26.0 | 24.00 | 1.00 |"]


def test_kernel_events_reads_a_chrome_trace(tmp_path):
    trace = {"traceEvents": [{"cat": "kernel", "name": n, "ts": s, "dur": d} for n, s, d in reversed(EVENTS)]
             + [{"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 90.0, "dur": 5.0}]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    assert profile.kernel_events(str(path)) == EVENTS


def test_decode_mode_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without a GPU (on one, `profile decode` runs the full-size default)")
    assert targets.main(["profile", "decode", "--batch", "2", "--context", "16", "--timeline", "10"]) == 2
    assert "bench profile needs a CUDA GPU" in capsys.readouterr().err


def test_decode_steps_on_a_cpu_model(monkeypatch, capsys):
    """profile_decode's own steps (cache, prefill, the host's page growth, greedy steps) on the tiny
    presets, with the graph replaced by the eager decode and the trace by the events above."""
    import fastmamba
    import fastmamba.generation.cuda_graphs as cuda_graphs

    class EagerDecoder:
        def __init__(self, model, cache, max_batch, *, pdl=None):
            self.model, self.cache, self.pdl = model, cache, bool(pdl)

        def decode(self, tokens, slots):
            return self.model.decode(tokens, self.cache, slots)

    monkeypatch.setattr(cuda_graphs, "GraphedDecoder", EagerDecoder)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(profile, "profiled_kernels", lambda fn: (fn(), EVENTS)[1])
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the ops' references: this checks the bench's wiring
    real_randint = torch.randint
    monkeypatch.setattr(torch, "randint", lambda *a, **k: real_randint(*a, **{**k, "device": "cpu"}))
    for name in ("nemotron-3-tiny", "mamba2-tiny"):
        model = fastmamba.load_model(name, device="cpu")
        profile.profile_decode(model, batch=2, context=6, reps=3, top=5, n_timeline=2, pdl=None)
        out = capsys.readouterr().out
        assert "## decode, batch 2, context 6: step wall" in out and "| 1 | _up_gemv_kernel |" in out, name


def test_launches_mode_counts_one_decode_steps_kernels(capsys):
    """``profile launches`` on the tiny Nemotron-3 preset (6 layers: 2 Mamba, 1 attention, 2 MoE, 1
    MLP): one Triton K/V write and one attention kernel for the attention layer, the MoE decode path's
    three kernels per MoE layer, the norms, and the ATen ops with the package line that issued them."""
    from fastmamba.ops._common.dispatch import interpreter_enabled

    argv = ["profile", "launches", "--model", "nemotron-3-tiny", "--batch", "2", "--timeline", "5"]
    if not interpreter_enabled():
        assert targets.main(argv) == 2
        assert "set TRITON_INTERPRET=1" in capsys.readouterr().err
        return
    from fastmamba.bench import launches
    import fastmamba

    model = fastmamba.load_model("nemotron-3-tiny", device="cpu", dtype=torch.float32)
    events = launches.decode_step_launches(model, 2, 8)
    triton = collections.Counter(name for kind, name, _ in events if kind == "triton")
    assert triton["_paged_kv_write_kernel"] == 1 and triton["_paged_decode_attention_kernel"] == 1
    assert triton["_gate_kernel"] == triton["_up_gemv_kernel"] == triton["_down_gemv_kernel"] == 2
    assert triton["_selective_state_update_kernel"] == 2 and triton["_add_rmsnorm_kernel"] == 7
    aten = [(name, where) for kind, name, where in events if kind == "aten"]
    assert ("index_put_", "ops/attention/api.py") not in {(n, w.split(":")[0]) for n, w in aten}  # no PyTorch K/V write
    assert all(w.split(":")[0].endswith(".py") for _, w in aten)
    assert targets.main(argv) == 0
    out = capsys.readouterr().out
    assert "launches in one decode step" in out
    assert "| 1 | triton | _paged_kv_write_kernel | ops/attention/kernel.py:" in out  # (its launcher's line)
    assert "the step's first 5 launches in order:" in out


@pytest.mark.skipif(not __import__("fastmamba.ops._common.dispatch", fromlist=["x"]).interpreter_enabled(),
                    reason="counts the Triton launches under the interpreter: TRITON_INTERPRET=1 on the CPU")
def test_launches_of_an_fp8_decode_step(capsys):
    """``profile launches --quantization fp8``: a MoE layer in six kernels (router, pair GEMV up and
    down quantising their inputs, the k-sum, the shared expert's two GEMVs with relu² and the sum
    inside), an MLP in two, no quantisation kernel and no relu / square / add in PyTorch; a ``to``
    that returns its input is not counted as a launch."""
    from fastmamba.bench import launches
    import fastmamba

    model = fastmamba.load_model("nemotron-3-tiny", device="cpu", dtype=torch.float32, quantization="fp8")
    events = launches.decode_step_launches(model, 1, 8)
    triton = collections.Counter(name for kind, name, _ in events if kind == "triton")
    aten = collections.Counter((name, where.split(":")[0]) for kind, name, where in events if kind == "aten")
    n_moe, n_mamba, n_mlp = 2, 2, 1  # nemotron-3-tiny: "M*EM-E"
    assert triton["_gate_kernel"] == triton["_sum_kernel"] == n_moe and triton["_moe_pair_gemv_kernel"] == 2 * n_moe
    assert triton["_fp8_gemv_kernel"] == 2 * (n_mamba + n_moe + n_mlp)
    assert not [n for n in triton if "quantize" in n]
    assert not [k for k in aten if k[1].startswith(("layers/mlp", "layers/moe", "layers/fp8", "ops/fp8"))], aten
    assert targets.main(["profile", "launches", "--quantization", "fp8", "--batch", "1"]) == 0
    assert "| 4 | triton | _moe_pair_gemv_kernel |" in capsys.readouterr().out


def test_python_m_bench_reports_a_user_error_in_one_line():
    """``python -m fastmamba.bench`` answers a bad model name as ``fastmamba bench`` does: one line
    naming it, exit status 2, no traceback (FASTMAMBA_DEBUG=1 keeps the traceback)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "FASTMAMBA_DEBUG"}
    run = subprocess.run([sys.executable, "-m", "fastmamba.bench", "e2e", "--model", "no-such-model", "--batch", "1"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(
        "python -m fastmamba.bench: error: load_model: 'no-such-model' is neither a directory nor a preset")
