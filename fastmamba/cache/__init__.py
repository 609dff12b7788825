from fastmamba.cache.state_cache import StateCache

__all__ = ["StateCache"]
