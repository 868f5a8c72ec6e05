"""A progress line for long work, shown only on a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``label: done/total (pct) rate`` redrawn on one stderr line, at most ~10 times a second.

    Silent when the stream is not a terminal, so logs and pipes stay clean.
    """

    def __init__(self, label: str, total: int, unit: str = "", stream: TextIO | None = None) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self._start = time.monotonic()
        self._last_draw = 0.0

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more units done."""
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last_draw >= 0.1 or self.done >= self.total):
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        rate = self.done / max(now - self._start, 1e-9)
        self.stream.write(f"\r{self.label}: {self.done}/{self.total}{pct} {rate:.0f} {self.unit}/s\x1b[K")
        self.stream.flush()

    def close(self) -> None:
        """End the progress line."""
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
