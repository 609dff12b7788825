"""Tensor parallelism on 2 GPUs (NCCL): the CPU checks again with CUDA graphs capturing the
collectives, fastmamba's gemv path (bf16, <= 16 rows) calling the row-parallel all-reduce, the
Nemotron-H hybrid through its graphed prefill and the engine's graphs (the paged prefill attention
kernel on each rank's KV heads), and the TP benchmark's fp32 equality on a real-size preset. Needs 2
CUDA GPUs; skips with the reason otherwise."""
from __future__ import annotations

import pytest
import torch

import fastmamba
from fastmamba.distributed import spawn_tp
from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import SamplingParams
from tests.distributed._workers import run_model, run_nemotron_h_graphed, tp_check, tp_nemotron_h_graphed
from tests.helpers import tol

NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.kernels,  # the real kernels (Triton on the GPU), not the references
    pytest.mark.skipif(NGPU < 2, reason=f"tensor parallelism over NCCL needs 2 CUDA GPUs; this machine has {NGPU}"),
]


def _inputs(vocab: int):
    g = torch.Generator().manual_seed(11)
    prompts = torch.randint(0, vocab, (2, 37), generator=g)
    steps = torch.randint(0, vocab, (2, 4), generator=g)
    prompt_lists = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 19, 2)]
    return prompts, steps, prompt_lists


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tp2_gpu_graphs_equal_tp1(dtype):
    model = fastmamba.load_model("mamba2-tiny", dtype=dtype, device="cuda:0")
    with torch.no_grad():  # as tests.helpers.scaled_tiny_model, in ``dtype``: mixers that matter
        for layer in model.backbone.layers:
            layer.mixer.in_proj.weight.mul_(10)
            layer.mixer.conv1d.weight.mul_(10)
            layer.mixer.out_proj.weight.mul_(30)
    prompts, steps, prompt_lists = _inputs(model.cfg.vocab_size)
    ref = run_model(model, prompts, steps)["logits"]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    ref_greedy = [list(t) for t in Engine(model, max_batch=3, cuda_graphs=True).generate(prompt_lists, params)]
    sd = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    results = spawn_tp(tp_check, 2, model.cfg, sd, None, prompts, steps, prompt_lists, 12, device="cuda",
                       cuda_graphs=True, dtype=dtype, timeout_s=600)
    for res in results:
        for want, got in zip(ref, res["logits"]):
            if dtype == torch.float32:
                err = ((got - want).abs().max() / want.abs().max()).item()
                assert err <= 1e-5, err
            else:
                torch.testing.assert_close(got, want, **tol(dtype))
        if dtype == torch.float32:  # bf16 greedy may flip on a near-tie; fp32 must not
            assert res["greedy"] == ref_greedy
            assert res["greedy_spec"] == ref_greedy


def test_tp_bench_fp32_outputs_equal():
    from fastmamba.bench.tp import main

    assert main(["--model", "mamba2-130m", "--tp", "1,2", "--batch", "1,4", "--dtype", "fp32", "--prompt-len", "64",
                 "--gen-len", "32", "--device", "cuda", "--require-equal"]) == 0


def test_tp2_gpu_nemotron_h_graphs_equal_tp1():
    """The hybrid (nemotron-h-tiny: KV heads and Mamba groups split; and 1 KV head / 1 group:
    replicated, the gated norm's sums all-reduced; and the MoE nemotron-3-tiny, whose decode
    kernels' counters a rank must start at zero) on 2 GPUs, fp32: the graphed packed prefill's
    logits and the engine's greedy tokens (graphed prefill and decode) equal one GPU's."""
    import dataclasses

    from fastmamba.models.nemotron_h import PRESETS
    from tests.distributed._cases import hybrid_model, moe_model

    tiny = PRESETS["nemotron-h-tiny"]
    models = [hybrid_model(tiny, 1), hybrid_model(dataclasses.replace(tiny, n_kv_heads=1, n_groups=1), 2),
              moe_model(PRESETS["nemotron-3-tiny"], 3)]  # MoE: each rank's expert channels, one all-reduce
    g = torch.Generator().manual_seed(5)
    prompt_lists = [torch.randint(0, tiny.vocab_size, (n,), generator=g).tolist() for n in (9, 2, 21)]
    refs = [run_nemotron_h_graphed(m.to("cuda:0"), prompt_lists, 8) for m in models]
    cases = [(m.cfg, {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}) for m in models]
    results = spawn_tp(tp_nemotron_h_graphed, 2, cases, prompt_lists, 8, device="cuda", timeout_s=600)
    for per_rank in results:
        for c, (ref, got) in enumerate(zip(refs, per_rank)):
            err = ((got["graphed_logits"] - ref["graphed_logits"]).abs().max()
                   / ref["graphed_logits"].abs().max()).item()
            assert err <= 1e-5, f"rank {got['rank']}, case {c}: graphed prefill logits, relative error {err:.2e}"
            assert got["greedy"] == ref["greedy"], f"rank {got['rank']}, case {c}: greedy tokens differ"
