"""scripts/speed_vs_base.sh and scripts/speed_table.py (issue 49, "speed unchanged"): the table's ratios
and verdicts from fake bench rows, ``prepare`` writing a commit's package, and a CPU dry run of ``run``
(the tiny preset, both sides from one commit: it checks the plumbing, not speed)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "speed_vs_base.sh"
TABLE = ROOT / "scripts" / "speed_table.py"


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _table(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TABLE), *args], capture_output=True, text=True, timeout=60)


def _rows(markdown: str) -> dict[str, list[str]]:
    """metric -> [base, head, head/base, verdict] of the table's body rows."""
    out = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 5 and cells[0] not in ("metric", "---"):
            out[cells[0]] = cells[1:]
    return out


def _e2e(ms: float, batch: int = 1, **kw) -> dict:
    return {"model": "mamba2-2.7b", "batch": batch, "provider": "fastmamba", "ms_per_step": ms,
            "decode_tok_s": batch * 1e3 / ms, **kw}


def test_speed_table_ratios_and_verdicts(tmp_path):
    serve = {"model": "mamba2-2.7b", "requests": 256, "concurrency": 64, "prompt_len": 512, "output_len": 128,
             "server_tok_per_s": 5000.0, "offline_tok_per_s": 5100.0, "ttft_p50_ms": 40.0, "ttft_p99_ms": 90.0,
             "itl_p50_ms": 12.0, "itl_p99_ms": 20.0}
    base = _write(tmp_path / "base.jsonl", [
        _e2e(2.0), _e2e(10.0, batch=64),
        _e2e(9.0, provider="transformers 5 (torch path)"),  # a peer: not compared
        dict(_e2e(1.0), provider="fastmamba speculative K=5 (oracle)", speculate=5),  # not compared
        _e2e(1.5, provider="fastmamba [fp16 state]"),  # not compared
        {"model": "mamba2-2.7b", "batch": 1, "length": 2048, "eager_ms": 30.0, "graphed_ms": 20.0},
        {"model": "mamba2-2.7b", "batch": 1, "length": 128, "eager_ms": 5.0, "graphed_ms": 4.0},
        serve,
    ])
    head = _write(tmp_path / "head.jsonl", [
        _e2e(2.05), _e2e(11.0, batch=64),  # +2.5% (within), +10% (slower)
        {"model": "mamba2-2.7b", "batch": 1, "length": 2048, "eager_ms": 30.0, "graphed_ms": 19.0},  # -5%: faster
        dict(serve, server_tok_per_s=4900.0, ttft_p50_ms=50.0, itl_p99_ms=18.0),
    ])
    # a second round of HEAD in another file: the median of 2.05 and 1.95 is 2.0
    head2 = _write(tmp_path / "head2.jsonl", [_e2e(1.95), _e2e(11.0, batch=64)])
    res = _table("--base", str(base), "--head", str(head), str(head2))
    assert res.returncode == 0, res.stderr
    rows = _rows(res.stdout)
    assert rows["e2e mamba2-2.7b decode ms/step, batch 1 (median of 2)"] == ["2", "2", "1.000", "yes"]
    assert rows["e2e mamba2-2.7b decode ms/step, batch 64 (median of 2)"] == ["10", "11", "1.100", "NO (slower)"]
    assert rows["ttft mamba2-2.7b graphed ms, 1 x 2048"] == ["20", "19", "0.950", "yes (faster)"]
    assert rows["ttft mamba2-2.7b graphed ms, 1 x 128"] == ["4", "—", "—", "missing"]
    shape = "(256 req, 64 conc, 512/128 tok)"
    assert rows[f"serve mamba2-2.7b server output tok/s {shape}"] == ["5000", "4900", "0.980", "yes"]  # higher is better
    assert rows[f"serve mamba2-2.7b server TTFT p50 ms {shape}"] == ["40", "50", "1.250", "NO (slower)"]
    assert rows[f"serve mamba2-2.7b server ITL p99 ms {shape}"] == ["20", "18", "0.900", "yes (faster)"]
    assert len(rows) == 4 + 6  # peers, speculative and 16-bit state rows are not compared
    assert "7 of 10 measurements within ±3% or better" in res.stdout
    # a wider band turns the +10% into "yes"
    wide = _rows(_table("--base", str(base), "--head", str(head), str(head2), "--tolerance", "0.2").stdout)
    assert wide["e2e mamba2-2.7b decode ms/step, batch 64 (median of 2)"][3] == "yes"


def test_speed_table_bad_input(tmp_path):
    good = _write(tmp_path / "good.jsonl", [_e2e(2.0)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_e2e(2.0)) + "\nnot json\n")
    res = _table("--base", str(good), "--head", str(bad))
    assert res.returncode != 0 and f"{bad}:2 is not a JSON line" in res.stderr
    res = _table("--base", str(good), "--head", str(tmp_path / "absent.jsonl"))
    assert res.returncode != 0 and "cannot read" in res.stderr and "absent.jsonl" in res.stderr
    other = _write(tmp_path / "other.jsonl", [{"op": "ssu", "median_us": 3.0}])
    res = _table("--base", str(other), "--head", str(other))
    assert res.returncode != 0 and "no e2e, ttft or serve rows" in res.stderr
    res = _table("--base", str(good), "--head", str(good), "--tolerance", "-0.1")
    assert res.returncode != 0 and "--tolerance expects a fraction" in res.stderr


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def git_head():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("prepare reads a commit with git archive: not a git checkout")
    return _git("rev-parse", "HEAD")


def _script(*args: str, env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHON": sys.executable, **env})


def test_prepare_writes_the_commits_package(tmp_path, git_head):
    base = tmp_path / "base"
    res = _script("prepare", "HEAD", env={"SPEED_BASE_DIR": str(base)})
    assert res.returncode == 0, res.stderr
    assert (base / "COMMIT").read_text().strip() == git_head
    written = sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file() and p.name != "COMMIT")
    assert written == sorted(_git("ls-tree", "-r", "--name-only", "HEAD", "fastmamba").splitlines())
    # the default folder is git-ignored (it travels to the device only when carried)
    assert subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", ".base/"]).returncode == 0
    res = _script("prepare", "no-such-commit-xyz", env={"SPEED_BASE_DIR": str(tmp_path / "other")})
    assert res.returncode == 2 and "no-such-commit-xyz is not a commit" in res.stderr
    assert not (tmp_path / "other").exists()


def test_run_refuses_without_a_prepared_base(tmp_path):
    res = _script("run", "e2e-mamba2-tiny@1", env={"SPEED_BASE_DIR": str(tmp_path / "none"), "OUT": str(tmp_path / "out")})
    assert res.returncode == 2 and "prepare COMMIT" in res.stderr


def test_run_dry_on_cpu(tmp_path, git_head):
    """Both sides (here the same commit) run the tiny preset's e2e in fresh processes from their own
    package; each appends its row, and the table compares them."""
    base, out = tmp_path / "base", tmp_path / "out"
    assert _script("prepare", "HEAD", env={"SPEED_BASE_DIR": str(base)}).returncode == 0
    env = {"SPEED_BASE_DIR": str(base), "OUT": str(out), "TRITON_CACHE_DIR": str(tmp_path / "tc")}
    # the script's plumbing is under test, not the kernels (tests/ops run those under the interpreter):
    # the benches run the PyTorch reference ops, a few seconds a side instead of forty
    env["TRITON_INTERPRET"] = "0"
    env["SPEED_E2E_ARGS"] = "--gen-len 6"  # appended on both sides
    res = _script("run", "e2e-mamba2-tiny@1", "no-such-step", env=env)
    assert res.returncode == 0, res.stderr
    log = (out / "speed.log").read_text()
    assert f"--- base ({base.resolve()})" in log and f"--- head ({ROOT})" in log, log
    assert log.count("rc=0") == 2 and "unknown step no-such-step" in log, log
    assert log.count("-m fastmamba.bench e2e --model mamba2-tiny --batch 1 --gen-len 6 --json speed-") == 2, log
    for side in ("base", "head"):
        rows = [json.loads(line) for line in (out / f"speed-{side}.jsonl").read_text().splitlines()]
        assert [(r["model"], r["batch"], r["provider"]) for r in rows] == [("mamba2-tiny", 1, "fastmamba")]
        assert f"speed-{side}.jsonl" in rows[0]["command"]
    table = _rows((out / "speed.md").read_text())
    (name, (b, h, ratio, verdict)), = table.items()
    assert name == "e2e mamba2-tiny decode ms/step, batch 1"
    assert float(ratio) == pytest.approx(float(h) / float(b), rel=2e-3) and verdict != "missing"
