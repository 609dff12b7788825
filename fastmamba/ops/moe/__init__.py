from fastmamba.ops.moe.configs import GEMV_MAX_TOKENS
from fastmamba.ops.moe.api import decode_workspace, fused_moe, fused_moe_gemv, moe_gate, moe_route
from fastmamba.ops.moe.ref import Routing
from fastmamba.ops.moe.shared import append_shared_routing, fuse_shared_expert

__all__ = ["GEMV_MAX_TOKENS", "Routing", "append_shared_routing", "decode_workspace", "fuse_shared_expert", "fused_moe", "fused_moe_gemv",
           "moe_gate", "moe_route"]
