"""``tune --ops gemv`` on the CPU (Triton interpreter): the decode projections' shapes per preset,
the sweep over forced configs with the real kernel, and the paste-ready (family, dtype, N, K) table
that ``fastmamba.ops.gemv.configs`` reads. Timings here mean nothing."""
from __future__ import annotations

import pytest
import torch

from fastmamba.bench import tune
from fastmamba.bench.ops.gemv import projection_shapes
from fastmamba.ops.gemv import configs
from fastmamba.ops.runtime import interpreter_enabled

CPU = torch.device("cpu")


def test_projection_shapes_follow_the_presets():
    nano = projection_shapes("nemotron-3-nano")
    # Mamba in_proj: z, x (64 heads x 64), B, C (8 groups x 128), dt (64); attention: 32 + 2 x 2 heads of 128
    assert nano == {"in_proj": (2 * 4096 + 2 * 8 * 128 + 64, 2688), "out_proj": (2688, 4096),
                    "qkv": (36 * 128, 2688), "o_proj": (2688, 4096)}
    assert projection_shapes("mamba2-2.7b") == {"in_proj": (2 * 5120 + 2 * 128 + 80, 2560), "out_proj": (2560, 5120)}


@pytest.mark.skipif(not interpreter_enabled(), reason="runs the Triton kernel: TRITON_INTERPRET=1 on the CPU")
def test_sweep_runs_forced_configs_and_writes_the_table(monkeypatch):
    a = dict(use_dot=True, block_n=16, block_k=32, num_warps=4, num_stages=2)
    b = dict(a, block_n=32)
    monkeypatch.setattr(configs, "CANDIDATES", [a, b])
    sweep = tune.plan_sweeps(["gemv"], CPU)[0]
    assert not sweep.reason, sweep.reason
    cases = sweep.bench.tune_cases(CPU, [1, 4])
    assert cases and all(c.batch == 1 for c in cases)  # one row: a config holds for every row count
    result = tune._sweep_case(sweep, cases[0], CPU, 0, 1.0, False, None)
    assert sorted(cfg["block_n"] for _, cfg in result.results) == [16, 32]
    lines = tune.paste_ready_table(sweep, [result], "test")
    N, K = cases[0].params["N"], cases[0].params["K"]
    namespace = {"GemvConfig": configs.GemvConfig}
    exec("\n".join(lines[1:]), namespace)  # valid Python, as it would be pasted
    (key, entry), = namespace["TABLE"].items()
    assert key == ("cpu", "float16", N, K) and entry in (a, b)  # dicts while TABLE is empty (pick_config takes both)
