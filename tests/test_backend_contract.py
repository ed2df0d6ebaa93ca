"""The CacheBackend contract: every backend in backend_factories.BACKENDS passes all of it.

What is specific to one backend (file layout, Redis chunks, crash safety) stays in that
backend's own test module; what the protocol promises is tested here, once.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest
from backend_factories import BACKENDS, Store
from helpers import assert_same, bits, blob_record, run_py, sample_record

import mlxcache
from mlxcache import CacheBackend, Record
from mlxcache.records import format as fmt


@pytest.fixture(params=sorted(BACKENDS))
def store(request, tmp_path) -> Store:
    return BACKENDS[request.param](request, tmp_path)


def open_(store: Store, **options) -> mlxcache.CacheBackend:
    return mlxcache.open_backend(store.uri, **options)


def unit_size(store: Store) -> int:
    """The stored size of one blob_record(1000) on this backend (sizes differ by backend)."""
    with open_(store) as b:
        b.put("unit", blob_record(1000))
        size = b.stats()["bytes"]
        b.clear()
    assert size >= 1000
    return size


# ---------------------------------------------------------------- round trips


def test_is_a_cache_backend_and_starts_empty(store):
    b = open_(store)
    assert isinstance(b, CacheBackend)
    assert len(b) == 0 and list(b.keys()) == [] and b.get("nothing") is None
    stats = b.stats()
    for field in ("backend", "entries", "bytes", "max_bytes", "available"):
        assert field in stats
    for field in ("hits", "misses", "evictions", "errors"):
        assert isinstance(stats[field], int)
    assert stats["available"] is True and stats["misses"] == 1 and stats["errors"] == 0


def test_every_dtype_round_trips_bit_exact(store):
    rec = sample_record()
    b = open_(store)
    b.put("k", rec)
    got = b.get("k")
    assert got is not None
    assert_same(got, rec)
    assert b.stats()["hits"] == 1


def test_get_hands_out_new_objects(store):
    b = open_(store)
    b.put("k", Record({"x": mx.arange(6, dtype=mx.float32)}, {"m": [1]}))
    got = b.get("k")
    got.arrays["x"][0] = 42.0  # writes to what get returned reach nobody else
    got.meta["m"].append(2)
    again = b.get("k")
    assert again.arrays["x"][0].item() == 0.0 and again.meta["m"] == [1]


def test_put_replaces_and_counts_once(store):
    b = open_(store)
    b.put("k", blob_record(1000, seed=1))
    once = b.stats()["bytes"]
    b.put("k", blob_record(1000, seed=2))
    assert len(b) == 1 and b.stats()["bytes"] == once
    assert bits(b.get("k").arrays["x"]) == bits(blob_record(1000, seed=2).arrays["x"])


def test_batch_calls_keep_order(store):
    b = open_(store)
    for key in ("p/1", "p/2", "q/1", "p"):
        b.put(key, blob_record(10, seed=len(key)))
    assert b.contains_many(["p/1", "zz", "q/1", "p/1"]) == [True, False, True, True]
    got = b.get_many(["q/1", "zz", "p", "q/1"])
    assert [r is not None for r in got] == [True, False, True, True]
    assert b.get_many([]) == [] and b.contains_many([]) == []
    assert "p/1" in b and "p/3" not in b
    assert sorted(b.keys("p/")) == ["p/1", "p/2"] and sorted(b.keys()) == ["p", "p/1", "p/2", "q/1"]
    assert list(b.keys("zz")) == []
    stats = b.stats()
    assert (stats["hits"], stats["misses"], stats["entries"]) == (3, 1, 4)


def test_put_many_then_get_many(store):
    b = open_(store)
    b.put("p/0", blob_record(10, seed=9))
    items = [(f"p/{i}", blob_record(100 + i, seed=i)) for i in range(5)]
    b.put_many(items)  # p/0 is replaced, p/1..p/4 are new
    b.put_many([])
    got = b.get_many([k for k, _ in items] + ["zz"])
    assert got[-1] is None and len(b) == 5
    for (_, want), have in zip(items, got, strict=False):
        assert have is not None and bits(have.arrays["x"]) == bits(want.arrays["x"])
    assert b.put_many(iter([("g", blob_record(3))])) is None and "g" in b  # any iterable
    stats = b.stats()
    assert stats["errors"] == 0 and stats["bytes_written"] == 10 + sum(range(100, 105)) + 3


def test_put_many_refuses_oversize_entries_alone(store, caplog):
    size = unit_size(store)
    b = open_(store, max_bytes=3 * size)
    with caplog.at_level(logging.WARNING, logger="mlxcache"):
        b.put_many(
            [("a", blob_record(1000)), ("huge", blob_record(4000)), ("c", blob_record(1000))]
        )
    assert "larger than max_bytes" in caplog.text and "'huge'" in caplog.text
    assert "huge" not in b and "a" in b and "c" in b and len(b) == 2
    b.put_many([(f"n{i}", blob_record(1000, seed=i)) for i in range(4)])  # over the budget
    assert b.stats()["bytes"] <= 3 * size and "n3" in b  # the batch's last is the most recent
    assert b.stats()["errors"] == 0


def test_delete_and_clear(store):
    b = open_(store)
    for key in ("a", "b", "c"):
        b.put(key, blob_record(10))
    assert b.delete("a") is True and b.delete("a") is False and len(b) == 2
    b.clear()
    assert len(b) == 0 and b.stats()["bytes"] == 0 and list(b.keys()) == []


def test_header_describes_without_the_tensors(store):
    rec = sample_record()
    b = open_(store)
    b.put("k", rec)
    header = b.header("k")
    assert header is not None and header.meta == dict(rec.meta)
    assert {t.name for t in header.tensors} == set(rec.arrays)
    assert header == fmt.header_of(rec, key="k", signer=getattr(b, "signer", None))
    assert b.header("missing") is None


# ---------------------------------------------------------------- budgets


def test_budget_evicts_least_recently_used(store):
    size = unit_size(store)
    b = open_(store, max_bytes=3 * size + size // 2)
    for key in ("k0", "k1", "k2"):
        b.put(key, blob_record(1000))
    assert b.get("k0") is not None  # k0 is now the most recent
    b.put("k3", blob_record(1000))  # four do not fit: k1, the least recently used, goes
    assert sorted(b.keys()) == ["k0", "k2", "k3"]
    assert b.stats()["evictions"] == 1 and b.stats()["bytes"] <= b.max_bytes


def test_trim_evicts_down_to_a_budget(store):
    size = unit_size(store)
    b = open_(store)
    for i in range(4):
        b.put(f"k{i}", blob_record(1000))
    assert b.get("k0") is not None
    assert b.trim(2 * size) == 2
    assert sorted(b.keys()) == ["k0", "k3"] and b.stats()["evictions"] == 2
    assert b.trim(0) == 2 and len(b) == 0
    with pytest.raises(ValueError):
        b.trim(-1)


def test_zero_budget_stores_nothing(store):
    b = open_(store, max_bytes=0)
    b.put("a", blob_record(10))
    assert len(b) == 0 and b.get("a") is None and b.stats()["errors"] == 0


def test_oversize_record_is_refused_and_flushes_nothing(store, caplog):
    size = unit_size(store)
    b = open_(store, max_bytes=2 * size)
    b.put("small", blob_record(1000))
    with caplog.at_level(logging.WARNING, logger="mlxcache"):
        b.put("huge", blob_record(3000))
    assert "huge" not in b and "small" in b and len(b) == 1
    assert "larger than max_bytes" in caplog.text and b.stats()["errors"] == 0


# ---------------------------------------------------------------- arguments and failures


@pytest.mark.parametrize(
    "call,exc",
    [
        (lambda b: b.put(1, blob_record(1)), TypeError),
        (lambda b: b.put("", blob_record(1)), ValueError),
        (lambda b: b.put("\ud800", blob_record(1)), ValueError),
        (lambda b: b.put("a", {"x": mx.zeros(1)}), TypeError),
        (lambda b: b.put_many([("a", blob_record(1)), (2, blob_record(1))]), TypeError),
        (lambda b: b.put_many([("a", blob_record(1)), ("b", None)]), TypeError),
        (lambda b: b.get(b"a"), TypeError),
        (lambda b: b.get_many(["a", 2]), TypeError),
        (lambda b: b.contains_many(["a", 2]), TypeError),
        (lambda b: 3 in b, TypeError),
        (lambda b: b.delete(None), TypeError),
        (lambda b: b.keys(1), TypeError),
        (lambda b: b.header(1), TypeError),
    ],
)
def test_wrong_arguments_raise_before_anything_is_stored(store, call, exc):
    b = open_(store)
    with pytest.raises(exc):
        call(b)
    assert len(b) == 0 and b.stats()["errors"] == 0


def test_store_failures_are_misses_counted_and_kept(store, monkeypatch, caplog):
    """Whatever a backend's raw operation raises reaches the caller as a miss or a no-op."""
    b = open_(store)
    b.put("k", blob_record(10))

    def broken(*args, **kwargs):
        raise RuntimeError("the store is on fire")  # a fault, not an unreachable store

    for raw in ("_get_many", "_put", "_contains_many", "_delete", "_keys", "_count", "_clear"):
        monkeypatch.setattr(b, raw, broken)
    with caplog.at_level(logging.WARNING, logger="mlxcache"):
        assert b.get("k") is None and b.get_many(["k", "j"]) == [None, None]
        b.put("j", blob_record(10))
        assert b.contains_many(["k"]) == [False] and "k" not in b
        assert b.delete("k") is False and list(b.keys()) == [] and len(b) == 0
        b.clear()
    assert b.stats()["errors"] >= 9 and "on fire" in b.last_error and "on fire" in caplog.text
    monkeypatch.undo()
    assert b.get("k") is not None  # nothing stored was lost


# ---------------------------------------------------------------- processes and lifetime


def test_another_process_reads_what_this_one_wrote(store):
    if not store.shared:
        assert open_(store).get("from-child") is None  # a private store: nothing crosses
        return
    run_py(
        """
        import sys, mlxcache
        from helpers import sample_record
        mlxcache.open_backend(sys.argv[1]).put("from-child", sample_record(seed=5))
        """,
        store.uri,
        env=store.env or {},
    )
    got = open_(store).get("from-child")
    assert got is not None
    assert_same(got, sample_record(seed=5))


def test_close_and_context_manager(store):
    with open_(store) as b:
        b.put("k", blob_record(10))
        assert "k" in b
    b.close()  # twice is fine
    again = open_(store)
    assert ("k" in again) is store.shared
