"""Progress of long CLI operations: a bar on a terminal, plain phase lines when piped."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``with Progress("copy", total) as bar: bar.advance(nbytes=...)`` on stderr.

    On a terminal it draws a bar with counts and bytes; piped, it stays quiet except for
    :meth:`phase` lines, so logs show what a long command is doing without carriage returns.
    """

    def __init__(
        self,
        label: str,
        total: int | None = None,
        stream: TextIO | None = None,
        *,
        unit: str = "",
    ) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.done = 0
        self.nbytes = 0
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.current = ""
        self._last = 0.0

    def advance(self, n: int = 1, *, nbytes: int = 0) -> None:
        self.done += n
        self.nbytes += nbytes
        now = time.monotonic()
        if self.enabled and now - self._last > 0.1:
            self._last = now
            self._draw()

    def phase(self, text: str) -> None:
        """Name what runs now: on the bar's line on a terminal, as its own line when piped."""
        self.current = text
        if self.enabled:
            self._draw()
        else:
            step = f" [{self.done + 1}/{self.total}]" if self.total else ""
            self.stream.write(f"mlxcache {self.label}{step}: {text}\n")
            self.stream.flush()

    def _draw(self, end: str = "") -> None:
        count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
        if self.unit:
            count += f" {self.unit}"
        if self.nbytes:
            count += f", {self.nbytes / 2**20:.1f} MiB"
        if self.total:
            frac = min(1.0, self.done / self.total)
            text = f"\r{self.label} [{'#' * int(frac * 30):<30}] {count}"
        else:
            text = f"\r{self.label} {count}"
        if self.current and not end:
            text += f" {self.current}"
        self.stream.write(text + "\x1b[K" + end)
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._draw(end="\n")
