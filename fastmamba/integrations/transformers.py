"""fastmamba as a kernel provider for transformers' Mamba-2 and Nemotron-H models.

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")
    fastmamba.integrations.transformers.use(model)      # or: with use(model): ...
    model.generate(...)                                 # conv, scan, state update, gated norm, MoE on fastmamba
    fastmamba.integrations.transformers.unuse(model)    # transformers' own path again

What ``use`` replaces, per model (other models in the process are untouched):
  * each Mamba-2 mixer's private hook wrappers (transformers' ``use_kernelized_func`` gives every
    mixer its own copy of ``causal_conv1d_forward``, ``mamba2_scan_forward``, ``causal_conv1d_fn``,
    ``causal_conv1d_update``, ``selective_state_update``, ``mamba_chunk_scan_combined``): their
    ``forward`` becomes fastmamba's (fastmamba.integrations.hf_ops);
  * each mixer's gated RMSNorm and each MoE router: their instance ``forward``;
  * the experts: ``ExpertsInterface.register("fastmamba", ...)`` and the model's
    ``set_experts_implementation("fastmamba")`` (restored on ``unuse``).
Without the ``kernels`` package transformers gives mixers no private wrappers; then the two whole-op
hooks are replaced in the modeling module by a dispatcher that sends only this model's mixers to
fastmamba (installed on the first ``use``, removed with the last ``unuse``). See README.md here.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import MethodType

import torch

from fastmamba.integrations import hf_ops

SUPPORTED_TRANSFORMERS = ">=5.25,<6"
EXPERTS_NAME = "fastmamba"
_MODELING = ("transformers.models.mamba2.modeling_mamba2", "transformers.models.nemotron_h.modeling_nemotron_h")
_MIXERS = ("Mamba2Mixer", "NemotronHMamba2Mixer")
_NORMS = ("Mamba2RMSNormGated", "NemotronHRMSNormGated")
_WHOLE_OPS = ("causal_conv1d_forward", "mamba2_scan_forward")
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
            f"fastmamba.integrations.transformers supports transformers {SUPPORTED_TRANSFORMERS} (5.25 or newer, "
            f"before 6.0); found {version}. Older releases lack the per-op hooks it replaces "
            "(mamba2_scan_forward, causal_conv1d_forward); install e.g. `pip install 'transformers>=5.25,<6'`.")
    return version


@dataclass
class Provider:
    """What ``use`` changed on one model, so ``unuse`` can put it back. A context manager."""

    model: torch.nn.Module
    mode: str  # "instance" (per-mixer hook wrappers) or "global" (the whole-op dispatcher)
    forwards: list[tuple[torch.nn.Module, object]] = field(default_factory=list)  # (module, its previous own forward)
    flagged: list[torch.nn.Module] = field(default_factory=list)  # modules the global dispatcher serves
    experts_before: dict | None = None  # the model's experts implementation before ``use``
    modeling: list[str] = field(default_factory=list)  # modeling modules of the global dispatcher

    def __enter__(self) -> "Provider":
        return self

    def __exit__(self, *exc) -> None:
        unuse(self.model)


def is_used(model: torch.nn.Module) -> bool:
    """Whether ``use(model)`` is in effect."""
    return isinstance(model.__dict__.get(_ATTR), Provider)


def use(model: torch.nn.Module) -> Provider:
    """Run ``model``'s Mamba-2 mixers (conv, scan, state update, gated norm) and Nemotron MoE layers
    (router, experts) on fastmamba's ops; returns the Provider (``with use(model): ...`` undoes it
    on exit). Calling it again on the same model returns the same Provider.

    model: transformers' Mamba2ForCausalLM / Mamba2Model / NemotronHForCausalLM / NemotronHModel
    (or any module holding their mixers). Raises RuntimeError for an unsupported transformers
    version, ValueError for a model without Mamba-2 mixers; nothing is changed then.
    """
    check_transformers_version()
    if is_used(model):
        return model.__dict__[_ATTR]
    mixers = [m for m in model.modules() if type(m).__name__ in _MIXERS and type(m).__module__ in _MODELING]
    if not mixers:
        raise ValueError(f"fastmamba.integrations.transformers.use: {type(model).__name__} has no Mamba-2 mixer "
                         "(expected transformers' Mamba2ForCausalLM or NemotronHForCausalLM)")
    instance = all(isinstance(getattr(m, "_kernel_funcs", None), dict) for m in mixers)
    if instance:
        missing = sorted({n for m in mixers for n in hf_ops.HOOKS if n not in m._kernel_funcs})
        if missing:
            raise RuntimeError(f"fastmamba.integrations.transformers.use: the mixers of this transformers release "
                               f"have no hooks named {missing}; supported: transformers {SUPPORTED_TRANSFORMERS}")
    else:
        for name in _MODELING:
            mod = importlib.import_module(name)
            missing = [n for n in _WHOLE_OPS if not callable(getattr(mod, n, None))]
            if missing:
                raise RuntimeError(f"fastmamba.integrations.transformers.use: {name} has no {missing}; supported: "
                                   f"transformers {SUPPORTED_TRANSFORMERS}")

    p = Provider(model=model, mode="instance" if instance else "global")
    for mixer in mixers:
        if instance:
            for name, hook in hf_ops.HOOKS.items():
                _set_forward(p, mixer._kernel_funcs[name], hook)
        else:
            p.flagged += [mixer, mixer.conv1d]
        if type(mixer.norm).__name__ in _NORMS:
            _set_forward(p, mixer.norm, hf_ops.gated_rmsnorm_forward)
    for m in model.modules():
        if type(m).__name__ == "NemotronHTopkRouter":
            _set_forward(p, m, hf_ops.router_forward)
    if not instance:
        p.modeling = sorted({type(m).__module__ for m in mixers})
        for name in p.modeling:
            _dispatcher_acquire(name)
        for m in p.flagged:
            m.__dict__["_fastmamba_on"] = True
    _use_experts(p)
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
    for m in p.flagged:
        m.__dict__.pop("_fastmamba_on", None)
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


# --- the global dispatcher (transformers without the `kernels` package: no per-mixer wrappers) ---

class _Dispatch:
    """Stands in for a modeling module's whole-op hook: a call whose first argument (the mixer for
    the scan, its conv1d for the conv) is flagged by ``use`` runs fastmamba's, any other
    transformers' original."""

    def __init__(self, original, impl):
        self.original, self.impl = original, impl
        self.__wrapped__ = original

    def __call__(self, first, *args, **kwargs):
        if first.__dict__.get("_fastmamba_on", False):
            return self.impl(self.original, first, *args, **kwargs)
        return self.original(first, *args, **kwargs)


_DISPATCH_USERS: dict[str, int] = {}
_IMPLS = {"causal_conv1d_forward": hf_ops.conv_forward, "mamba2_scan_forward": hf_ops.scan_forward}


def _dispatcher_acquire(name: str) -> None:
    mod = importlib.import_module(name)
    if _DISPATCH_USERS.get(name, 0) == 0:
        for hook in _WHOLE_OPS:
            setattr(mod, hook, _Dispatch(getattr(mod, hook), _IMPLS[hook]))
    _DISPATCH_USERS[name] = _DISPATCH_USERS.get(name, 0) + 1


def _dispatcher_release(name: str) -> None:
    _DISPATCH_USERS[name] -= 1
    if _DISPATCH_USERS[name] == 0:
        mod = importlib.import_module(name)
        for hook in _WHOLE_OPS:
            d = getattr(mod, hook)
            if isinstance(d, _Dispatch):
                setattr(mod, hook, d.original)
