"""memory://: LRU with a byte budget, no aliasing with the caller."""

import mlx.core as mx
import pytest

import mlxcache
from mlxcache import Record


def rec(n: int, fill: float = 1.0) -> Record:
    return Record({"x": mx.full((n,), fill, dtype=mx.float32)}, {"n": n})


def test_stats_right_after_open():
    stats = mlxcache.open_backend("memory://").stats()
    for field in ("entries", "bytes", "max_bytes", "hits", "misses", "evictions", "errors"):
        assert field in stats


def test_budget_counts_each_key_once_and_evicts_lru():
    b = mlxcache.open_backend("memory://?max_bytes=1KiB")
    b.put("a", rec(100))  # 400 bytes
    b.put("a", rec(100))  # same key again: still 400
    assert b.stats()["bytes"] == 400
    b.put("b", rec(100))
    assert b.get("a") is not None  # a is now most recent
    b.put("c", rec(100))  # 1200 > 1024: evicts b, the least recently used
    assert "b" not in b and "a" in b and "c" in b
    assert b.stats()["evictions"] == 1


def test_oversize_record_is_refused_and_flushes_nothing(caplog):
    b = mlxcache.open_backend("memory://", max_bytes=1000)
    b.put("small", rec(10))
    b.put("huge", rec(1000))
    assert "huge" not in b and "small" in b
    assert "larger than max_bytes" in caplog.text


@pytest.mark.parametrize("uri", ["memory://?max_bytes=0", "memory://?max_entries=0"])
def test_zero_limits_store_nothing(uri):
    b = mlxcache.open_backend(uri)
    b.put("a", rec(1))
    assert len(b) == 0 and b.get("a") is None


def test_no_aliasing_either_way():
    from mlx_vlm.models.cache import KVCache

    b = mlxcache.open_backend("memory://")
    cache = KVCache()
    kv = mx.ones((1, 2, 256, 4))
    cache.update_and_fetch(kv, kv)
    keys, values = cache.state  # offset == buffer size: the live buffers
    b.put("k", Record({"keys": keys, "values": values}))
    cache.offset = 100  # trim, then overwrite in place
    cache.update_and_fetch(mx.zeros((1, 2, 10, 4)), mx.zeros((1, 2, 10, 4)))
    got = b.get("k")
    assert got.arrays["keys"][0, 0, 105, 0].item() == 1.0
    got.arrays["keys"][0, 0, 0, 0] = 42.0
    got.meta["new"] = 1
    again = b.get("k")
    assert again.arrays["keys"][0, 0, 0, 0].item() == 1.0
    assert "new" not in again.meta


def test_keys_delete_clear_and_context_manager():
    with mlxcache.open_backend("memory://") as b:
        b.put("p/1", rec(1))
        b.put("p/2", rec(1))
        b.put("q/1", rec(1))
        assert sorted(b.keys("p/")) == ["p/1", "p/2"]
        assert b.contains_many(["p/1", "zz"]) == [True, False]
        assert [r is not None for r in b.get_many(["q/1", "zz"])] == [True, False]
        assert b.delete("p/1") and not b.delete("p/1")
        b.clear()
        assert len(b) == 0 and b.stats()["bytes"] == 0


def test_wrong_types_raise():
    b = mlxcache.open_backend("memory://")
    with pytest.raises(TypeError):
        b.put(1, rec(1))
    with pytest.raises(TypeError):
        b.put("a", {"x": mx.zeros(1)})
    with pytest.raises(TypeError):
        b.get(b"a")
