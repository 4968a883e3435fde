"""A progress line on stderr for long jobs: done/total, tokens/s and time left, redrawn in place on a
terminal and written every few seconds otherwise (a log file of a Ray job)."""

from __future__ import annotations

import time
from typing import TextIO


class ProgressBar:
    def __init__(self, total: int, stream: TextIO, enabled: bool = True, every_s: float = 5.0):
        self.total, self.stream, self.enabled = total, stream, enabled and total > 0
        self.tty = enabled and getattr(stream, "isatty", lambda: False)()
        self.start = time.time()
        self.every_s = every_s if not self.tty else 0.1
        self._last = 0.0
        self._line = ""

    def begin(self) -> None:
        """The work starts now (the stages are up): rates and time left count from here, not
        from the cluster's start-up."""
        self.start = time.time()

    def update(self, done: int, tokens: int) -> None:
        if not self.enabled:
            return
        now = time.time()
        if now - self._last < self.every_s and done < self.total:
            return
        self._last = now
        elapsed = max(now - self.start, 1e-9)
        left = (self.total - done) * elapsed / done if done else float("nan")
        width = 30
        fill = int(width * done / self.total)
        self._line = (f"[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} sequences, "
                      f"{tokens / elapsed:.1f} tokens/s, {left:.0f} s left")
        self.stream.write(("\r" + self._line) if self.tty else self._line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self._line:
            self.stream.write("\n")
            self.stream.flush()
