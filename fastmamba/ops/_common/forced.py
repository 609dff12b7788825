"""The holder behind each op's ``configs.forced_config(...)``: one launch config forced on every call."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Generic, TypeVar

C = TypeVar("C")


class Forced(Generic[C]):
    """The config an op's tuning hook forces: ``value``, None when nothing is forced.

    ``python -m fastmamba.bench tune`` and tests use it (through the op's ``forced_config``) to run
    one candidate config. The op's config picker returns ``value`` when it is set, and a launch
    cache that must not outlive an override keys on ``value`` (never on the holder, which is the
    same object forever).
    """

    def __init__(self) -> None:
        self.value: C | None = None

    @contextlib.contextmanager
    def use(self, value: C) -> Iterator[None]:
        """Force ``value`` inside the block; on exit the previous value (an outer block's, or None) returns."""
        previous, self.value = self.value, value
        try:
            yield
        finally:
            self.value = previous
