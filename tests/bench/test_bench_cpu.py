"""The benchmark harness on the CPU: byte models, set counts, the command line, the peer loader,
and end-to-end runs (a stand-in op always; the real ops when they import) that write JSON lines.

Run: ``TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/bench``. Timings here mean nothing;
what is checked is that every path runs, rows are complete, and a wrong kernel is caught.
"""
from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F

from fastmamba import cli
from fastmamba.bench import bytes as byte_models
from fastmamba.bench import peers, targets
from fastmamba.bench.ops._base import Provider, load_fastmamba
from fastmamba.bench.ops.gated_rmsnorm import GatedRMSNormBench
from fastmamba.bench.timing import _quantile, choose_n_sets, is_cold_l2

MiB = 1 << 20


# --- byte models against a hand count -------------------------------------------------------------
def test_ssu_bytes_hand_count():
    # B=2 H=3 P=4 N=5 G=1, fp32 state, bf16 activations
    state = 2 * (2 * 3 * 4 * 5) * 4  # 960: B rows read + written
    x_z_y = 3 * (2 * 3 * 4) * 2  # 144
    b_c = 2 * (2 * 1 * 5) * 2  # 40
    dt = 2 * 3 * 2  # 12: [B, H], stride-0 over P
    per_head = 3 * 3 * 4  # 36: A, D, dt_bias fp32 [H]
    idx = 2 * 4  # 8
    assert state + x_z_y + b_c + dt + per_head + idx == 1200
    got = byte_models.ssu_bytes(2, 3, 4, 5, 1, state_dtype=torch.float32, act_dtype=torch.bfloat16)
    assert got == 1200
    # bf16 state halves the state term only
    assert byte_models.ssu_bytes(2, 3, 4, 5, 1, state_dtype=torch.bfloat16, act_dtype=torch.bfloat16) == 1200 - 480


def test_ssu_bytes_dominated_by_state_at_scale():
    # Nemotron-H, fp32 state, batch 256: the state term is > 99% of the bytes
    n = byte_models.ssu_bytes(256, 128, 64, 128, 8, state_dtype=torch.float32, act_dtype=torch.bfloat16)
    state = 2 * 256 * 128 * 64 * 128 * 4
    assert state < n < state * 1.01


def test_conv_update_bytes_hand_count():
    # B=2 D=8 W=4 state_len=3, bf16 state and activations
    expected = 2 * 2 * 8 * 3 * 2 + 2 * 2 * 8 * 2 + 8 * 4 * 2 + 8 * 2 + 2 * 4  # 192 + 64 + 64 + 16 + 8
    assert expected == 344
    got = byte_models.conv_update_bytes(2, 8, 4, 3, state_dtype=torch.bfloat16, act_dtype=torch.bfloat16)
    assert got == 344


def test_norm_bytes_hand_count():
    # M=3 Dh=16 bf16: x, z read, y written, weight read once
    assert byte_models.norm_bytes(3, 16, act_dtype=torch.bfloat16) == 3 * 3 * 16 * 2 + 16 * 2 == 320
    assert byte_models.norm_bytes(3, 16, act_dtype=torch.bfloat16, has_z=False) == 2 * 3 * 16 * 2 + 16 * 2
    assert byte_models.norm_bytes(3, 16, act_dtype=torch.bfloat16, has_bias=True) == 320 + 32


# --- rotating sets and statistics ------------------------------------------------------------------
@pytest.mark.parametrize(
    "bytes_per_set, l2, expected",
    [
        (100 * MiB, 50 * MiB, 2),  # ceil(150 / 100)
        (8 * MiB, 50 * MiB, 19),  # ceil(150 / 8)
        (1 * MiB, 50 * MiB, 64),  # capped
        (2048 * MiB, 50 * MiB, 2),  # one set dwarfs L2, but consecutive calls never share a state
        (1 * MiB, 0, 2),  # no L2 known (CPU)
    ],
)
def test_choose_n_sets(bytes_per_set, l2, expected):
    assert choose_n_sets(bytes_per_set, l2) == expected


def test_is_cold_l2():
    assert is_cold_l2(100 * MiB, 2, 50 * MiB, calls=16)  # rotation covers 4x L2
    assert is_cold_l2(1 * MiB, 64, 50 * MiB, calls=64)  # each set once per replay (L2 flushed between)
    assert not is_cold_l2(1 * MiB, 4, 50 * MiB, calls=16)  # 4 MiB cycled 4 times: L2-resident


def test_quantile_matches_linear_interpolation():
    vals = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert _quantile(vals, 0.5) == 3.0
    assert _quantile(vals, 0.2) == pytest.approx(1.8)
    assert _quantile(vals, 0.8) == pytest.approx(4.2)
    assert _quantile([7.0], 0.2) == 7.0


# --- command line ----------------------------------------------------------------------------------
def test_unknown_target_lists_available(capsys):
    with pytest.raises(SystemExit) as info:
        targets.main(["nope"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err and "kernels" in err


def test_planned_target_says_so(monkeypatch, capsys):
    monkeypatch.setattr(targets, "PLANNED", ("warp",))
    with pytest.raises(SystemExit):
        cli.main(["bench", "warp"])
    err = capsys.readouterr().err
    assert "planned but not implemented" in err and "kernels" in err


def test_bad_ops_value(capsys):
    with pytest.raises(SystemExit):
        targets.main(["kernels", "--ops", "ssu,warp"])
    assert "choose from ssu,conv,norm" in capsys.readouterr().err


# --- peer loading without the package __init__ -----------------------------------------------------
@pytest.fixture
def fake_package(tmp_path):
    """A package shaped like mamba_ssm whose __init__ files fail, as the pure-Python wheel's does."""
    name = "fakepkg_for_bench_test"
    root = tmp_path / name
    (root / "ops" / "triton").mkdir(parents=True)
    for init in (root, root / "ops", root / "ops" / "triton"):
        (init / "__init__.py").write_text("raise ImportError('needs a CUDA extension that was never built')\n")
    (root / "ops" / "triton" / "softplus.py").write_text("def softplus(v):\n    return v + 1\n")
    (root / "ops" / "triton" / "update.py").write_text(
        f"from {name}.ops.triton.softplus import softplus\n\ndef update(v):\n    return softplus(v) * 2\n"
    )
    yield name, tmp_path
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]


def test_import_without_init_skips_package_init(fake_package, monkeypatch):
    name, path = fake_package
    monkeypatch.syspath_prepend(str(path))
    with pytest.raises(ImportError):  # the ordinary import fails...
        __import__(name)
    module = peers.import_without_init(name, "ops.triton.update")  # ...this one does not
    assert module.update(1) == 4
    # no stand-in parent stays behind: a later ordinary import fails as before (transformers imports
    # mamba_ssm itself and would take a stand-in's ops for the real package's), the submodules stay
    with pytest.raises(ImportError):
        __import__(name)
    assert name not in sys.modules and f"{name}.ops" not in sys.modules
    assert sys.modules[f"{name}.ops.triton.update"] is module
    from importlib import import_module
    assert import_module(f"{name}.ops.triton.softplus").softplus(1) == 2  # cached submodules import alone
    again = peers.import_without_init(name, "ops.triton.softplus")  # and the stand-ins come back for a call
    assert again.softplus(2) == 3 and name not in sys.modules


def test_missing_peer_gives_reason(monkeypatch):
    peer = peers._mamba_ssm_peer("ops.triton.nothing_here", "fn", search_path=["/nonexistent"])
    assert not peer.available
    assert "ModuleNotFoundError" in peer.reason


# --- end to end on the CPU ----------------------------------------------------------------------------
def _gated_norm_torch(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """Independent stand-in for rmsnorm_fn (norm_before_gate=False path, as the bench calls it)."""
    assert not norm_before_gate
    v = x.float() * F.silu(z.float())
    g = v.unflatten(-1, (-1, group_size))
    y = (g * torch.rsqrt(g.square().mean(-1, keepdim=True) + eps)).flatten(-2) * weight.float()
    return y.to(x.dtype)


def _wrong_norm(*args, **kwargs):
    return _gated_norm_torch(*args, **kwargs) * 1.5


def _run(argv, tmp_path, device="cpu"):
    """Through the ``fastmamba`` command; the stand-in tests pin the CPU (tiny shapes) even on a GPU host."""
    out = tmp_path / "rows.jsonl"
    md = tmp_path / "table.md"
    argv = [*argv, "--quick", "--device", device, "--json", str(out), "--markdown", str(md)]
    rc = cli.main(["bench", "kernels", *argv])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return rc, rows, md.read_text()


def _stand_in(providers):
    def fake(self, device):
        return providers

    return fake


def test_harness_end_to_end_with_stand_in_op(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(
        GatedRMSNormBench,
        "providers",
        _stand_in(
            [
                Provider("fastmamba", "ours", "test", _gated_norm_torch),
                Provider("mamba_ssm", "peer", "?", None, reason="ModuleNotFoundError: No module named 'mamba_ssm'"),
                Provider("torch-ref", "ref", "test", _gated_norm_torch, preflight_sync=True),
            ]
        ),
    )
    rc, rows, md = _run(["--ops", "norm", "--batch", "1,3"], tmp_path)
    assert rc == 0
    assert len(rows) == 2 * 3  # (shape) x (M = 1, 3) x 3 providers on the CPU
    ours = [r for r in rows if r["provider"] == "fastmamba"]
    assert [r["batch"] for r in ours] == [1, 3]
    for r in ours:
        assert r["status"] == "ok" and r["check"] == "ok" and r["mode"] == "cpu"
        assert r["median_us"] > 0 and r["p20_us"] <= r["median_us"] <= r["p80_us"]
        assert r["bytes"] == byte_models.norm_bytes(r["batch"], 64, act_dtype=torch.bfloat16)
        assert r["gbps"] > 0
        # header fields travel with every row
        for key in ("device", "torch", "triton", "date", "command", "copy_gbps", "timing_method", "git_commit"):
            assert key in r
        assert "bench kernels" in r["command"]
    skipped = [r for r in rows if r["provider"] == "mamba_ssm"]
    assert all(r["status"] == "skipped" and "ModuleNotFoundError" in r["note"] for r in skipped)
    assert all(r["check"] == "ref" for r in rows if r["provider"] == "torch-ref")
    printed = capsys.readouterr().out
    assert "no GPU" in printed and "median µs" in printed and "skipped: ModuleNotFoundError" in printed
    assert md.startswith("# fastmamba kernel benchmark") and "| norm |" in md


def test_wrong_kernel_is_reported_fail(monkeypatch, tmp_path):
    monkeypatch.setattr(
        GatedRMSNormBench,
        "providers",
        _stand_in(
            [
                Provider("fastmamba", "ours", "test", _wrong_norm),
                Provider("torch-ref", "ref", "test", _gated_norm_torch),
            ]
        ),
    )
    rc, rows, _ = _run(["--ops", "norm", "--batch", "2"], tmp_path)
    assert rc == 1
    ours = next(r for r in rows if r["provider"] == "fastmamba")
    assert ours["status"] == "ok" and ours["check"].startswith("FAIL y: Mismatched elements")


def test_raising_provider_is_an_error_row(monkeypatch, tmp_path):
    def boom(*args):
        raise ValueError("rmsnorm_fn: `x` expected shape (M, Dh)")

    monkeypatch.setattr(
        GatedRMSNormBench,
        "providers",
        _stand_in([Provider("fastmamba", "ours", "test", boom), Provider("torch-ref", "ref", "t", _gated_norm_torch)]),
    )
    rc, rows, _ = _run(["--ops", "norm", "--batch", "1"], tmp_path)
    assert rc == 1
    ours = next(r for r in rows if r["provider"] == "fastmamba")
    assert ours["status"] == "error" and "ValueError" in ours["note"]
    assert next(r for r in rows if r["provider"] == "torch-ref")["status"] == "ok"  # the run went on


OPS = {
    "ssu": ("state_update", "selective_state_update", "selective_state_update_ref"),
    "conv": ("conv1d", "causal_conv1d_update", "causal_conv1d_update_ref"),
    "norm": ("gated_rmsnorm", "rmsnorm_fn", "rmsnorm_ref"),
}


@pytest.mark.parametrize("op", list(OPS))
def test_real_op_end_to_end(op, tmp_path):
    subpackage, public, ref = OPS[op]
    assert callable(load_fastmamba(subpackage, public))
    assert callable(load_fastmamba(subpackage, ref, module="ref"))
    rc, rows, _ = _run(["--ops", op, "--batch", "1"], tmp_path, device="auto")  # real shapes on a GPU
    ours = [r for r in rows if r["provider"] == "fastmamba"]
    assert ours and all(r["status"] == "ok" for r in ours), [r["note"] for r in ours]
    assert all(r["check"] == "ok" for r in ours), [r["check"] for r in ours]
    assert all(r["status"] in ("ok", "skipped") for r in rows)
    assert rc == 0


# --- the CUDA timing paths, driven through a stand-in torch.cuda --------------------------------------
class _FakeCuda:
    """Just enough of torch.cuda and triton.testing.do_bench to walk the graph/eager code paths.

    It checks the harness's bookkeeping (warm-up before capture, calls per graph, per-call
    arithmetic, the eager fallbacks); the real API semantics are exercised on a GPU.
    """

    def __init__(self):
        self.capturing = False
        self.sync_mode = 0
        self.replays = 0
        self.bench_calls = []

    def install(self, monkeypatch):
        import contextlib

        import triton.testing

        fake = self

        class Stream:
            def wait_stream(self, other):
                pass

        class Event:
            def __init__(self, enable_timing=False):
                pass

            def record(self):
                pass

            def elapsed_time(self, other):
                return 0.5

        class CUDAGraph:
            def replay(self):
                fake.replays += 1

        @contextlib.contextmanager
        def graph(g, pool=None):  # torch.cuda.graph's signature (graph_capture passes pool)
            fake.capturing = True
            try:
                yield
            finally:
                fake.capturing = False

        @contextlib.contextmanager
        def stream(s):
            yield

        def do_bench(fn, warmup, rep, quantiles):
            assert quantiles == [0.2, 0.5, 0.8] and rep > 0 and warmup > 0
            fn()
            fake.bench_calls.append(fn)
            return [1.0, 2.0, 3.0]  # ms per replay

        for name, value in {
            "Stream": Stream,
            "Event": Event,
            "CUDAGraph": CUDAGraph,
            "graph": graph,
            "stream": stream,
            "current_stream": lambda: Stream(),
            "synchronize": lambda: None,
            "empty_cache": lambda: None,
            "get_sync_debug_mode": lambda: fake.sync_mode,
            "set_sync_debug_mode": lambda m: setattr(fake, "sync_mode", 2 if m == "error" else m),
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(triton.testing, "do_bench", do_bench)
        return self


def test_graph_timing_bookkeeping(monkeypatch):
    from fastmamba.bench.timing import TimingConfig, time_calls

    fake = _FakeCuda().install(monkeypatch)
    log = []
    make_call = lambda i: (lambda: log.append((i, fake.capturing)))  # noqa: E731
    t = time_calls(make_call, 3, device=torch.device("cuda"), config=TimingConfig.quick())
    assert t.mode == "graph" and t.n_sets == 3 and t.calls == 18  # 3 sets repeated to >= 16 calls
    warm = [e for e in log if not e[1]]
    captured = [e for e in log if e[1]]
    assert [i for i, _ in warm] == [0, 1, 2, 0, 1, 2]  # every set warmed (compiled) before capture
    assert [i for i, _ in captured] == [0, 1, 2] * 6
    assert log.index(warm[-1]) < log.index(captured[0])
    assert t.median_us == pytest.approx(2000 / 18) and t.p20_us == pytest.approx(1000 / 18)
    assert t.p80_us == pytest.approx(3000 / 18)


def test_graph_capture_failure_falls_back_to_eager(monkeypatch):
    from fastmamba.bench.timing import TimingConfig, time_calls

    fake = _FakeCuda().install(monkeypatch)

    def make_call(i):
        def call():
            if fake.capturing:
                raise RuntimeError("operation not permitted when stream is capturing")

        return call

    t = time_calls(make_call, 20, device=torch.device("cuda"), config=TimingConfig.quick())
    assert t.mode == "eager" and t.calls == 20  # eager: each set once per pass, no repeats
    assert "graph capture failed" in t.note and "not permitted" in t.note
    assert t.median_us == pytest.approx(2000 / 20)


def test_host_syncing_reference_is_timed_eagerly(monkeypatch):
    from fastmamba.bench.timing import TimingConfig, time_calls

    fake = _FakeCuda().install(monkeypatch)

    def make_call(i):
        def call():
            if fake.sync_mode == 2:
                raise RuntimeError("called a synchronizing CUDA operation")
            assert not fake.capturing, "capture must not be attempted"

        return call

    t = time_calls(make_call, 2, device=torch.device("cuda"), config=TimingConfig.quick(), preflight_sync=True)
    assert t.mode == "eager" and "syncs with the host" in t.note
    assert fake.sync_mode == 0  # restored


def test_compare_checks_large_tensors_in_slices(monkeypatch):
    """_compare splits tensors above its chunk size along dim 0 (torch.testing refuses 2^31+
    elements) and still reports a mismatch, naming the slice."""
    from fastmamba.bench.ops import _base

    monkeypatch.setattr(_base, "_COMPARE_CHUNK", 8)
    want = torch.randn(6, 4)
    got = want.clone()
    assert _base._compare("inter", got, want, dict(atol=1e-6, rtol=1e-6)) == ""
    got[5, 1] += 1.0
    problem = _base._compare("inter", got, want, dict(atol=1e-6, rtol=1e-6))
    assert problem.startswith("inter[4:6]") and "Mismatched" in problem


def test_host_time_rotates_sets_without_waiting(monkeypatch):
    from fastmamba.bench import timing

    _FakeCuda().install(monkeypatch)
    log = []
    clock = iter(range(0, 10**6, 10))  # each perf_counter read advances 10 "seconds"
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    us = timing.time_host(lambda i: (lambda: log.append(i)), 3, calls=20)
    assert log[:3] == [0, 1, 2]  # one warm-up call per set
    assert log[3:23] == [k % 3 for k in range(20)]  # then calls rotate over the sets
    assert len(log) == 3 + 5 * 20
    assert us == pytest.approx(10 * 1e6 / 20)  # one pass = 10 s of fake clock over 20 calls


def test_eager_columns_and_ratio():
    from fastmamba.bench import report
    from fastmamba.bench.kernels import _fill_ratios

    def row(provider, kind, median, eager):
        return report.Row(op="op", title="t", shape="s", dims="d", dtype="bf16", batch=1, provider=provider,
                          kind=kind, version="v", bytes=100, mode="graph", median_us=median, p20_us=median,
                          p80_us=median, check="ok", eager_us=eager, host_us=eager and eager / 2, case_id=1)

    rows = [row("fastmamba", "ours", 2.0, 8.0), row("vllm", "peer", 2.2, 6.0), row("mamba_ssm", "peer", 3.0, 12.0)]
    _fill_ratios(rows)
    assert rows[0].eager_vs == "0.75x vllm"  # best peer's eager 6.0 / ours 8.0
    table = report.format_table(rows)
    assert "eager µs" in table.splitlines()[0] and "host µs" in table.splitlines()[0]
    plain = [row("fastmamba", "ours", 2.0, None)]
    assert "eager µs" not in report.format_table(plain).splitlines()[0]
