"""tiered://: L1 over L2, fill on read, write-through and write-behind (bounded, flushed)."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest
from helpers import assert_same, bits, blob_record, run_py, sample_record
from redis_server import free_port

import mlxcache
from mlxcache.backends.disk import DiskBackend
from mlxcache.backends.memory import MemoryBackend
from mlxcache.backends.tiered import TieredBackend, tiered_uri


class GatedDisk(DiskBackend):
    """A real disk backend whose puts wait for ``gate`` (to hold the write-behind queue)."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.gate = threading.Event()

    def put(self, key, record):
        self.gate.wait(30)
        super().put(key, record)


def test_write_through_reads_fill_the_upper_tier(tmp_path):
    l1, l2 = MemoryBackend(), DiskBackend(tmp_path / "l2")
    b = TieredBackend(l1, l2)
    rec = sample_record()
    b.put("k", rec)
    assert "k" in l1 and "k" in l2  # written through to both at once
    assert_same(rec, b.get("k"))
    l1.clear()
    assert_same(rec, b.get("k"))  # from L2 ...
    assert "k" in l1  # ... and copied up
    assert_same(rec, b.get("k"))
    s = b.stats()
    assert (s["l1_hits"], s["l2_hits"], s["hits"], s["misses"]) == (2, 1, 3, 0)
    assert s["entries"] == 1 and s["bytes"] == l2.stats()["bytes"] and s["write"] == "through"
    assert b.get("nope") is None and b.stats()["misses"] == 1
    assert b.persistent  # the disk tier cannot hold live objects, so neither can the whole


def test_l1_hits_reach_the_lower_tiers_lru(tmp_path):
    """A record that is hot in L1 (never read from L2) is not what L2 evicts first."""
    l2 = DiskBackend(tmp_path / "l2")
    unit = len(mlxcache.records.format.to_bytes(blob_record(1000)))
    b = TieredBackend(MemoryBackend(), f"file://{tmp_path}/l2", max_bytes=3 * unit + unit // 2)
    for k in ("hot", "k1", "k2"):
        b.put(k, blob_record(1000))
    for _ in range(3):
        assert b.get("hot") is not None  # L1 hits only
    b.put("k3", blob_record(1000))  # L2 is full: its least recently used goes
    assert sorted(l2.keys()) == ["hot", "k2", "k3"]
    assert sorted(b.keys()) == ["hot", "k2", "k3"] and b.stats()["evictions"] == 1
    assert b.stats()["l1_hits"] == 3 and b.stats()["l2_hits"] == 0


def test_write_behind_writes_l2_later_and_reads_the_queue_meanwhile(tmp_path):
    l1, l2 = MemoryBackend(max_entries=1), GatedDisk(tmp_path / "l2")
    b = TieredBackend(l1, l2, write="behind")
    a, c = blob_record(100, 1), blob_record(100, 2)
    b.put("a", a)
    b.put("c", c)  # evicts "a" from the one-entry L1
    assert "a" not in l1 and "a" not in l2
    assert_same(a, b.get("a"))  # served from the queue
    assert b.contains_many(["a", "c", "x"]) == [True, True, False]
    threading.Timer(0.1, l2.gate.set).start()
    assert len(b) == 2 and sorted(b.keys()) == ["a", "c"]  # these wait for the queue
    assert_same(a, l2.get("a"))
    assert b.stats()["queue_hits"] == 1
    w = b.stats()["writer"]
    assert (w["written"], w["dropped"], w["pending"]) == (2, 0, 0)
    b.close()


def test_full_queue_drops_and_counts_never_blocks(tmp_path):
    l2 = GatedDisk(tmp_path / "l2")
    b = TieredBackend(MemoryBackend(), l2, write="behind", queue=2, full="drop")
    for i in range(5):
        b.put(f"k{i}", blob_record(50, i))  # 1 running + 1 queued... the rest dropped
    s = b.writer.stats()
    assert s["dropped"] >= 2 and s["queued"] + s["dropped"] == 5
    assert all(b.get(f"k{i}") is not None for i in range(5))  # L1 still has every one
    l2.gate.set()
    assert b.flush(30)
    assert len(l2) == s["queued"]  # what was dropped never reached L2
    assert b.stats()["writer"]["dropped"] == s["dropped"]
    b.close()


def test_delete_and_clear_win_over_queued_writes(tmp_path):
    l2 = GatedDisk(tmp_path / "l2")
    b = TieredBackend(MemoryBackend(), l2, write="behind")
    b.put("a", blob_record(10, 1))
    b.put("b", blob_record(10, 2))
    b.put("c", blob_record(10, 3))
    threading.Timer(0.05, l2.gate.set).start()
    assert b.delete("b") is True  # waits for the write in progress, not the queue
    assert "b" not in b
    assert b.flush(30)
    assert "b" not in l2 and "a" in l2 and "c" in l2
    b.put("d", blob_record(10, 4))
    b.clear()
    assert b.flush(30)
    assert len(l2) == 0 and len(b) == 0
    b.close()


def test_write_behind_evaluates_and_detaches_on_the_callers_thread(tmp_path):
    b = TieredBackend(MemoryBackend(), DiskBackend(tmp_path / "l2"), write="behind")
    lazy = mx.arange(64, dtype=mx.float32) * 2  # unevaluated: another thread could not
    live = mx.zeros((8,))
    b.put("k", mlxcache.Record({"x": lazy, "live": live}))
    live[0] = 42.0  # the caller changes its array object afterwards
    assert b.flush(30)
    got = b.l2.get("k")
    assert got is not None and b.stats()["writer"]["failed"] == 0
    assert got.arrays["x"].tolist() == (mx.arange(64) * 2).tolist()
    assert got.arrays["live"][0].item() == 0.0
    b.close()


def test_close_and_interpreter_exit_flush_queued_writes(tmp_path):
    l2_path = tmp_path / "l2"
    uri = tiered_uri("memory://", f"file://{l2_path}", write="behind")
    run_py(
        f"""
        import mlxcache
        from helpers import blob_record
        b = mlxcache.open_backend({uri!r})
        for i in range(30):
            b.put(f"k{{i}}", blob_record(1000, i))
        # no flush, no close: the interpreter exits with writes queued
        """
    )
    l2 = DiskBackend(l2_path)
    assert len(l2) == 30
    assert bits(l2.get("k7").arrays["x"]) == bits(blob_record(1000, 7).arrays["x"])


def test_a_dead_lower_tier_is_counted_and_l1_still_serves(tmp_path):
    dead = f"redis://127.0.0.1:{free_port()}/0?timeout=0.2"
    b = mlxcache.open_backend(tiered_uri("memory://", dead))
    rec = blob_record(10)
    b.put("k", rec)
    assert_same(rec, b.get("k"))
    assert b.get("other") is None
    s = b.stats()
    assert s["errors"] >= 2 and s["l2"]["errors"] >= 2 and not s["available"]


def test_uris_are_typed_and_nested_uris_keep_their_options(tmp_path):
    uri = tiered_uri(
        "memory://?max_bytes=1MiB&max_entries=3",
        f"file://{tmp_path}/l2?max_bytes=2MiB",
        write="behind",
        queue=8,
        full="drop",
        max_wait=0.5,
    )
    b = mlxcache.open_backend(uri)
    assert isinstance(b, TieredBackend) and b.write == "behind"
    assert b.l1.max_entries == 3 and b.l1.max_bytes == 2**20 and b.l2.max_bytes == 2 * 2**20
    assert (b.writer.queue, b.writer.full, b.writer.max_wait) == (8, "drop", 0.5)
    b.close()
    plain = mlxcache.open_backend(f"tiered://?l1=memory://&l2=file://{tmp_path}/p")
    assert plain.write == "through"
    kw = mlxcache.open_backend("tiered://", l1="memory://", l2=f"file://{tmp_path}/q")
    assert isinstance(kw.l2, DiskBackend)


@pytest.mark.parametrize(
    "uri, match",
    [
        ("tiered://?l1=memory://", "both l1= and l2="),
        ("tiered://?l1=memory://?max_bytes=1&max_entries=2&l2=memory://", "url-encode"),
        ("tiered://?l1=memory://&l2=memory://&write=back", "through or behind"),
        ("tiered://?l1=memory://&l2=memory://&full=block", "wait or drop"),
        ("tiered://?l1=memory://&l2=memory://&queue=0", "queue"),
        ("tiered://?l1=memory://&l2=memory://&max_wait=-1", "max_wait"),
        ("tiered://?l1=memory://&l2=memory://&fill=maybe", "fill"),
        ("tiered://host/x?l1=memory://&l2=memory://", "no host or path"),
        ("tiered://?l1=nope://&l2=memory://", "unknown cache URI"),
    ],
)
def test_bad_tiered_uris_name_the_problem(uri, match):
    with pytest.raises(ValueError, match=match):
        mlxcache.open_backend(uri)


@pytest.mark.parametrize("name", ["memory", "file", "redis", "redis-cluster", "plugin"])
def test_touch_many_refreshes_lru_without_reading(name, request, tmp_path):
    from backend_factories import BACKENDS

    b = mlxcache.open_backend(BACKENDS[name](request, tmp_path).uri)
    for k in ("a", "b", "c"):
        b.put(k, blob_record(1000))
    unit = b.stats()["bytes"] // 3
    hits = b.stats()["hits"]
    b.touch_many(["a", "missing"])  # a third-party backend without it: nothing happens
    assert b.stats()["hits"] == hits and b.stats()["errors"] == 0  # nothing was read
    b.trim(2 * unit)
    expected = ["b", "c"] if name == "plugin" else ["a", "c"]
    assert sorted(b.keys()) == expected
    with pytest.raises(TypeError):
        b.touch_many([1])
