"""The GPU suite's logs (tests/conftest.py): FASTMAMBA_FAILURE_LOG names each failure as it happens,
FASTMAMBA_DONE_LOG lists the tests that passed or skipped, and FASTMAMBA_RESUME_FROM leaves those
out of the next run, under pytest-xdist as the GPU machine runs it (each entry once: the controller's)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = '''
import pytest


def test_passes():
    assert True


def test_fails():
    assert 1 == 2, "the failure's message"


@pytest.mark.skip(reason="skipped")
def test_skipped():
    pass


@pytest.mark.parametrize("i", [1, 2])
def test_each(i):
    assert i
'''


def pytest_run(tmp_path, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, **{k: str(v) for k, v in env.items()})
    for key in ("FASTMAMBA_FAILURE_LOG", "FASTMAMBA_DONE_LOG", "FASTMAMBA_RESUME_FROM"):
        if key not in env:
            full.pop(key, None)
    for key in [k for k in full if k.startswith("PYTEST_")]:  # this test's own run (an xdist worker in CI)
        full.pop(key)
    # the repository's conftest.py holds the hooks: the cases run from a copy of the tests package
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
                           str(tmp_path / "tests" / "test_cases.py")], cwd=tmp_path, env=full,
                          capture_output=True, text=True, timeout=300)


def test_failures_done_and_resume(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "__init__.py").write_text("")
    (tests / "conftest.py").write_text(open(os.path.join(ROOT, "tests", "conftest.py")).read())
    (tests / "test_cases.py").write_text(CASES)
    failures, done = tmp_path / "failures.txt", tmp_path / "done.txt"
    run = pytest_run(tmp_path, FASTMAMBA_FAILURE_LOG=failures, FASTMAMBA_DONE_LOG=done)
    assert "1 failed, 3 passed, 1 skipped" in run.stdout, run.stdout + run.stderr
    logged = failures.read_text()
    assert logged.count("=== FAILED ") == 1 and "tests/test_cases.py::test_fails (call)" in logged
    assert "the failure's message" in logged
    assert sorted(done.read_text().split()) == sorted(
        f"tests/test_cases.py::{t}" for t in ("test_passes", "test_skipped", "test_each[1]", "test_each[2]"))
    again = pytest_run(tmp_path, FASTMAMBA_RESUME_FROM=done)
    assert again.returncode == 1 and "1 failed in" in again.stdout, again.stdout + again.stderr
