"""Speculative verification with replay-based state rollback (T tokens per request per step)."""
from fastmamba.ops.replay.api import ReplayCache, allocate_replay_cache, commit_accepted, replay_selective_state_update

__all__ = ["ReplayCache", "allocate_replay_cache", "commit_accepted", "replay_selective_state_update"]
