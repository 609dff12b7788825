"""The header every benchmark row carries: device, versions, commit, date, command."""
from __future__ import annotations

import datetime
import os
import platform
import shutil
import subprocess

import torch

from fastmamba.ops.runtime import interpreter_enabled
from fastmamba.bench.peak import device_name

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(cmd: list[str], cwd: str | None = None) -> str:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def git_commit() -> str:
    """Short commit of the checkout this package runs from, '+dirty' if tracked files changed; '' if none.

    ``FASTMAMBA_GIT_COMMIT`` wins when set: a copy of the tree without its .git (the lent GPU
    machine gets one) can still name the commit it was made from.
    """
    if os.environ.get("FASTMAMBA_GIT_COMMIT"):
        return os.environ["FASTMAMBA_GIT_COMMIT"]
    if not os.path.exists(os.path.join(REPO_ROOT, ".git")) or shutil.which("git") is None:
        return ""
    commit = _run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT)
    if not commit:
        return ""
    # --no-optional-locks: a read-only look, no index refresh written back
    dirty = _run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT)
    return commit + ("+dirty" if dirty else "")


def driver_version() -> str:
    if shutil.which("nvidia-smi") is None:
        return ""
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else ""


def triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception:  # noqa: BLE001
        return "not importable"


def collect(device: torch.device, command: str) -> dict:
    """Header fields (flat, JSON-ready) for a run on ``device``."""
    import fastmamba

    info = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command,
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": triton_version(),
        "python": platform.python_version(),
        "fastmamba": getattr(fastmamba, "__version__", "?"),
        "git_commit": git_commit(),
        "host": platform.node(),
        "interpreter": interpreter_enabled(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu_sms=props.multi_processor_count,
            gpu_memory_gib=round(props.total_memory / (1 << 30), 1),
            compute_capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda or "",
            driver=driver_version(),
        )
    return info
