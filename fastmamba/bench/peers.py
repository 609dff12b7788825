"""Optional peers, imported only if present: mamba_ssm's Triton ops and Dao-AILab's causal-conv1d.

mamba_ssm is usually installed from a pure-Python wheel whose top-level ``import mamba_ssm`` fails
(its ``__init__`` pulls in CUDA extensions that were never built). Its Triton ops need none of
them, so we load just those submodules: find the package directory without importing it, register
empty stand-in packages for ``mamba_ssm``, ``mamba_ssm.ops`` and ``mamba_ssm.ops.triton`` (their
``__init__`` files never run), then import the submodule normally. The submodules themselves need
torch, triton, einops and packaging.

Each loader returns a ``Peer`` and never raises: an unavailable peer carries the reason, which
the report prints once in its header.
"""
from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Peer:
    name: str
    version: str
    fn: Callable | None
    reason: str = ""  # why it is unavailable (empty when fn is set)
    source: str = ""  # where it was loaded from

    @property
    def available(self) -> bool:
        return self.fn is not None


def dist_version(*names: str) -> str:
    """Installed distribution version (first of ``names`` found), or '?'."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "?"


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def find_package_dir(name: str, search_path: list[str] | None = None) -> str | None:
    """Directory of top-level package ``name``, found without executing its ``__init__``."""
    if search_path is None:
        try:
            spec = importlib.util.find_spec(name)  # top-level: locates, does not import
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            return list(spec.submodule_search_locations)[0]
    for entry in search_path if search_path is not None else sys.path:
        candidate = os.path.join(entry or os.getcwd(), name)
        if os.path.isdir(candidate):
            return candidate
    return None


def _stub_package(name: str, path: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [path]
    module.__package__ = name
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [path]
    module.__spec__ = spec
    module.__file__ = None
    return module


def import_without_init(package: str, submodule: str, search_path: list[str] | None = None) -> types.ModuleType:
    """Import ``package.submodule`` (dotted) without running the ``__init__.py`` of any parent.

    Parents already in ``sys.modules`` (really imported, or stubbed by an earlier call) are kept.
    """
    root = find_package_dir(package, search_path)
    if root is None:
        raise ModuleNotFoundError(f"No module named '{package}'")
    parts = submodule.split(".")
    path = root
    name = package
    for part in [None, *parts[:-1]]:
        if part is not None:
            name = f"{name}.{part}"
            path = os.path.join(path, part)
        if name not in sys.modules:
            sys.modules[name] = _stub_package(name, path)
    return importlib.import_module(f"{package}.{submodule}")


def _mamba_ssm_version(search_path: list[str] | None = None) -> str:
    version = dist_version("mamba_ssm", "mamba-ssm")
    if version != "?":
        return version
    root = find_package_dir("mamba_ssm", search_path)
    if root:  # read __version__ from the text of __init__.py without executing it
        try:
            with open(os.path.join(root, "__init__.py"), encoding="utf-8") as f:
                m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read())
            if m:
                return m.group(1)
        except OSError:
            pass
    return "?"


def _mamba_ssm_peer(submodule: str, attr: str, search_path: list[str] | None = None) -> Peer:
    try:
        module = import_without_init("mamba_ssm", submodule, search_path)
        fn = getattr(module, attr)
    except Exception as exc:  # missing package, einops, a Triton incompatibility...
        return Peer("mamba_ssm", _mamba_ssm_version(search_path), None, _describe(exc))
    return Peer("mamba_ssm", _mamba_ssm_version(search_path), fn, source=getattr(module, "__file__", "") or "")


@functools.lru_cache(maxsize=None)
def mamba_ssm_selective_state_update() -> Peer:
    """``mamba_ssm.ops.triton.selective_state_update.selective_state_update``."""
    return _mamba_ssm_peer("ops.triton.selective_state_update", "selective_state_update")


@functools.lru_cache(maxsize=None)
def mamba_ssm_rmsnorm_fn() -> Peer:
    """``mamba_ssm.ops.triton.layernorm_gated.rmsnorm_fn``."""
    return _mamba_ssm_peer("ops.triton.layernorm_gated", "rmsnorm_fn")


@functools.lru_cache(maxsize=None)
def mamba_ssm_chunk_scan_combined() -> Peer:
    """``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` (the prefill scan)."""
    return _mamba_ssm_peer("ops.triton.ssd_combined", "mamba_chunk_scan_combined")


def _causal_conv1d_peer(attr: str) -> Peer:
    version = dist_version("causal_conv1d", "causal-conv1d")
    try:
        module = importlib.import_module("causal_conv1d")
        fn = getattr(module, attr)
    except Exception as exc:
        return Peer("causal_conv1d", version, None, _describe(exc))
    return Peer("causal_conv1d", version, fn, source=module.__file__ or "")


@functools.lru_cache(maxsize=None)
def causal_conv1d_update() -> Peer:
    """Dao-AILab causal-conv1d's CUDA ``causal_conv1d_update`` (needs its compiled extension)."""
    return _causal_conv1d_peer("causal_conv1d_update")


@functools.lru_cache(maxsize=None)
def causal_conv1d_fn() -> Peer:
    """Dao-AILab causal-conv1d's CUDA ``causal_conv1d_fn``, the prefill conv (needs its compiled extension)."""
    return _causal_conv1d_peer("causal_conv1d_fn")
