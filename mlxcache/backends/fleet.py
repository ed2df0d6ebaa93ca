"""Counters kept in the store itself, so every process and ``mlxcache stats`` see fleet totals.

Each process adds what it counted since its last flush (deltas, never totals), at most once
per ``interval`` seconds while it works, and at ``stats()``, ``close()`` and interpreter exit.
The store keeps sums that only grow: ``clear()`` deletes entries, never counts. A flush that
fails is kept for the next one; a store without fleet counters (``memory://``) has none.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable
from typing import Protocol

FLEET = ("hits", "misses", "evictions", "errors", "rejected", "bytes_read", "bytes_written")
INTERVAL = 1.0  # seconds between flushes while a process works


class FleetCounters:
    """What one process has flushed of its counters, and when to flush again."""

    def __init__(
        self,
        snapshot: Callable[[], dict[str, int]],
        add: Callable[[dict[str, int]], None],
        interval: float = INTERVAL,
    ) -> None:
        self._snapshot, self._add, self.interval = snapshot, add, interval
        self._sent = dict.fromkeys(FLEET, 0)
        self._lock = threading.Lock()
        self._last = time.monotonic()

    def maybe_flush(self) -> None:
        if time.monotonic() - self._last >= self.interval:
            self.flush()

    def flush(self) -> bool:
        """Add the unflushed deltas to the store; False (kept for later) if that failed."""
        if not self._lock.acquire(blocking=False):
            return False  # another thread is flushing right now
        try:
            self._last = time.monotonic()
            now = self._snapshot()
            deltas = {k: now.get(k, 0) - self._sent[k] for k in FLEET}
            deltas = {k: v for k, v in deltas.items() if v}
            if not deltas:
                return True
            try:
                self._add(deltas)
            except Exception:  # the store is away: the deltas wait for the next flush
                return False
            for k, v in deltas.items():
                self._sent[k] += v
            return True
        finally:
            self._lock.release()


class _Flushes(Protocol):
    def flush_counters(self) -> None: ...


def flush_at_exit(backend: _Flushes) -> None:
    """Flush ``backend``'s fleet counters when the interpreter exits (if it is still alive)."""
    ref = weakref.ref(backend)

    def flush() -> None:
        target = ref()
        if target is not None:
            target.flush_counters()

    atexit.register(flush)
