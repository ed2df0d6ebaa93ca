"""Prometheus metrics: parsed with prometheus_client's own parser, counters never go down."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import numpy as np
from helpers import blob_record
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import mlxcache
from mlxcache import PrefixCache, metrics


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(found: dict, name: str, **labels) -> float:
    matches = [v for (n, ls), v in found.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


def kv_cache(n: int):
    from mlx_vlm.models.cache import KVCache

    c = KVCache()
    x = mx.random.normal((1, 2, n, 8))
    c.update_and_fetch(x, x)
    return [c]


def test_backend_and_prefix_metrics_parse_and_never_decrease(tmp_path):
    backend = mlxcache.open_backend(f"file://{tmp_path}")
    pc = PrefixCache(backend, model="tiny", block_size=8, hot_bytes=0)  # backend metrics
    registry = CollectorRegistry()
    metrics.register(backend, pc, registry=registry)
    tokens = np.arange(20).tolist()
    pc.store(tokens, kv_cache(20))
    assert pc.lookup(tokens).num_tokens == 20
    assert pc.lookup([999] * 20) is None
    before = samples(generate_latest(registry).decode())
    where = str(tmp_path)
    assert value(before, "mlxcache_backend_hits_total", backend="file", where=where) > 0
    assert value(before, "mlxcache_backend_entries", backend="file") == len(backend)
    assert value(before, "mlxcache_backend_bytes_written_total", backend="file") > 0
    assert value(before, "mlxcache_backend_get_seconds_count", backend="file") >= 1
    assert value(before, "mlxcache_prefix_lookups_total", model="tiny") == 2
    assert value(before, "mlxcache_prefix_hit_tokens_total", model="tiny") == 20
    assert value(before, "mlxcache_prefix_stored_tokens_total", model="tiny") == 20
    backend.clear()
    pc.lookup(tokens)
    after = samples(generate_latest(registry).decode())
    for (name, labels), v in before.items():
        if name.endswith(("_total", "_count", "_sum", "_bucket")):
            assert after[(name, labels)] >= v, name  # clear() deletes entries, never counts
    assert value(after, "mlxcache_backend_entries", backend="file") == 0


def test_stats_prometheus_from_the_command(tmp_path):
    b = mlxcache.open_backend(f"file://{tmp_path}")
    b.put("a", blob_record(100))
    stored = b.stats()["bytes"]  # stats() also flushes this process's counts to the store
    proc = subprocess.run(
        [sys.executable, "-m", "mlxcache", "stats", f"file://{tmp_path}", "--prometheus"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    found = samples(proc.stdout)
    assert value(found, "mlxcache_backend_entries", backend="file") == 1
    assert value(found, "mlxcache_backend_bytes", backend="file") == stored
    assert value(found, "mlxcache_fleet_bytes_written_total", backend="file") == 100
