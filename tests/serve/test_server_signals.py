"""SIGTERM while the server is still loading its model: nothing to drain, so it leaves at once with
status 0, no traceback, and no engine process left behind (the engine process ignores SIGTERM so
that a signal to the whole process group cannot kill it under a drain; the server kills it on exit).
Draining a running server: tests/serve/test_server_lifecycle.py and test_server.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
if not os.path.isdir("/proc"):
    pytest.skip("reads the process table from /proc (Linux)", allow_module_level=True)

from tests.serve.conftest import free_port


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (the engine process is a spawned child of the server)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_while_loading_exits_0_and_leaves_no_engine():
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.Popen([sys.executable, "-m", "fastmamba.serve", "--model", "nemotron-h-tiny", "--device", "cpu",
                             "--port", str(port)], stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stderr.readline()  # the first start-up line: the engine process is being started
        assert "starting the engine process" in line, line
        time.sleep(1.0)
        children = _children(proc.pid)
        assert children, "the engine process did not start"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
        err = proc.stderr.read()
        assert rc == 0 and "Traceback" not in err, err
        deadline = time.time() + 15
        while time.time() < deadline and any(map(_running, children)):
            time.sleep(0.1)
        assert not [pid for pid in children if _running(pid)]
    finally:
        if proc.poll() is None:  # a failed check must not leave the server running
            proc.kill()
            proc.wait()
