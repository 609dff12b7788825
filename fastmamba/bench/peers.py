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

    Parents already in ``sys.modules`` (really imported) are kept. The stand-in parents this call
    registers are removed again once the import is done: left in ``sys.modules`` they would make a
    later ``import package`` succeed, and e.g. transformers (which imports mamba_ssm at import time
    and takes its ops where that works) would run the peer's kernels where it reports its own. The
    imported submodules stay (a later ``from package.a.b import f`` finds them).
    """
    root = find_package_dir(package, search_path)
    if root is None:
        raise ModuleNotFoundError(f"No module named '{package}'")
    parts = submodule.split(".")
    path = root
    name = package
    added = []
    try:
        for part in [None, *parts[:-1]]:
            if part is not None:
                name = f"{name}.{part}"
                path = os.path.join(path, part)
            if name not in sys.modules:
                sys.modules[name] = _stub_package(name, path)
                added.append(name)
        return importlib.import_module(f"{package}.{submodule}")
    finally:
        for name in added:
            sys.modules.pop(name, None)


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


def mamba_ssm_model_kwargs(cfg) -> dict:
    """``mamba_ssm.models.config_mamba.MambaConfig`` fields for a fastmamba ``Mamba2Config``: the same
    Mamba-2 LM shape (every layer Mamba-2, no MLP, RMSNorm with fused add, fp32 residual as
    configured). ``use_mem_eff_path`` is off: the fused path calls causal-conv1d's CUDA extension,
    which the pure-Python wheel lacks; the unfused path runs the conv through ``nn.Conv1d`` when
    causal-conv1d is absent, the scan and the norms through mamba_ssm's Triton kernels."""
    return {
        "d_model": cfg.d_model, "d_intermediate": 0, "n_layer": cfg.n_layer, "vocab_size": cfg.vocab_size,
        "ssm_cfg": {"layer": "Mamba2", "d_state": cfg.d_state, "d_conv": cfg.d_conv, "expand": cfg.expand,
                    "headdim": cfg.headdim, "ngroups": cfg.ngroups, "chunk_size": cfg.chunk_size,
                    "use_mem_eff_path": False},
        "rms_norm": True, "residual_in_fp32": cfg.residual_in_fp32, "fused_add_norm": True,
        "pad_vocab_size_multiple": 1, "tie_embeddings": cfg.tie_embeddings,
    }


@functools.lru_cache(maxsize=None)
def mamba_ssm_lm_head_model(search_path: tuple[str, ...] | None = None) -> Peer:
    """mamba_ssm's ``MambaLMHeadModel`` (``models.mixer_seq_simple``), imported without mamba_ssm's
    ``__init__``. ``fn(cfg, device, dtype)`` builds the model of a fastmamba ``Mamba2Config`` with
    random weights (``mamba_ssm_model_kwargs``). Its Mamba-1 module imports ``selective_scan_cuda``,
    a CUDA extension the pure-Python wheel never built and Mamba-2 models never call: a stand-in
    module is registered under that name (in this process's ``sys.modules``) before the import."""
    version = _mamba_ssm_version(list(search_path) if search_path else None)
    try:
        sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
        models = import_without_init("mamba_ssm", "models.mixer_seq_simple", list(search_path) if search_path else None)
        config = import_without_init("mamba_ssm", "models.config_mamba", list(search_path) if search_path else None)
    except Exception as exc:  # missing package, einops, transformers, a Triton incompatibility...
        return Peer("mamba_ssm", version, None, _describe(exc))

    def build(cfg, device, dtype):
        return models.MambaLMHeadModel(config.MambaConfig(**mamba_ssm_model_kwargs(cfg)), device=device,
                                       dtype=dtype).eval()

    return Peer("mamba_ssm", version, build, source=getattr(models, "__file__", "") or "")


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


# --- vLLM's Triton mamba ops ----------------------------------------------------------------------
# vLLM is a large install with CUDA extensions; its Mamba ops (vllm/model_executor/layers/mamba/ops/)
# are plain Triton. They are taken from the vLLM wheel into the git-ignored ``peers/vllm_mamba_ops/``
# (scripts/fetch_vllm_peer.sh does this):
#     pip download --no-deps vllm==0.33.0 -d /tmp/vllm_whl
#     unzip /tmp/vllm_whl/vllm-*.whl 'vllm/model_executor/layers/mamba/ops/*'  -> copy that folder
# and imported under their own ``vllm.*`` names, with stand-in modules for the few vLLM modules
# they import (triton_utils, logger, platforms, envs, _custom_ops, two constants). Nothing of vLLM
# runs but these ops.
VLLM_OPS_PACKAGE = "vllm.model_executor.layers.mamba.ops"
VLLM_VERSION = "0.33.0"  # the wheel peers/vllm_mamba_ops/ comes from (the folder does not say)


def vllm_ops_dir() -> str | None:
    """``peers/vllm_mamba_ops`` next to the fastmamba package (or $FASTMAMBA_VLLM_OPS), if present."""
    env = os.environ.get("FASTMAMBA_VLLM_OPS")
    if env:
        return env if os.path.isdir(env) else None
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "peers", "vllm_mamba_ops")
    return path if os.path.isfile(os.path.join(path, "mamba_ssm.py")) else None


class _OnceLogger:
    """vllm.logger's logger: standard logging plus the *_once methods the ops call."""

    def __init__(self, name: str) -> None:
        import logging

        self._log = logging.getLogger(name)
        self._seen: set = set()

    def __getattr__(self, attr: str):
        if attr.endswith("_once"):
            level = attr[: -len("_once")]

            def once(msg, *args, **kwargs):
                if (level, msg) not in self._seen:
                    self._seen.add((level, msg))
                    getattr(self._log, level)(msg, *args)

            return once
        return getattr(self._log, attr)


class _Platform:
    """vllm.platforms.current_platform, as far as the Mamba ops ask: CUDA (or, on a machine without
    one, a platform that is not "cpu", so the ops keep their Triton kernels for the interpreter)."""

    @staticmethod
    def _cuda() -> bool:
        import torch

        return torch.cuda.is_available()

    def is_cuda(self) -> bool:
        return self._cuda()

    def is_cpu(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_rocm(self) -> bool:
        return False

    def is_device_capability(self, capability, device_id: int = 0) -> bool:
        import torch

        if not self._cuda():
            return False
        major, minor = torch.cuda.get_device_capability(device_id)
        want = capability if isinstance(capability, int) else capability[0] * 10 + capability[1]
        return major * 10 + minor == want

    def is_arch_support_pdl(self) -> bool:
        import torch

        return self._cuda() and torch.cuda.get_device_capability()[0] >= 9

    def get_device_name(self, device_id: int = 0) -> str:
        import torch

        return torch.cuda.get_device_name(device_id) if self._cuda() else "cpu"


def _register_vllm_stand_ins(ops_dir: str) -> None:
    """Stand-in ``vllm.*`` modules for what the Mamba ops import; the ops package points at ``ops_dir``."""
    import triton
    import triton.language as tl

    def module(name: str, package: bool = False, path: str | None = None, **attrs) -> types.ModuleType:
        m = _stub_package(name, path or "") if package else types.ModuleType(name)
        if package and path is None:
            m.__path__ = []
        for k, v in attrs.items():
            setattr(m, k, v)
        sys.modules[name] = m
        return m

    platform = _Platform()
    for pkg in ("vllm", "vllm.utils", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends",
                "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.mamba"):
        module(pkg, package=True)
    module(VLLM_OPS_PACKAGE, package=True, path=ops_dir)
    module("vllm.envs", VLLM_TUNED_CONFIG_FOLDER=None)
    module("vllm._custom_ops")  # the CUDA selective_scan_fwd: not used by the ops we load
    module("vllm.logger", init_logger=_OnceLogger)
    module("vllm.platforms", current_platform=platform)
    module("vllm.triton_utils", triton=triton, tl=tl, HAS_TRITON=True)
    module("vllm.utils.platform_utils",
           get_device_name_as_file_name=lambda device_id=0: re.sub(r"[\s/]+", "_", platform.get_device_name(device_id)))
    module("vllm.v1.attention.backends.utils", PAD_SLOT_ID=-1, NULL_BLOCK_ID=0)


@functools.lru_cache(maxsize=None)
def _vllm_module(submodule: str) -> types.ModuleType:
    ops_dir = vllm_ops_dir()
    if ops_dir is None:
        raise ModuleNotFoundError("peers/vllm_mamba_ops/ not found (see fastmamba/bench/peers.py: extract vLLM's "
                                  "mamba ops from its wheel there)")
    existing = sys.modules.get("vllm")
    if existing is not None and getattr(existing, "__file__", None):
        raise ImportError("a real vllm package is already imported; its mamba ops are not loaded from peers/")
    if VLLM_OPS_PACKAGE not in sys.modules:
        _register_vllm_stand_ins(ops_dir)
        from fastmamba.ops.runtime import interpreter_enabled

        if interpreter_enabled():  # autotuning times kernels on a GPU: take each kernel's first config
            helpers = importlib.import_module(f"{VLLM_OPS_PACKAGE}.triton_helpers")
            helpers.launch_autotuned = lambda kernel, grid, **kw: kernel.fn[grid](**kw, **kernel.configs[0].all_kwargs())
    return importlib.import_module(f"{VLLM_OPS_PACKAGE}.{submodule}")


def _vllm_peer(submodule: str, attr: str) -> Peer:
    try:
        module = _vllm_module(submodule)
        fn = getattr(module, attr)
    except Exception as exc:  # noqa: BLE001 - missing folder, a Triton incompatibility...
        return Peer("vLLM", VLLM_VERSION, None, _describe(exc))
    return Peer("vLLM", VLLM_VERSION, fn, source=getattr(module, "__file__", "") or "")


@functools.lru_cache(maxsize=None)
def vllm_selective_state_update() -> Peer:
    """vLLM's Triton ``selective_state_update`` (mamba_ssm.py): (state, x, dt, A, B, C, D, dt_bias, z,
    dt_softplus, state_batch_indices, ..., null_block_id, out) -- ``out`` is required."""
    return _vllm_peer("mamba_ssm", "selective_state_update")


@functools.lru_cache(maxsize=None)
def vllm_causal_conv1d_update() -> Peer:
    """vLLM's Triton ``causal_conv1d_update`` (without ``out`` it overwrites x)."""
    return _vllm_peer("causal_conv1d", "causal_conv1d_update")


@functools.lru_cache(maxsize=None)
def vllm_causal_conv1d_fn() -> Peer:
    """vLLM's Triton ``causal_conv1d_fn``: the packed varlen prefill conv, x [D, T] channel-last
    with a slot cache (our ``causal_conv1d_varlen``)."""
    return _vllm_peer("causal_conv1d", "causal_conv1d_fn")


@functools.lru_cache(maxsize=None)
def vllm_chunk_scan_combined() -> Peer:
    """vLLM's Triton ``mamba_chunk_scan_combined_varlen`` (ssd_combined.py): packed sequences with
    chunk metadata (cu_chunk_seqlens, last_chunk_indices, seq_idx per chunk) computed by the caller."""
    return _vllm_peer("ssd_combined", "mamba_chunk_scan_combined_varlen")


def vllm_conv_metadata(lengths: list[int], device) -> types.SimpleNamespace:
    """The ``metadata`` vLLM's ``causal_conv1d_fn`` takes for a batch of sequence ``lengths`` (what
    vLLM's attention-metadata builder computes once per batch): the (sequence, block) pair of each
    program for its BLOCK_M of 8 tokens. Without it the op reads query_start_loc on the host and
    resizes its buffers in the launch grid callback every call."""
    import torch

    block_m = 8
    nums = [-(-n // block_m) for n in lengths]
    mlist = [b for b, n in enumerate(nums) for _ in range(n)]
    offsets = [k for n in nums for k in range(n)]
    batch_ptr = torch.tensor(mlist, dtype=torch.int32, device=device)
    offset_ptr = torch.tensor(offsets, dtype=torch.int32, device=device)
    entry = dict(nums=nums, tot=sum(nums), mlist=batch_ptr, mlist_len=len(mlist), offsetlist=offset_ptr,
                 batch_ptr=batch_ptr, token_chunk_offset_ptr=offset_ptr)
    return types.SimpleNamespace(nums_dict={block_m: entry}, batch_ptr=batch_ptr, token_chunk_offset_ptr=offset_ptr)


def vllm_chunk_metadata(lengths: list[int], chunk_size: int, device) -> dict:
    """cu_seqlens, cu_chunk_seqlens, last_chunk_indices and seq_idx (one per chunk) for vLLM's
    ``mamba_chunk_scan_combined_varlen``: each sequence cut into chunks of ``chunk_size`` tokens from
    its start (no prefix-cache offset), as vLLM's metadata builder does for fresh prompts."""
    import torch

    cu, cu_chunks, last, seq_idx = [0], [0], [], []
    for b, n in enumerate(lengths):
        start = cu[-1]
        for s in range(0, n, chunk_size):
            cu_chunks.append(start + min(s + chunk_size, n))
            seq_idx.append(b)
        last.append(len(seq_idx) - 1)
        cu.append(start + n)

    def t(v):
        return torch.tensor(v, dtype=torch.int32, device=device)

    return dict(cu_seqlens=t(cu), cu_chunk_seqlens=t(cu_chunks), last_chunk_indices=t(last), seq_idx=t(seq_idx))
