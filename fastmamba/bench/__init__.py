"""Benchmarks: ``python -m fastmamba.bench <target>`` (or ``fastmamba bench <target>``).

Targets live in ``fastmamba.bench.targets``; ``kernels`` times the decode kernels (selective state
update, conv update, gated RMSNorm) against peers and the PyTorch reference, ``prefill`` the
prefill kernels (causal conv, chunked SSD scan). Nothing here touches CUDA at import time, so the
package imports on a CPU-only machine.
"""
