"""An engine server's failed cache lookups and stores, for ``/metrics``.

Each failure is a miss (the request runs uncached) or an unstored prompt, and a log line, never
a failed request; ``mlxcache.metrics`` exports the counts as
``mlxcache_serve_{lookup,store}_errors_total{engine=...}``. Counts only ever grow.
"""

from __future__ import annotations

from mlxcache.backends.counters import Counters

OPS = ("lookup", "store")


class ServeErrors:
    """Failed lookups and stores of one engine's server in this process (thread-safe)."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self._counts = Counters(OPS)

    def add(self, op: str) -> None:
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        self._counts.add(op)

    def serve_errors(self) -> dict[str, int]:
        """op (``lookup``, ``store``) -> failures so far."""
        return self._counts.snapshot()
