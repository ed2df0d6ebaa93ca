"""A minimal progress bar for long CLI operations: drawn on a terminal, silent when piped."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``with Progress("copy", total) as bar: bar.advance()``; draws on stderr only if a tty."""

    def __init__(self, label: str, total: int | None = None, stream: TextIO | None = None):
        self.label = label
        self.total = total
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self._last = 0.0

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and now - self._last > 0.1:
            self._last = now
            self._draw()

    def _draw(self, end: str = "") -> None:
        if self.total:
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(frac * 30)
            text = f"\r{self.label} [{bar:<30}] {self.done}/{self.total}"
        else:
            text = f"\r{self.label} {self.done}"
        self.stream.write(text + end)
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._draw(end="\n")
