"""Public drop-in ops: same names and positional signatures as mamba_ssm / causal_conv1d.

Swap ``from mamba_ssm.ops.triton.selective_state_update import selective_state_update`` for
``from fastmamba.ops import selective_state_update`` (and likewise for the others).
"""
from fastmamba.ops._common.slot_errors import raise_pending_slot_errors
from fastmamba.ops.add_rmsnorm import PendingNorm, add_rmsnorm
from fastmamba.ops.conv1d import causal_conv1d_update
from fastmamba.ops.conv1d_fn import causal_conv1d_fn, causal_conv1d_varlen
from fastmamba.ops.gated_rmsnorm import RMSNormGated, rmsnorm_fn
from fastmamba.ops.moe import (
    Routing,
    append_shared_routing,
    decode_workspace,
    fuse_shared_expert,
    fused_moe,
    fused_moe_gemv,
    moe_gate,
    moe_route,
)
from fastmamba.ops.replay import (
    ReplayCache,
    allocate_replay_cache,
    commit_accepted,
    flush_replay_cache,
    replay_selective_state_update,
)
from fastmamba.ops.ssd_scan import mamba_chunk_scan_combined, ssd_scan_varlen
from fastmamba.ops.state_update import selective_state_update

__all__ = [
    "PendingNorm", "RMSNormGated", "add_rmsnorm", "causal_conv1d_fn", "causal_conv1d_update", "causal_conv1d_varlen",
    "mamba_chunk_scan_combined", "rmsnorm_fn", "selective_state_update", "ssd_scan_varlen",
    "ReplayCache", "allocate_replay_cache", "commit_accepted", "flush_replay_cache", "replay_selective_state_update",
    "raise_pending_slot_errors", "Routing", "append_shared_routing", "fuse_shared_expert", "fused_moe", "fused_moe_gemv",
    "moe_route", "moe_gate", "decode_workspace",
]
