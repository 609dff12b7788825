"""Launch plans of eager calls, remembered per call signature: one kind of cache shared by the ops.

An eager call of a decode-size op costs more host time than kernel time (issue 19 item 0). Most of
that time goes to work that depends only on the call's *signature*: every tensor's shape, strides,
dtype and device, and the flags. The ops that gain from it remember what that work produced (a
launch plan, or the fact that the signature passed every check) in a ``PlanCache`` keyed by the
signature (built with ``sig``), so a repeat call goes from the key straight to the launch.

``PlanCache`` is a ``dict`` (lookups are the dict's own ``get``: no Python call on the hot path) with
a bound on its size and what happens at the bound: ``"stop"`` (keep the plans made so far and plan
no more: ``has_room``) or ``"clear"`` (start over: ``remember``). Every cache registers itself, so
``clear_plans()`` forgets them all (tests that swap a kernel-choice hook, or a config hook).
"""
from __future__ import annotations

import torch

_ALL: list[PlanCache] = []


class PlanCache(dict):
    """Signature -> launch plan (or checked-call record) of one op."""

    __slots__ = ("name", "max_size", "when_full")

    def __init__(self, name: str, max_size: int, *, when_full: str = "stop"):
        super().__init__()
        if when_full not in ("stop", "clear"):
            raise ValueError(f"PlanCache {name!r}: when_full expected 'stop' or 'clear', got {when_full!r}")
        self.name, self.max_size, self.when_full = name, max_size, when_full
        _ALL.append(self)

    def has_room(self) -> bool:
        """Whether another plan may be added (always, for a cache that clears when full)."""
        return self.when_full == "clear" or len(self) < self.max_size

    def remember(self, key, plan):
        """Store ``plan`` under ``key`` (clearing the cache first if it is full and clears) and
        return it; a full cache that stops keeps what it has and returns the plan unstored."""
        if len(self) >= self.max_size:
            if self.when_full == "stop":
                return plan
            self.clear()
        self[key] = plan
        return plan

    def __repr__(self) -> str:
        return f"PlanCache({self.name!r}, {len(self)}/{self.max_size} plans, when_full={self.when_full!r})"


def sig(t: torch.Tensor | None) -> tuple | None:
    """A tensor's part of a signature: shape, strides, dtype and device (None for None)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def clear_plans() -> None:
    """Forget every op's remembered plans (after changing a kernel-choice or config hook)."""
    for cache in _ALL:
        cache.clear()
