"""Prometheus metrics: parsed with prometheus_client's own parser, counters never go down."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from helpers import blob_record
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import mlxcache
from mlxcache import PrefixCache, metrics
from mlxcache.backends.memory import MemoryBackend


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


def test_prefix_lookup_and_store_durations_are_histograms_per_model(tmp_path):
    pc = PrefixCache(f"file://{tmp_path}", model="timed", block_size=8, hot_bytes=0)
    tokens = np.arange(20).tolist()
    pc.store(tokens, kv_cache(20))
    pc.lookup(tokens)
    pc.lookup([7] * 20)
    with pytest.raises(ValueError):
        pc.store(tokens, [])  # a refused call is timed too
    found = samples(metrics.render(pc).decode())
    assert value(found, "mlxcache_prefix_lookup_seconds_count", model="timed") == 2
    assert value(found, "mlxcache_prefix_store_seconds_count", model="timed") == 2
    assert value(found, "mlxcache_prefix_lookup_seconds_bucket", model="timed", le="+Inf") == 2
    assert value(found, "mlxcache_prefix_store_seconds_sum", model="timed") > 0
    pc.close()


def test_prefix_caches_of_one_model_and_several_salts_are_one_series(tmp_path):
    """A server holds one PrefixCache per request salt: its metrics add up per model."""
    caches = [PrefixCache(f"file://{tmp_path}", model="m", block_size=8, salt=s) for s in "ab"]
    tokens = np.arange(20).tolist()
    for pc in caches:
        pc.store(tokens, kv_cache(20))
        pc.lookup(tokens)
    text = metrics.render(*caches).decode()
    found = samples(text)
    assert value(found, "mlxcache_prefix_lookup_seconds_count", model="m") == 2
    hits = [v for (n, ls), v in found.items() if n == "mlxcache_prefix_hits_total"]
    assert hits == [2]  # one series, both caches' hits
    for pc in caches:
        pc.close()


class BrokenBackend(MemoryBackend):
    """A third-party backend with a bug: it raises where a backend must answer."""

    def contains_many(self, keys):
        raise RuntimeError("broken backend")


def test_each_engines_failed_lookups_and_stores_are_exported():
    """What an engine server catches around its PrefixCache calls (a miss, an unstored prompt)
    is counted per engine, for mlx-lm's, mlx-vlm's and vllm-mlx's servers."""
    from mlxcache.integrations.mlx_lm.prompt_cache import SharedPromptCache
    from mlxcache.integrations.mlx_vlm.apc import ImageDigests, SharedAPCManager
    from mlxcache.integrations.vllm_mlx.shared_tier import ERRORS, SharedTier, TierConfig

    tokens = list(range(12))
    lm = SharedPromptCache(backend=BrokenBackend(), background=False, block_size=4)
    assert lm.fetch_nearest_cache("m", tokens) == (None, tokens)  # a miss, not an exception
    lm.insert_cache("m", tokens, kv_cache(12))
    vlm = SharedAPCManager(PrefixCache(BrokenBackend(), model="v", block_size=4), ImageDigests())
    assert vlm.lookup_prefix_disk_cache(tokens) == (None, 0)
    c = kv_cache(12)[0]
    assert vlm.store_kv_blocks(tokens, [c.keys], [c.values]) == []
    vlm.store_kv_blocks(tokens, [c.keys], [c.values])
    before = ERRORS.serve_errors()
    tier = SharedTier(TierConfig(BrokenBackend(), block_size=4), "t")
    assert tier.lookup(tokens, 0) is None
    tier.store(tokens, kv_cache(12))
    found = samples(metrics.render(lm, *lm.prefix_caches(), vlm.errors, ERRORS).decode())
    for engine, lookups, stores in (
        ("mlx-lm", 1, 1),
        ("mlx-vlm", 1, 2),
        ("vllm-mlx", before["lookup"] + 1, before["store"] + 1),
    ):
        assert value(found, "mlxcache_serve_lookup_errors_total", engine=engine) == lookups
        assert value(found, "mlxcache_serve_store_errors_total", engine=engine) == stores
    lm.close()


def test_an_engine_object_without_failures_exports_zeros():
    from mlxcache.integrations.serve_errors import ServeErrors

    found = samples(metrics.render(ServeErrors("quiet")).decode())
    assert value(found, "mlxcache_serve_lookup_errors_total", engine="quiet") == 0
    assert value(found, "mlxcache_serve_store_errors_total", engine="quiet") == 0
    with pytest.raises(ValueError, match="op must be one of"):
        ServeErrors("quiet").add("fetch")
