from fastmamba.ops.moe.api import fused_moe, fused_moe_gemv, moe_route
from fastmamba.ops.moe.ref import Routing

__all__ = ["Routing", "fused_moe", "fused_moe_gemv", "moe_route"]
