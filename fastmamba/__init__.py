"""fastmamba: fast Triton kernels and a runtime for running Mamba-2 models on NVIDIA GPUs.

    from fastmamba import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")
    print(llm.generate("The capital of France is", SamplingParams(max_tokens=16))[0].text)

``import fastmamba`` stays light (no torch): ``LLM``, ``SamplingParams``, ``Engine`` and
``load_model`` are imported on first use.
"""
import warnings

__version__ = "0.1.0"

# torch warns "Failed to initialize NumPy" when it is imported without numpy. The core does not
# need numpy (it is in the `hf` extra, for speed), so the warning would only add noise to every command.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

_LAZY = {
    "LLM": "fastmamba.llm",
    "Completion": "fastmamba.llm",
    "SamplingParams": "fastmamba.generation.sampling",
    "Engine": "fastmamba.generation.engine",
}
__all__ = ["LLM", "Completion", "SamplingParams", "Engine", "load_model", "__version__"]


def load_model(path_or_preset, dtype=None, device=None, *, quantization=None):
    """See :func:`fastmamba.models.load_model` (imported lazily: ``import fastmamba`` stays light)."""
    from fastmamba.models import load_model as _load

    return _load(path_or_preset, dtype=dtype, device=device, quantization=quantization)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fastmamba' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
