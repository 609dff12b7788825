"""``bench kernels --ops moe`` on the CPU: byte / FLOP models by hand, the vLLM layout of the
alignment, the vLLM and grouped_mm peers against the reference, a wrong kernel caught by the check,
the tune hooks, and one end-to-end run through the command line (Triton interpreter, tiny shape).

Run: ``TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/bench/test_bench_moe_cpu.py``.
Timings here mean nothing; what is checked is that every path runs and a wrong result is caught.
"""
from __future__ import annotations

import json

import pytest
import torch

from fastmamba import cli
from fastmamba.bench import bytes as byte_models
from fastmamba.bench.ops import moe as moe_bench
from fastmamba.bench.ops._base import Provider
from fastmamba.ops.moe import configs
from fastmamba.ops._common.dispatch import interpreter_enabled
from fastmamba.ops.moe.ref import fused_moe_ref

CPU = torch.device("cpu")

# launches Triton kernels on CPU tensors: only the interpreter runs those (a GPU machine, where
# TRITON_INTERPRET is off, runs the same kernels in the GPU tests and `bench kernels --ops moe`)
on_the_interpreter = pytest.mark.skipif(not interpreter_enabled(), reason="launches Triton kernels on CPU tensors: "
                                        "needs TRITON_INTERPRET=1 before Python starts")


def test_byte_and_flop_models_by_hand():
    # T=2, M=4, F=3, k=2, 3 experts touched, bf16: weights 2*3*4*3*2, x and out 2*2*4*2, routing 2*2*8
    assert byte_models.moe_bytes(2, 4, 3, 2, 3, act_dtype=torch.bfloat16) == 144 + 32 + 32 == 208
    assert byte_models.moe_flops(2, 4, 3, 2) == 4 * 2 * 2 * 4 * 3 == 192
    assert byte_models.moe_route_bytes(2, 8, 2) == 2 * 8 * 4 + 8 * 4 + 2 * 2 * 8 == 128


def test_cases_count_the_experts_touched():
    bench = moe_bench.MoeBench((3,))
    cases = bench.cases(CPU, [])
    experts = [c for c in cases if c.op == moe_bench.EXPERTS]
    assert [c.op for c in cases] == [moe_bench.ROUTE, moe_bench.EXPERTS, moe_bench.EXPERTS]
    assert [c.shape for c in experts] == ["tiny", "tiny+shared"]
    case = experts[0]
    ids = bench._routing[(case.shape, 3)][3]
    M, F, E, k = moe_bench.CPU_SHAPES["tiny"]
    touched = int(ids.unique().numel())
    assert case.nbytes == byte_models.moe_bytes(3, M, F, k, touched, act_dtype=torch.float32)
    assert f"({touched} experts touched)" in case.dims and case.flops == 4 * 3 * k * M * F
    # the decode call with the shared expert: its S slices are read like S more experts
    shared = experts[1]
    M, F, E, k, S = moe_bench.CPU_SHARED_SHAPES["tiny+shared"]
    touched = int(bench._routing[("tiny+shared", 3)][3].unique().numel())
    assert shared.nbytes == byte_models.moe_bytes(3, M, F, k, touched + S, act_dtype=torch.float32)
    assert shared.flops == 4 * 3 * (k + S) * M * F and f"+{S} shared slices" in shared.dims
    # only the GEMV path's token counts
    assert [c.batch for c in moe_bench.MoeBench((1, 4, 5)).cases(CPU, []) if c.shape == "tiny+shared"] == [1, 4]


def _experts_case_and_set(T=5):
    bench = moe_bench.MoeBench((T,))
    case = next(c for c in bench.cases(CPU, []) if c.op == moe_bench.EXPERTS)
    return bench, case, bench.make_set(case, CPU, seed=0)


def test_wrong_kernel_is_caught():
    bench, case, inp = _experts_case_and_set()
    bench.providers(CPU)
    ref = Provider("torch-ref", "ref", "t", fused_moe_ref)
    wrong = Provider("fastmamba", "ours", "t", lambda x, *a: torch.zeros_like(x))
    assert bench.check(wrong, ref, case, inp).startswith("FAIL")
    assert bench.check(ref, ref, case, inp) == "ok"


def test_grouped_mm_peer_matches_reference():
    bench, case, inp = _experts_case_and_set()
    prov = moe_bench.grouped_mm_provider(CPU)
    if not prov.available:
        pytest.skip(prov.reason)
    got = prov.fn(*bench.args(case, inp))
    torch.testing.assert_close(got, fused_moe_ref(*bench.args(case, inp)), atol=1e-4, rtol=1e-4)


@on_the_interpreter
def test_vllm_layout_of_the_alignment():
    """sorted ids with the sentinel P in pad rows, an expert id per block, the padded row count."""
    ids = torch.tensor([[0, 2], [2, 3], [0, 2]], dtype=torch.int32)  # expert 1 gets nothing
    bm = 16
    sorted_ids, expert_ids, padded = moe_bench.vllm_align(ids, 4, bm)
    counts = [2, 0, 3, 1]
    assert int(padded) == 3 * bm  # three experts with pairs, one block each
    assert expert_ids[:3].tolist() == [0, 2, 3]
    flat = ids.flatten()
    for b, e in enumerate([0, 2, 3]):
        block = sorted_ids[b * bm:(b + 1) * bm]
        real = block[:counts[e]]
        assert sorted(real.tolist()) == torch.nonzero(flat == e).flatten().tolist()
        assert (block[counts[e]:] == 6).all()  # the sentinel: T*k


def test_vllm_default_config_rules():
    small, big = moe_bench.vllm_default_config(1, 128), moe_bench.vllm_default_config(4096, 128)
    assert (small["BLOCK_SIZE_M"], small["BLOCK_SIZE_N"], small["BLOCK_SIZE_K"], small["num_stages"]) == (16, 64, 128, 4)
    assert (big["BLOCK_SIZE_M"], big["BLOCK_SIZE_N"], big["GROUP_SIZE_M"], big["num_warps"]) == (128, 128, 1, 8)
    assert moe_bench.vllm_default_config(100000, 128)["GROUP_SIZE_M"] == 16


@on_the_interpreter
def test_vllm_peer_matches_reference():
    """vLLM's fused_moe_kernel (staged in peers/vllm_fused_moe) through the interpreter."""
    if moe_bench.vllm_moe_dir() is None:
        pytest.skip("peers/vllm_fused_moe/ not staged (see fastmamba/bench/ops/moe.py)")
    bench, case, inp = _experts_case_and_set()
    prov = moe_bench.vllm_provider(CPU)
    assert prov.available, prov.reason
    got = prov.fn(*bench.args(case, inp))
    torch.testing.assert_close(got, fused_moe_ref(*bench.args(case, inp)), atol=1e-4, rtol=1e-4)


def test_tune_hooks():
    bench = moe_bench.MoeBench()
    cases = bench.tune_cases(CPU, [1, 4, 64])
    assert [(c.shape, c.batch) for c in cases] == [("tiny", 1), ("tiny", 4), ("tiny", 64), ("tiny+shared", 1),
                                                   ("tiny+shared", 4)]
    assert all(c.op == moe_bench.EXPERTS for c in cases)
    one, four, many, shared_one, shared_four = (bench.tune_candidates(configs, c) for c in cases)
    assert one and all(c["path"] == "gemv" for c in one)
    assert {c["path"] for c in four} == {"gemv", "grouped"}
    assert many and all(c["path"] == "grouped" for c in many)
    assert shared_one == shared_four == one  # the decode call is always the GEMV path
    with configs.forced_config(**many[0]):
        assert configs.pick_config(CPU, torch.float32, 64, 48, 40, 8, 2, interpreter=True) == configs.MoeConfig(**many[0])
    # the key holds S, the shared slices (0: the routed-only op), as configs.pick_config looks it up
    assert bench.tune_table_key(configs, cases[0]) == ("cpu", "float32", 48, 40, 8, 2, 0, 1)
    assert bench.tune_table_key(configs, cases[4]) == ("cpu", "float32", 48, 40, 8, 2, 2, 4)
    assert bench.tune_table_key(configs, cases[4]) == configs.table_key(CPU, torch.float32, 3, 48, 40, 8, 2, shared=2)


@on_the_interpreter
def test_shared_case_runs_the_decode_call():
    """The +shared case: ours runs fused_moe_gemv with the slices in place (and its fused k-sum),
    the peers fused_moe over the E+S experts; both equal the reference, a wrong slice is caught."""
    bench = moe_bench.MoeBench((2,))
    bench.providers(CPU)
    case = next(c for c in bench.cases(CPU, []) if c.shape == "tiny+shared")
    inp = bench.make_set(case, CPU, seed=3)
    M, F, E, k, S = moe_bench.CPU_SHARED_SHAPES["tiny+shared"]
    x, w_up, w_down, weights, ids = bench.args(case, inp)
    assert w_up.shape == (E + S, F, M) and ids[:, k:].tolist() == [[E, E + 1]] * 2 and (weights[:, k:] == 1).all()
    ref = Provider("torch-ref", "ref", "t", fused_moe_ref)
    calls = []
    ours = Provider("fastmamba", "ours", "t", lambda *a: calls.append(a))  # never called: the decode call runs
    assert bench.check(ours, ref, case, inp) == "ok" and not calls
    assert not inp["decode"]["arrivals"].any()  # the fused sum ran and left its counters zero
    grouped = moe_bench.grouped_mm_provider(CPU)
    if grouped.available:
        assert bench.check(grouped, ref, case, inp) == "ok"
    inp["decode"]["shared_down"].mul_(-1)  # the layer's form of slice data now disagrees with the peers'
    assert bench.check(ours, ref, case, inp).startswith("FAIL")
    d = inp["decode"]
    want = fused_moe_ref(*d["args"], shared_up=d["shared_up"], shared_down=d["shared_down"])
    torch.testing.assert_close(bench.bind(ours, case, inp)(), want, atol=1e-4, rtol=1e-4)
    assert "is the GEMV path" in bench.skip_reason(Provider("fastmamba-gemv", "ours", "t", None), case)


def test_end_to_end_through_the_command_line(tmp_path):
    out = tmp_path / "rows.jsonl"
    rc = cli.main(["bench", "kernels", "--ops", "moe", "--batch", "5", "--quick", "--device", "cpu",
                   "--json", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by = {(r["op"], r["provider"]): r for r in rows}
    for op, prov in [("moe_route", "fastmamba"), ("fused_moe", "fastmamba"), ("fused_moe", "fastmamba-gemv"),
                     ("fused_moe", "torch-grouped_mm")]:
        r = by[(op, prov)]
        assert r["status"] == "ok" and r["check"] == "ok", (op, prov, r["note"], r["check"])
    assert by[("fused_moe", "fastmamba")]["bytes"] > 0 and by[("fused_moe", "fastmamba")]["flops"] > 0
    assert by[("moe_route", "torch-grouped_mm")]["status"] == "skipped"
    assert rc == 0


def test_tune_sweep_runs_every_candidate(monkeypatch):
    """``tune --ops moe``'s sweep of one case (interpreter, two candidates: one per path) and the
    paste-ready table keyed as configs.TABLE is."""
    from fastmamba.bench import tune

    gemv = dict(path="gemv", block_m=16, block_n_up=16, block_k_up=32, block_n_down=16, block_k_down=32,
                group_m=1, num_warps=4, num_stages=1)
    grouped = dict(gemv, path="grouped", block_n_up=32, block_n_down=32)
    monkeypatch.setattr(configs, "CANDIDATES", [gemv, grouped])
    sweep = tune.plan_sweeps(["moe"], CPU)[0]
    assert not sweep.reason, sweep.reason
    case = sweep.bench.tune_cases(CPU, [4])[0]
    result = tune._sweep_case(sweep, case, CPU, 0, 1.0, False, None)
    assert [cfg["path"] for _, cfg in result.results] == ["gemv", "grouped"]
    table = "\n".join(tune.paste_ready_table(sweep, [result], "test"))
    assert "('cpu', 'float32', 48, 40, 8, 2, 0, 4): " in table  # (a dict, or a MoeConfig once TABLE has entries)
