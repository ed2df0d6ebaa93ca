"""An engine server's failed cache lookups and stores, for ``/metrics``.

Each failure is a miss (the request runs uncached) or an unstored prompt, and a log line, never
a failed request; ``mlxcache.metrics`` exports the counts as
``mlxcache_serve_{lookup,store}_errors_total{engine=...}``. Counts only ever grow.
"""

from __future__ import annotations

import threading

OPS = ("lookup", "store")


class ServeErrors:
    """Failed lookups and stores of one engine's server in this process (thread-safe)."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(OPS, 0)

    def add(self, op: str) -> None:
        if op not in self._counts:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        with self._lock:
            self._counts[op] += 1

    def serve_errors(self) -> dict[str, int]:
        """op (``lookup``, ``store``) -> failures so far."""
        with self._lock:
            return dict(self._counts)
