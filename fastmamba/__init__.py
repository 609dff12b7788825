"""fastmamba: fast Triton kernels and a runtime for running Mamba-2 models on NVIDIA GPUs."""
__version__ = "0.1.0"
