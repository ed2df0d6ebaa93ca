"""Prometheus metrics of backends and PrefixCaches, read at scrape time (the ``metrics`` extra).

``register(backend_or_prefix_cache, ...)`` adds a collector to a ``prometheus_client``
registry; every scrape reads the objects' ``stats()`` and latency histograms, so nothing is
counted twice and counters only grow (``clear()`` deletes entries, never counts). Names::

    mlxcache_backend_{hits,misses,evictions,errors,rejected,bytes_read,bytes_written}_total
    mlxcache_backend_{entries,bytes}                          gauges, from the store itself
    mlxcache_backend_max_bytes                                gauge, the budget (when set)
    mlxcache_backend_{get,put}_seconds                        histograms
    mlxcache_fleet_{hits,misses,...}_total                    every process's, summed in the
                                                              store (file://, redis://)
    mlxcache_prefix_{lookups,hits,misses,tokens_requested,hit_tokens,stored_tokens,
                     vision_hits,rejected}_total              per PrefixCache (label model)
    mlxcache_prefix_{lookup,store}_seconds                    histograms, per PrefixCache
    mlxcache_serve_{lookup,store}_errors_total                an engine server's failed cache
                                                              lookups (served uncached) and
                                                              stores (not shared), label engine

Labels: ``backend`` (the scheme), ``where`` (folder or URL, no password), ``model`` and
``engine``. An engine server's object (``serve_errors()`` and an ``engine`` name; see
``mlxcache serve``) counts what fails around its PrefixCache calls, so it is registered as well.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

try:
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "mlxcache.metrics needs prometheus_client: pip install 'mlxcache[metrics]'"
    ) from exc

from mlxcache.backends.counters import BUCKETS

CONTENT_TYPE = CONTENT_TYPE_LATEST

_BACKEND_COUNTERS = ("hits", "misses", "evictions", "errors", "rejected", "bytes_read",
                     "bytes_written")  # fmt: skip
_PREFIX_COUNTERS = {
    "lookups": "lookups",
    "hits": "hits",
    "misses": "misses",
    "tokens_requested": "tokens_requested",
    "hit_tokens": "tokens_reused",
    "stored_tokens": "tokens_written",
    "vision_hits": "vision_hits",
    "rejected": "rejected",
}
_HELP = {
    "hits": "records found",
    "misses": "records not found (failures included)",
    "evictions": "records evicted for the byte budget",
    "errors": "store failures read as misses or no-ops",
    "rejected": "records refused as unsigned, forged or malformed",
    "bytes_read": "tensor bytes returned by get",
    "bytes_written": "tensor bytes stored by put",
}


def _where(stats: dict[str, Any]) -> str:
    return str(stats.get("path") or stats.get("url") or "")


class CacheCollector(Collector):
    """Reads the registered backends and PrefixCaches at every scrape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._objects: list[Any] = []

    def add(self, obj: Any) -> None:
        """A backend (anything with ``stats()``), a PrefixCache (its backend comes along) or an
        engine server's object (``serve_errors()``)."""
        if not callable(getattr(obj, "stats", None)) and not _is_serving(obj):
            raise TypeError(f"cannot collect metrics of a {type(obj).__name__}: it has no stats()")
        with self._lock:
            if all(o is not obj for o in self._objects):
                self._objects.append(obj)

    def _backends(self) -> list[Any]:
        found: list[Any] = []
        for obj in self._objects:
            if _is_serving(obj):
                continue
            backend = obj.backend if _is_prefix_cache(obj) else obj
            if all(b is not backend for b in found):
                found.append(backend)
        return found

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            objects = list(self._objects)
        labels = ["backend", "where"]
        counters = {
            n: CounterMetricFamily(f"mlxcache_backend_{n}", _HELP[n], labels=labels)
            for n in _BACKEND_COUNTERS
        }
        entries = GaugeMetricFamily("mlxcache_backend_entries", "records stored", labels=labels)
        nbytes = GaugeMetricFamily("mlxcache_backend_bytes", "bytes stored", labels=labels)
        budget = GaugeMetricFamily(
            "mlxcache_backend_max_bytes", "byte budget (max_bytes); absent when unlimited",
            labels=labels,
        )  # fmt: skip
        fleet = {
            n: CounterMetricFamily(f"mlxcache_fleet_{n}", f"{_HELP[n]}, all processes",
                                   labels=labels)
            for n in _BACKEND_COUNTERS
        }  # fmt: skip
        hists = {
            op: HistogramMetricFamily(
                f"mlxcache_backend_{op}_seconds", f"duration of {op} calls", labels=labels
            )
            for op in ("get", "put")
        }
        for backend in self._backends():
            stats = backend.stats()
            values = [str(stats.get("backend", type(backend).__name__)), _where(stats)]
            for name, family in counters.items():
                family.add_metric(values, float(stats.get(name, 0)))
            entries.add_metric(values, float(stats.get("entries", 0)))
            nbytes.add_metric(values, float(stats.get("bytes", 0)))
            if stats.get("max_bytes") is not None:
                budget.add_metric(values, float(stats["max_bytes"]))
            for name, family in fleet.items():
                if isinstance(stats.get("fleet"), dict):
                    family.add_metric(values, float(stats["fleet"].get(name, 0)))
            _observe(hists, backend, values)
        yield from counters.values()
        yield from fleet.values()
        yield entries
        yield nbytes
        yield budget
        yield from hists.values()
        prefix = {
            n: CounterMetricFamily(f"mlxcache_prefix_{n}", f"PrefixCache {s}", labels=["model"])
            for n, s in _PREFIX_COUNTERS.items()
        }
        prefix_hists = {
            op: HistogramMetricFamily(
                f"mlxcache_prefix_{op}_seconds", f"duration of PrefixCache.{op} calls",
                labels=["model"],
            )
            for op in ("lookup", "store")
        }  # fmt: skip
        serve = {
            op: CounterMetricFamily(f"mlxcache_serve_{op}_errors", help, labels=["engine"])
            for op, help in (
                ("lookup", "cache lookups an engine server failed (the request ran uncached)"),
                ("store", "cache stores an engine server failed (kept in its process only)"),
            )
        }
        totals: dict[str, dict[str, float]] = {}  # per model: caches of several salts add up
        timings: dict[str, dict[str, tuple[list[int], float]]] = {}
        for obj in objects:
            if _is_serving(obj):
                errors = obj.serve_errors()
                for op, family in serve.items():
                    family.add_metric([str(obj.engine)], float(errors.get(op, 0)))
            elif _is_prefix_cache(obj):
                stats = obj.stats()
                row = totals.setdefault(obj.model, dict.fromkeys(_PREFIX_COUNTERS, 0.0))
                for name, source in _PREFIX_COUNTERS.items():
                    row[name] += float(stats.get(source, 0))
                latency = getattr(obj, "latency", None)
                for op, (counts, total) in (latency.snapshot() if latency else {}).items():
                    seen = timings.setdefault(obj.model, {}).get(op)
                    if seen is not None:
                        counts = [a + b for a, b in zip(seen[0], counts, strict=True)]
                        total += seen[1]
                    timings[obj.model][op] = (counts, total)
        for model, row in totals.items():
            for name, total in row.items():
                prefix[name].add_metric([model], total)
        for model, ops in timings.items():
            for op, (counts, total) in ops.items():
                if op in prefix_hists:
                    prefix_hists[op].add_metric([model], _cumulative(counts), total)
        yield from prefix.values()
        yield from prefix_hists.values()
        yield from serve.values()


def _observe(families: dict[str, HistogramMetricFamily], obj: Any, labels: list[str]) -> None:
    """Add ``obj.latency``'s histogram of each operation that has a family (get, lookup...)."""
    latency = getattr(obj, "latency", None)
    for op, (counts, total) in (latency.snapshot() if latency else {}).items():
        if op in families:
            families[op].add_metric(labels, _cumulative(counts), total)


def _is_serving(obj: Any) -> bool:
    return isinstance(getattr(obj, "engine", None), str) and callable(
        getattr(obj, "serve_errors", None)
    )


def _is_prefix_cache(obj: Any) -> bool:
    return hasattr(obj, "backend") and hasattr(obj, "model") and hasattr(obj, "lookup")


def _cumulative(counts: list[int]) -> list[tuple[str, float]]:
    out, total = [], 0
    for bound, n in zip([*map(str, BUCKETS), "+Inf"], counts, strict=True):
        total += n
        out.append((bound, float(total)))
    return out


def register(*objects: Any, registry: CollectorRegistry | None = None) -> CacheCollector:
    """Collect metrics of these backends / PrefixCaches in ``registry`` (default: the global)."""
    collector = CacheCollector()
    for obj in objects:
        collector.add(obj)
    (REGISTRY if registry is None else registry).register(collector)
    return collector


def render(*objects: Any) -> bytes:
    """The Prometheus text format of these objects' metrics alone (``mlxcache stats``)."""
    registry = CollectorRegistry()
    register(*objects, registry=registry)
    return generate_latest(registry)
