"""A dependency-free progress bar for long work (reading checkpoints, copying weights).

    with Progress(len(names), "loading weights") as bar:
        for name in names:
            ...
            bar.update(nbytes=t.nbytes)

On a terminal one line is redrawn in place with ``\\r`` (at most every 0.1 s):
``loading weights [########............] 12/48 tensors 1.2 GB/s``.
Anywhere else (CI logs, files, pipes) whole lines are printed at the start, when each further 10 %
is reached and at the end, so a log gets at most 11 lines per bar however many updates there are.
"""
from __future__ import annotations

import os
import sys
import time
from types import TracebackType
from typing import TextIO

ENV_VAR = "FASTMAMBA_PROGRESS"  # "0": never draw, "1": always draw (even tiny totals), unset: auto
MIN_AUTO_TOTAL = 8  # auto mode stays quiet for fewer steps than this
_BAR_WIDTH = 20
_TTY_INTERVAL_S = 0.1


def _format_rate(per_s: float, unit: str) -> str:
    """``1.2 GB/s`` for bytes, ``35.0 tensors/s`` otherwise."""
    if unit == "B":
        for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if per_s >= scale:
                return f"{per_s / scale:.1f} {prefix}B/s"
        return f"{per_s:.0f} B/s"
    return f"{per_s:.1f} {unit}/s"


class Progress:
    """Progress of ``total`` steps of work, drawn on ``stream``.

    total    steps expected (>= 0); counted by update(n)
    desc     what is being done, printed first on every line
    unit     what a step is ("tensors", "shards"), printed after the count
    stream   where to draw; None means sys.stderr as it is when the bar is made (so pytest's
             capture and redirections see it). Drawn in place when stream.isatty(), else as lines.
    enabled  True / False force the bar on / off; None (auto) is off when FASTMAMBA_PROGRESS=0
             or total < MIN_AUTO_TOTAL (unless FASTMAMBA_PROGRESS=1)

    update(n=1, *, nbytes=0) counts n steps; when any update passes nbytes the rate is shown in
    bytes per second (GB/s), otherwise in steps per second. A disabled bar costs one branch
    per update. Use it as a context manager, or call close() when the work is done.
    """

    def __init__(
        self,
        total: int,
        desc: str,
        *,
        unit: str = "tensors",
        stream: TextIO | None = None,
        enabled: bool | None = None,
    ) -> None:
        if total < 0:
            raise ValueError(f"Progress: total must be >= 0, got {total}")
        self.total = int(total)
        self.desc = desc
        self.unit = unit
        self.stream = sys.stderr if stream is None else stream
        self.enabled = self._auto_enabled(self.total) if enabled is None else bool(enabled)
        self.count = 0
        self.nbytes = 0
        self.closed = False
        self._tty = self._isatty(self.stream)
        self._start = time.monotonic()
        self._last_draw = -float("inf")  # monotonic time of the last in-place redraw (tty)
        self._last_decile = -1  # last 10 % step printed as a line (non-tty)
        if self.enabled:
            self._draw(force=True)

    @staticmethod
    def _auto_enabled(total: int) -> bool:
        env = os.environ.get(ENV_VAR, "").strip()
        if env == "0":
            return False
        if env == "1":
            return True
        return total >= MIN_AUTO_TOTAL

    @staticmethod
    def _isatty(stream: TextIO) -> bool:
        try:
            return bool(stream.isatty())
        except (AttributeError, ValueError):  # no isatty, or a closed stream
            return False

    def update(self, n: int = 1, *, nbytes: int = 0) -> None:
        """Count ``n`` more steps that moved ``nbytes`` bytes, and redraw if it is time to."""
        self.count += n
        self.nbytes += nbytes
        if self.enabled and not self.closed:
            self._draw(force=False)

    def close(self) -> None:
        """Draw the final state and end the line. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if not self.enabled:
            return
        if self._tty:
            self._write("\r" + self.line() + "\n")
        elif self._decile() != self._last_decile or self.count < self.total:
            # the 100 % line when not yet printed; for work stopped early, where it stopped
            self._write(self.line() + "\n")

    def __enter__(self) -> "Progress":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def line(self) -> str:
        """The current state as one line, without ``\\r`` or newline."""
        frac = 1.0 if self.total == 0 else min(self.count / self.total, 1.0)
        filled = int(round(frac * _BAR_WIDTH))
        bar = "#" * filled + "." * (_BAR_WIDTH - filled)
        elapsed = time.monotonic() - self._start
        text = f"{self.desc} [{bar}] {self.count}/{self.total} {self.unit}"
        if elapsed > 0 and self.count:
            if self.nbytes:
                text += " " + _format_rate(self.nbytes / elapsed, "B")
            else:
                text += " " + _format_rate(self.count / elapsed, self.unit)
        if self.closed:
            text += f" in {elapsed:.1f} s"
        return text

    def _decile(self) -> int:
        """How many tenths of the work are done, 0..10."""
        if self.total == 0:
            return 10
        return min(10 * self.count // self.total, 10)

    def _draw(self, *, force: bool) -> None:
        if self._tty:
            now = time.monotonic()
            if force or now - self._last_draw >= _TTY_INTERVAL_S:
                self._last_draw = now
                self._write("\r" + self.line())
            return
        decile = self._decile()
        # 100 % waits for close() so the done line carries the total time
        if force or (decile > self._last_decile and decile < 10):
            self._last_decile = decile
            self._write(self.line() + "\n")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
