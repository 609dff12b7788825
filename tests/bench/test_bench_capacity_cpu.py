"""bench capacity on the CPU: the planner's rows (from configs on the meta device, as on a GPU), the
largest max_batch's bisection, the errors, and --startup's plumbing on a tiny preset."""
from __future__ import annotations

import json

import pytest
import torch

from fastmamba.bench import capacity
from fastmamba.bench.targets import main
from fastmamba.generation.capacity import DEVICE_MEMORY_ENV, GiB, CapacityError, meta_model, plan_capacity


def bench(tmp_path, *argv: str) -> tuple[int, list[dict]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "rows.jsonl"
    rc = main(["capacity", *argv, "--json", str(path)])
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return rc, rows


@pytest.mark.parametrize("threshold", [0, 1, 2, 5, 64, 1000, capacity.LARGEST_SEARCHED + 3])
def test_largest_admitted_finds_the_threshold(threshold):
    calls = []

    def fits(m):
        calls.append(m)
        return m <= threshold

    assert capacity.largest_admitted(fits) == min(threshold, capacity.LARGEST_SEARCHED)
    assert len(calls) <= 2 * 21 + 1  # exponential search, then bisection


@pytest.mark.parametrize("ssm", ["fp32", "fp16"])
def test_nano_rows_are_the_planners_own(tmp_path, capsys, ssm):
    """Nemotron-3 Nano at 8k on an 80 GB card: the default max_batch is plan_capacity's, the largest
    admitted one plans and one more is refused, each with the numbers plan_capacity gives."""
    rc, rows = bench(tmp_path, "--model", "nemotron-3-nano", "--device-gib", "79.6", "--context", "8192",
                     "--ssm-dtype", ssm)
    assert rc == 0 and len(rows) == 1
    r = rows[0]
    meta = meta_model("nemotron-3-nano")
    kw = dict(device_bytes=int(79.6 * GiB), gpu_memory_utilization=0.9, max_seq_len=8192,
              ssm_dtype={"fp32": torch.float32, "fp16": torch.float16}[ssm])
    plan = plan_capacity(meta, **kw)
    assert r["fits"] and r["max_batch"] == plan.max_batch and r["kv_pages"] == plan.kv_pages
    assert r["weights_gib"] == pytest.approx(plan.weight_bytes / GiB) and 50 < r["weights_gib"] < 70
    largest = r["largest_max_batch"]
    assert largest >= plan.max_batch
    assert plan_capacity(meta, max_batch=largest, **kw).kv_pages == r["kv_pages_at_largest"]
    with pytest.raises(CapacityError, match=f"max_batch={largest + 1} does not fit"):
        plan_capacity(meta, max_batch=largest + 1, **kw)
    out = capsys.readouterr().out
    assert f"| 79.6 x 0.9 | 8192 | {ssm} | " in out and f"| {plan.max_batch} | {largest} |" in out


def test_fp8_weights_and_kv_pages_shrink_the_plan(tmp_path):
    _, (bf16,) = bench(tmp_path / "a", "--model", "nemotron-3-nano", "--device-gib", "79.6")
    _, (fp8,) = bench(tmp_path / "b", "--model", "nemotron-3-nano", "--device-gib", "79.6", "--quantization", "fp8",
                      "--kv-cache-dtype", "fp8")
    assert fp8["weights_gib"] < 0.6 * bf16["weights_gib"]
    assert fp8["kv_mib_per_request"] == pytest.approx(bf16["kv_mib_per_request"] / 2)
    assert fp8["largest_max_batch"] > bf16["largest_max_batch"]


def test_a_card_too_small_is_a_row_that_says_so(tmp_path, capsys):
    rc, (row,) = bench(tmp_path, "--model", "nemotron-3-nano", "--device-gib", "10")
    assert rc == 0 and not row["fits"] and "the model does not fit" in row["error"]
    assert "does not fit: the model does not fit" in capsys.readouterr().out
    rc, _ = bench(tmp_path / "s", "--model", "nemotron-3-nano", "--device-gib", "10", "--startup")
    assert rc == 2 and "the first row's plan does not fit" in capsys.readouterr().err


def test_no_device_and_no_size_is_an_error(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(DEVICE_MEMORY_ENV, raising=False)
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is the size planned for")
    rc, rows = bench(tmp_path, "--model", "nemotron-3-tiny")
    assert rc == 2 and rows == []
    assert "give --device-gib" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--context", "0"], ["--device-gib", "-1"], ["--device-gib", "x"],
                                  ["--ssm-dtype", "fp64"]],
                         ids=["context-0", "negative-gib", "gib-not-a-number", "ssm-fp64"])
def test_bad_values_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(["capacity", *argv])
    assert e.value.code == 2 and "capacity: error: argument" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["1.5", "0", "nan"])
def test_a_utilization_outside_0_1_is_named(tmp_path, capsys, value):
    rc, rows = bench(tmp_path, "--device-gib", "80", "--gpu-memory-utilization", value)
    assert rc == 2 and rows == []
    assert "--gpu-memory-utilization: gpu_memory_utilization: expected a number in (0, 1]" in capsys.readouterr().err


def test_startup_builds_the_planned_engine(tmp_path, capsys):
    """The plumbing (tiny preset, fp32; on the GPU machine on the GPU): load, build at the plan's max_batch
    and pages, warm up."""
    rc, rows = bench(tmp_path, "--model", "nemotron-3-tiny", "--dtype", "fp32", "--device-gib", "4",
                     "--context", "256", "--startup")
    assert rc == 0 and len(rows) == 2
    plan, start = rows
    assert start["kind"] == "startup" and start["max_batch"] == plan["max_batch"] and start["context"] == 256
    assert start["dtype"] == plan["dtype"] == "float32"
    assert start["load_s"] > 0 and start["warm_up_s"] > 0
    assert (start["graphs"] > 0) == torch.cuda.is_available()  # the warm-up captures graphs on a GPU only
    assert start["startup_s"] == pytest.approx(start["load_s"] + start["build_s"] + start["warm_up_s"])
    assert start["weights_gib_loaded"] == pytest.approx(plan["weights_gib"], rel=0.05)
    assert "# start-up at max_batch" in capsys.readouterr().out


def test_tp_plans_each_gpu_for_rank_0s_share(tmp_path, capsys):
    from fastmamba.distributed.loading import tp_meta_model

    rc, (row,) = bench(tmp_path, "--model", "nemotron-3-nano", "--device-gib", "79.6", "--tp", "2")
    assert rc == 0 and row["tp"] == 2
    plan = plan_capacity(tp_meta_model("nemotron-3-nano", 2), device_bytes=int(79.6 * GiB), gpu_memory_utilization=0.9,
                         max_seq_len=8192, ssm_dtype=torch.float32)
    assert row["weights_gib"] == pytest.approx(plan.weight_bytes / GiB) and row["max_batch"] == plan.max_batch
    assert "per GPU, rank 0 of 2" in capsys.readouterr().out
    for bad in (["--tp", "0"], ["--tp", "2", "--startup"], ["--tp", "2", "--quantization", "fp8"]):
        rc, rows = bench(tmp_path / bad[-1], "--model", "nemotron-3-nano", "--device-gib", "79.6", *bad)
        assert rc == 2 and rows == [] and "error: --tp" in capsys.readouterr().err


def test_a_corrupt_config_is_named(tmp_path, capsys):
    """A checkpoint directory whose config.json is not JSON: one line naming the file (the planner
    reads it before anything else, as serve's plan does)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"{ckpt / 'config.json'} is not valid JSON"):
        meta_model(str(ckpt))
    with pytest.raises(ValueError, match="is not valid JSON"):
        main(["capacity", "--model", str(ckpt), "--device-gib", "80"])
