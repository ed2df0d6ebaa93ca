"""Fleet-wide counters: kept in the store, so every process and `mlxcache stats` see the sums."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import blob_record, run_py

import mlxcache

WORKER = """
    import sys, mlxcache
    from helpers import blob_record
    b = mlxcache.open_backend(sys.argv[1])
    name, hits, misses = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    b.put(name, blob_record(100))
    for _ in range(hits):
        assert b.get(name) is not None
    for i in range(misses):
        assert b.get(f"{name}-missing-{i}") is None
    # no close(): the counts must reach the store at interpreter exit too
"""


@pytest.fixture(params=["file", "redis"])
def shared_uri(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path / 'fleet'}"
    return request.getfixturevalue("redis_url")


def test_a_third_process_sees_the_sum_of_two_others(shared_uri):
    run_py(WORKER, shared_uri, "a", "3", "2")
    run_py(WORKER, shared_uri, "b", "4", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "mlxcache", "stats", shared_uri, "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    fleet = stats["fleet"]
    assert (fleet["hits"], fleet["misses"]) == (7, 3)
    assert fleet["bytes_written"] == 200 and fleet["bytes_read"] == 700
    assert (stats["hits"], stats["misses"]) == (0, 0)  # this process's own counters


def test_fleet_counters_never_decrease_across_clear(shared_uri):
    b = mlxcache.open_backend(shared_uri)
    b.put("k", blob_record(10))
    b.get("k")
    before = b.stats()["fleet"]
    b.clear()
    b.get("k")
    after = b.stats()["fleet"]
    assert after["hits"] == before["hits"] == 1 and after["misses"] == before["misses"] + 1
    assert all(after[k] >= v for k, v in before.items())


def test_memory_has_no_fleet():
    assert "fleet" not in mlxcache.open_backend("memory://").stats()
