"""fastmamba as a kernel provider for transformers' Mamba-2 and Nemotron-H models.

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    fastmamba.integrations.transformers.use(model)      # or: with use(model): ...
    model.generate(...)                                 # conv, scan, state update, gated norm, MoE on fastmamba,
                                                        # decode steps replayed from CUDA graphs (hf_graphs)
    fastmamba.integrations.transformers.unuse(model)    # transformers' own path again

What ``use`` replaces, per model (other models in the process are untouched):
  * each Mamba-2 mixer's private hook wrappers (transformers' ``use_kernelized_func`` gives every
    mixer its own copy of ``causal_conv1d_forward``, ``mamba2_scan_forward`` (5.25+), ``causal_conv1d_fn``,
    ``causal_conv1d_update``, ``selective_state_update``, ``mamba_chunk_scan_combined``): their
    ``forward`` becomes fastmamba's (fastmamba.integrations.hf_ops);
  * each mixer's gated RMSNorm and each MoE router: their instance ``forward``;
  * the experts: ``ExpertsInterface.register("fastmamba", ...)`` and the model's
    ``set_experts_implementation("fastmamba")`` (restored on ``unuse``).
Without per-mixer wrappers (no ``kernels`` package, or one outside the range the transformers
release accepts, as 0.19 for 5.17) the hooks are replaced in the modeling module by dispatchers
(installed on the first ``use``, removed with the last ``unuse``) that run fastmamba only inside the
forward of a used model's mixer (its instance ``forward`` marks the call), transformers' code
everywhere else. transformers 5.17 has only the function hooks (its mixers keep the cache logic and
already update the states in place). With ``cuda_graphs`` (the default), each run of graph-safe
decoder blocks replays its one-token decode step from a CUDA graph (fastmamba.integrations.hf_graphs;
transformers 5.25+ caches on CUDA). See README.md here.
"""
from __future__ import annotations

import contextvars
import importlib
from dataclasses import dataclass, field
from types import MethodType

import torch

from fastmamba.integrations import hf_ops
from fastmamba.integrations.hf_graphs import DecodeGraphs

SUPPORTED_TRANSFORMERS = ">=5.17,<6"
EXPERTS_NAME = "fastmamba"
_MODELING = ("transformers.models.mamba2.modeling_mamba2", "transformers.models.nemotron_h.modeling_nemotron_h")
_MIXERS = ("Mamba2Mixer", "NemotronHMamba2Mixer")
_NORMS = ("Mamba2RMSNormGated", "NemotronHRMSNormGated", "MambaRMSNormGated", "Zamba2RMSNormGated")
# the four function hooks every supported release has (5.25 adds the whole ops, hf_ops.HOOKS)
_FUNCTION_HOOKS = ("causal_conv1d_fn", "causal_conv1d_update", "selective_state_update", "mamba_chunk_scan_combined")
# modeling-module attribute -> (fastmamba's implementation, whether it takes transformers' code first);
# the last four are in every supported release, the whole ops from 5.25
_MODULE_HOOKS = {
    "causal_conv1d_forward": (hf_ops.conv_forward, True),
    "mamba2_scan_forward": (hf_ops.scan_forward, True),
    "causal_conv1d_fn": (hf_ops.causal_conv1d_fn, False),
    "causal_conv1d_update": (hf_ops.causal_conv1d_update, False),
    "mamba2_selective_state_update": (hf_ops.selective_state_update, False),
    "mamba2_chunk_scan": (hf_ops.chunk_scan, False),
}
_MODULE_FUNCTIONS = ("causal_conv1d_fn", "causal_conv1d_update", "mamba2_selective_state_update", "mamba2_chunk_scan")
_ATTR = "_fastmamba_provider"


def check_transformers_version(version: str | None = None) -> str:
    """Raise RuntimeError unless ``version`` (default: the installed transformers') is in
    SUPPORTED_TRANSFORMERS; return it."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    if version is None:
        import transformers

        version = transformers.__version__
    if Version(version) not in SpecifierSet(SUPPORTED_TRANSFORMERS):
        raise RuntimeError(
            f"fastmamba.integrations.transformers supports transformers {SUPPORTED_TRANSFORMERS} (5.17 or newer, "
            f"before 6.0); found {version}. Other releases lack or change the Mamba-2 hooks it replaces; install "
            f"e.g. `pip install 'transformers{SUPPORTED_TRANSFORMERS}'`.")
    return version


@dataclass
class Provider:
    """What ``use`` changed on one model, so ``unuse`` can put it back. A context manager."""

    model: torch.nn.Module
    mode: str  # "instance" (per-mixer hook wrappers) or "dispatch" (modeling-module dispatchers)
    forwards: list[tuple[torch.nn.Module, object]] = field(default_factory=list)  # (module, its previous own forward)
    experts_before: dict | None = None  # the model's experts implementation before ``use``
    modeling: list[str] = field(default_factory=list)  # modeling modules whose dispatchers this model holds
    graphs: DecodeGraphs | None = None  # the decode step's CUDA graphs (``use(..., cuda_graphs=True)``)

    def __enter__(self) -> "Provider":
        return self

    def __exit__(self, *exc) -> None:
        unuse(self.model)


def is_used(model: torch.nn.Module) -> bool:
    """Whether ``use(model)`` is in effect."""
    return isinstance(model.__dict__.get(_ATTR), Provider)


def use(model: torch.nn.Module, cuda_graphs: bool = True) -> Provider:
    """Run ``model``'s Mamba-2 mixers (conv, scan, state update, gated norm) and Nemotron MoE layers
    (router, experts) on fastmamba's ops; returns the Provider (``with use(model): ...`` undoes it
    on exit). Calling it again on the same model returns the same Provider.

    cuda_graphs: replay one-token decode steps of the Mamba / MLP / MoE blocks from CUDA graphs
    (hf_graphs: CUDA tensors and a transformers 5.25+ cache; other calls run eagerly); False runs
    every step eagerly. ``provider.graphs.stats`` counts captures, replays and eager steps.

    model: transformers' Mamba2ForCausalLM / Mamba2Model / NemotronHForCausalLM / NemotronHModel
    (or any module holding their mixers). Raises RuntimeError for an unsupported transformers
    version, ValueError for a model without Mamba-2 mixers, TypeError for a ``cuda_graphs`` that is
    not a bool; nothing is changed then.
    """
    if not isinstance(cuda_graphs, bool):  # a string such as "false" would be truthy
        raise TypeError(f"fastmamba.integrations.transformers.use: cuda_graphs must be True or False, got "
                        f"{cuda_graphs!r}")
    check_transformers_version()
    if is_used(model):
        return model.__dict__[_ATTR]
    mixers = [m for m in model.modules() if type(m).__name__ in _MIXERS and type(m).__module__ in _MODELING]
    if not mixers:
        raise ValueError(f"fastmamba.integrations.transformers.use: {type(model).__name__} has no Mamba-2 mixer "
                         "(expected transformers' Mamba2ForCausalLM or NemotronHForCausalLM)")
    instance = all(isinstance(getattr(m, "_kernel_funcs", None), dict) for m in mixers)
    if instance:
        missing = sorted({n for m in mixers for n in _FUNCTION_HOOKS if n not in m._kernel_funcs})
    else:
        modules = {importlib.import_module(type(m).__module__) for m in mixers}
        missing = sorted({f"{mod.__name__}.{n}" for mod in modules for n in _MODULE_FUNCTIONS
                          if not callable(getattr(mod, n, None))})
    if missing:
        raise RuntimeError(f"fastmamba.integrations.transformers.use: this transformers release has no Mamba-2 "
                           f"hooks named {missing}; supported: transformers {SUPPORTED_TRANSFORMERS}")

    p = Provider(model=model, mode="instance" if instance else "dispatch")
    for mixer in mixers:
        if instance:
            for name, hook in hf_ops.HOOKS.items():
                if name in mixer._kernel_funcs:  # 5.17 has no whole-op hooks
                    _set_forward(p, mixer._kernel_funcs[name], hook)
        else:
            _set_forward(p, mixer, _marked_forward)
        if type(mixer.norm).__name__ in _NORMS:
            _set_forward(p, mixer.norm, hf_ops.gated_rmsnorm_forward)
    for m in model.modules():
        if type(m).__name__ == "NemotronHTopkRouter":
            _set_forward(p, m, hf_ops.router_forward)
    if not instance:
        p.modeling = sorted({type(m).__module__ for m in mixers})
        for name in p.modeling:
            _dispatcher_acquire(name)
    _use_experts(p)
    if cuda_graphs:
        p.graphs = DecodeGraphs(model, moe_graph_safe=p.experts_before is not None)
        p.graphs.install(lambda module, fn: _set_forward(p, module, fn))
    model.__dict__[_ATTR] = p
    return p


def unuse(model: torch.nn.Module) -> bool:
    """Undo ``use(model)``: every replaced forward, the experts implementation and (last user) the
    global dispatcher are restored. Returns False if the provider was not in use on ``model``."""
    p = model.__dict__.pop(_ATTR, None)
    if not isinstance(p, Provider):
        return False
    for module, previous in reversed(p.forwards):
        if previous is None:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = previous
    for name in p.modeling:
        _dispatcher_release(name)
    if p.experts_before is not None:
        model.set_experts_implementation(p.experts_before)
    return True


def _set_forward(p: Provider, module: torch.nn.Module, fn) -> None:
    p.forwards.append((module, module.__dict__.get("forward")))
    module.__dict__["forward"] = MethodType(fn, module)  # a bound method, as kernels' kernelize sets it


def _use_experts(p: Provider) -> None:
    experts = [m for m in p.model.modules() if type(m).__name__ == "NemotronHExperts"]
    if not experts or not hasattr(p.model, "set_experts_implementation"):
        return
    # fused_moe runs relu² experts without gate or bias (Nemotron-H's); any other kind keeps transformers'
    if any(getattr(e, "has_gate", True) or getattr(e, "has_bias", True)
           or type(e.act_fn).__name__ != "ReLUSquaredActivation" for e in experts):
        return
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_NAME, hf_ops.experts_forward)  # a name in transformers' registry
    p.experts_before = p.model.get_experts_implementation()
    p.model.set_experts_implementation(EXPERTS_NAME)


# --- dispatchers (no per-mixer wrappers: transformers without a `kernels` package it accepts) ---

_IN_USED_MIXER = contextvars.ContextVar("fastmamba_in_used_mixer", default=False)


def _marked_forward(self, *args, **kwargs):
    """A used mixer's instance ``forward``: its class's, with the dispatchers switched to fastmamba."""
    token = _IN_USED_MIXER.set(True)
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _IN_USED_MIXER.reset(token)


class _Dispatch:
    """Stands in for one hook in a modeling module: fastmamba's implementation inside a used mixer's
    forward, transformers' original everywhere else."""

    def __init__(self, original, impl, takes_original: bool):
        self.original, self.impl, self.takes_original = original, impl, takes_original
        self.__wrapped__ = original

    def __call__(self, *args, **kwargs):
        if not _IN_USED_MIXER.get():
            return self.original(*args, **kwargs)
        if self.takes_original:
            return self.impl(self.original, *args, **kwargs)
        return self.impl(*args, **kwargs)


_DISPATCH_USERS: dict[str, int] = {}


def _dispatcher_acquire(name: str) -> None:
    mod = importlib.import_module(name)
    if _DISPATCH_USERS.get(name, 0) == 0:
        for attr, (impl, takes_original) in _MODULE_HOOKS.items():
            original = getattr(mod, attr, None)
            if callable(original) and not isinstance(original, _Dispatch):
                setattr(mod, attr, _Dispatch(original, impl, takes_original))
    _DISPATCH_USERS[name] = _DISPATCH_USERS.get(name, 0) + 1


def _dispatcher_release(name: str) -> None:
    _DISPATCH_USERS[name] -= 1
    if _DISPATCH_USERS[name] == 0:
        mod = importlib.import_module(name)
        for attr in _MODULE_HOOKS:
            d = getattr(mod, attr, None)
            if isinstance(d, _Dispatch):
                setattr(mod, attr, d.original)
