from fastmamba.cache.hybrid_cache import HybridCache
from fastmamba.cache.state_cache import StateCache

__all__ = ["HybridCache", "StateCache"]
