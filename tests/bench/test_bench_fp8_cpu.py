"""``bench fp8 --kinds moe`` on the CPU: the byte model by hand and counted from the routing, the
torch._scaled_mm-per-expert baseline (torch runs e4m3 ``_scaled_mm`` on the CPU) and the grouped
kernel against the reference through the bench's own check, a wrong kernel caught.

Run: ``TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/bench/test_bench_fp8_cpu.py``.
"""
from __future__ import annotations

import pytest
import torch

from fastmamba.bench.ops import fp8 as fp8_bench
from fastmamba.bench.ops._base import Provider

CPU = torch.device("cpu")


def test_moe_byte_model_by_hand():
    # T=2, M=4, F=3, k=2, 3 experts touched: e4m3 weights 2*3*4*3, scales 4*3*(3+4), x and out 2*2*4*2, routing 2*2*8
    assert fp8_bench.moe_fp8_bytes(2, 4, 3, 2, 3) == 72 + 84 + 32 + 32 == 220
    assert fp8_bench.moe_fp8_bytes(2, 4, 3, 2, 3, weight_bytes=2) == 144 + 32 + 32 == 208


def _moe_case_and_set(T: int):
    bench = fp8_bench.FP8Bench(("moe",))
    (case,) = bench.cases(CPU, [T])
    return bench, case, bench.make_set(case, CPU, seed=0)


def test_cases_count_the_experts_the_routing_touches():
    bench, case, inp = _moe_case_and_set(3)
    touched = int(inp["ids"].unique().numel())
    E, k, F, M = fp8_bench.CPU_MOE["tiny"]
    assert case.params["touched"] == touched == len(inp["groups"]) and f"({touched} experts touched)" in case.dims
    assert case.nbytes == fp8_bench.moe_fp8_bytes(3, M, F, k, touched)
    assert sum(int(tok.numel()) for _, tok, _ in inp["groups"]) == 3 * k  # every (token, expert) pair once


def test_moe_providers_match_the_reference_and_a_wrong_kernel_fails():
    """The grouped kernel (20 tokens: above the pair GEMV) and the per-expert _scaled_mm baseline pass
    the bench's check against the W8A8 reference; a kernel that forgets the routing weights fails it."""
    from fastmamba.ops.fp8 import fp8_moe_grouped
    from fastmamba.ops.fp8.ref import fp8_moe_ref

    bench, case, inp = _moe_case_and_set(20)
    ref = Provider("torch-ref", "ref", "t", lambda c, i: fp8_moe_ref(i["x"], i["up8"], i["su"], i["down8"], i["sd"],
                                                                      i["wts"], i["ids"]))
    grouped = Provider("fastmamba-fp8-grouped", "ours", "t",
                       lambda c, i: fp8_moe_grouped(i["x"], i["up8"], i["su"], i["down8"], i["sd"], i["wts"], i["ids"]))
    per_expert = Provider("torch._scaled_mm-experts", "peer", "t", lambda c, i: fp8_bench._scaled_mm_experts(i))
    unweighted = Provider("wrong", "ours", "t", lambda c, i: fp8_moe_grouped(
        i["x"], i["up8"], i["su"], i["down8"], i["sd"], torch.ones_like(i["wts"]), i["ids"]))
    assert bench.check(grouped, ref, case, inp) == "ok"
    assert bench.check(unweighted, ref, case, inp).startswith("FAIL")
    if not _cpu_scaled_mm_takes_row_scales():
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only (the per-expert "
                    "baseline's row-wise scales run on GPUs; torch 2.13's CPU takes them)")
    assert bench.check(per_expert, ref, case, inp) == "ok"


def _cpu_scaled_mm_takes_row_scales() -> bool:
    a = torch.zeros(2, 16).to(torch.float8_e4m3fn)
    b = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, b.t(), scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(not __import__("fastmamba.ops.runtime", fromlist=["x"]).interpreter_enabled(),
                    reason="runs the Triton kernels: TRITON_INTERPRET=1 on the CPU")
def test_tune_sweeps_the_decode_gemvs_and_writes_the_table(monkeypatch):
    """``tune --ops fp8``: the linear cases at 1 row and the MoE pair GEMV at 1 token (FMA, dot and
    swapped dot tiles compete) and the linear at 8 rows (dot tiles), each forced into the real kernels; the
    paste-ready table is valid Python keyed (family, kind, rows, N, K) and gemv_config reads it."""
    from fastmamba.bench import tune
    from fastmamba.ops.fp8 import configs

    fma = dict(use_dot=False, block_n=8, block_k=512, num_warps=4, num_stages=2)
    dot = dict(use_dot=True, block_n=16, block_k=128, num_warps=4, num_stages=2)
    swap = dict(dot, swap_ab=True)  # the weight tile on the dot's left (Hopper's wgmma at 64+ rows)
    monkeypatch.setattr(configs, "CANDIDATES", [fma, dict(fma, block_n=16), dot, dict(dot, block_k=256), swap])
    sweep = tune.plan_sweeps(["fp8"], CPU)[0]
    assert not sweep.reason, sweep.reason
    cases = sweep.bench.tune_cases(CPU, tune.DEFAULT_BATCHES["fp8"])
    assert sorted((c.params["kind"], c.batch) for c in cases) == [("linear", 1), ("linear", 8), ("moe", 1)]
    launched = []
    real_gemv = configs.gemv_config

    def spy(device, kind, rows, N, K):
        cfg = real_gemv(device, kind, rows, N, K)
        launched.append((kind, rows, cfg))
        return cfg

    monkeypatch.setattr("fastmamba.ops.fp8.api.gemv_config", spy)
    results = [tune._sweep_case(sweep, case, CPU, 0, 1.0, False, None) for case in cases]
    tried = {(c.params["kind"], c.batch): sorted(tuple(cfg.values()) for _, cfg in r.results)
             for c, r in zip(cases, results)}
    as_tuples = lambda *cs: sorted(tuple(c.values()) for c in cs)  # noqa: E731
    assert tried[("linear", 1)] == as_tuples(fma, dict(fma, block_n=16), dot, dict(dot, block_k=256), swap)
    assert tried[("linear", 8)] == as_tuples(dot, dict(dot, block_k=256), swap)
    assert tried[("moe", 1)] == tried[("linear", 1)]
    # the forced configs reached the launches: FMA and dot tiles at one row of a linear and in the pair GEMV
    for kind in ("linear", "moe"):
        assert {(kind, 1, configs.GemvConfig(**c)) for c in (fma, dot, swap)} <= set(launched), kind
    lines = tune.paste_ready_table(sweep, results, "test")
    namespace: dict = {}
    exec("\n".join(lines[1:]), namespace)  # valid Python, as it would be pasted
    table = namespace["TABLE"]
    (N, K), (F_, M) = (cases[0].params["N"], cases[0].params["K"]), (32, 64)
    assert set(table) == {("cpu", "linear", "1-2", N, K), ("cpu", "linear", "3-16", N, K), ("cpu", "moe", "1-2", F_, M)}
    monkeypatch.setattr(configs, "TABLE", table)
    assert configs.gemv_config(CPU, "linear", 8, N, K) == configs.GemvConfig(**table[("cpu", "linear", "3-16", N, K)])
    assert configs.gemv_config(CPU, "moe", 1, F_, M) == configs.GemvConfig(**table[("cpu", "moe", "1-2", F_, M)])
    assert configs.gemv_config(CPU, "linear", 1, 7, 9) == configs.FMA_DEFAULT  # a shape not in the table
    assert configs.gemv_config(CPU, "linear", 2, 7, 9) == configs.FMA_DEFAULT._replace(block_k=512)  # 2 rows: 16k products
    assert configs.gemv_config(CPU, "linear", 3, 7, 9) == configs.DOT_DEFAULT
    with configs.forced_config(**dict(fma, block_n=8)):
        assert configs.gemv_config(CPU, "linear", 4, N, K) == configs.GemvConfig(True, 16, 512, 4, 2)  # dot, 16 wide
