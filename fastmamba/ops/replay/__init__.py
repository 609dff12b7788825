"""Speculative verification with replay-based state rollback (T tokens per request per step)."""
from fastmamba.ops.replay.api import replay_selective_state_update
from fastmamba.ops.replay.cache import (
    ReplayCache,
    allocate_replay_cache,
    commit_accepted,
    default_history,
    flush_replay_cache,
    reset_history,
)

__all__ = ["ReplayCache", "allocate_replay_cache", "commit_accepted", "default_history", "flush_replay_cache",
           "replay_selective_state_update", "reset_history"]
