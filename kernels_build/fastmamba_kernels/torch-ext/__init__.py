"""fastmamba's Triton ops as a `kernels` noarch build (pure Python: nothing compiled).

Functions (the mamba_ssm / causal_conv1d drop-ins): causal_conv1d_fn, causal_conv1d_update,
selective_state_update, mamba_chunk_scan_combined, rmsnorm_fn; MoE: fused_moe, moe_route.
``layers``: one stateless layer per transformers Mamba-2 hook, for ``kernelize`` / ``KernelConfig``
(names in ``layers.HOOK_LAYERS``). ``use`` / ``unuse``: fastmamba.integrations.transformers (also the
gated norm, the router and the experts, which transformers exposes to no kernel mapping).

The ops come from the installed ``fastmamba`` package when there is one, else from the copy in
``_vendor/`` next to this file (appended to sys.path, so an installed fastmamba always wins and
its ops are never registered twice).
"""
import importlib.util
import os
import sys

if importlib.util.find_spec("fastmamba") is None:
    sys.path.append(os.path.join(os.path.dirname(__file__), "_vendor"))

from fastmamba.integrations.transformers import unuse, use  # noqa: E402
from fastmamba.ops import (  # noqa: E402
    causal_conv1d_fn,
    causal_conv1d_update,
    mamba_chunk_scan_combined,
    rmsnorm_fn,
    selective_state_update,
)
from fastmamba.ops.moe import fused_moe, moe_route  # noqa: E402

from . import layers  # noqa: E402

__all__ = ["causal_conv1d_fn", "causal_conv1d_update", "fused_moe", "layers", "mamba_chunk_scan_combined",
           "moe_route", "rmsnorm_fn", "selective_state_update", "unuse", "use"]
