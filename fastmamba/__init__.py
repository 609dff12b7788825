"""fastmamba: fast Triton kernels and a runtime for running Mamba-2 models on NVIDIA GPUs."""
__version__ = "0.1.0"


def load_model(path_or_preset, dtype=None, device=None):
    """See :func:`fastmamba.models.load_model` (imported lazily: ``import fastmamba`` stays light)."""
    from fastmamba.models import load_model as _load

    return _load(path_or_preset, dtype=dtype, device=device)
