"""Counters a backend keeps for ``stats()`` and metrics: events, latencies, rate-limited logs."""

from __future__ import annotations

import bisect
import logging
import threading
import time

log = logging.getLogger("mlxcache")

# seconds; the upper bounds of the latency buckets (Prometheus' convention: cumulative, +Inf last)
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Counters:
    """Thread-safe counters that only grow, for ``stats()`` and metrics (by default a backend's
    hits, misses, evictions, errors...; a PrefixCache or an engine server names its own)."""

    NAMES = ("hits", "misses", "evictions", "errors", "rejected", "bytes_read", "bytes_written")

    def __init__(self, names: tuple[str, ...] = NAMES) -> None:
        self._lock = threading.Lock()
        self.values = dict.fromkeys(names, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.values[name] = self.values.get(name, 0) + n

    def add_all(self, **counts: int) -> None:
        """Add several counts at once (a snapshot never sees half of them)."""
        with self._lock:
            for name, n in counts.items():
                self.values[name] = self.values.get(name, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.values)


class RateLimitedLog:
    """Logs a repeated failure once per ``interval`` seconds, so a dead store does not flood."""

    def __init__(self, interval: float = 30.0) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}

    def warning(self, topic: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(topic, -1e9) >= self.interval:
            self._last[topic] = now
            log.warning(msg, *args)


class Latency:
    """A histogram of call durations per operation (``get``, ``put``), thread-safe.

    Counts only ever grow, so what a metrics scrape reads is monotonic.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, list[int]] = {}
        self._sums: dict[str, float] = {}

    def observe(self, op: str, seconds: float) -> None:
        i = bisect.bisect_left(BUCKETS, seconds)
        with self._lock:
            counts = self._counts.setdefault(op, [0] * (len(BUCKETS) + 1))
            counts[i] += 1
            self._sums[op] = self._sums.get(op, 0.0) + seconds

    def snapshot(self) -> dict[str, tuple[list[int], float]]:
        """op -> (count per bucket, the last one above every bound; total seconds)."""
        with self._lock:
            return {op: (list(c), self._sums[op]) for op, c in self._counts.items()}

    def timer(self, op: str) -> _Timer:
        return _Timer(self, op)


class _Timer:
    def __init__(self, latency: Latency, op: str) -> None:
        self.latency, self.op = latency, op

    def __enter__(self) -> _Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.latency.observe(self.op, time.perf_counter() - self.start)
