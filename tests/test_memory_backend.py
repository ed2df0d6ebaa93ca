"""memory://: LRU with a byte budget, no aliasing with the caller."""

import mlx.core as mx

import mlxcache
from mlxcache import Record


def rec(n: int, fill: float = 1.0) -> Record:
    return Record({"x": mx.full((n,), fill, dtype=mx.float32)}, {"n": n})


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


def test_zero_entry_limit_stores_nothing():
    b = mlxcache.open_backend("memory://?max_entries=0")
    b.put("a", rec(1))
    assert len(b) == 0 and b.get("a") is None
