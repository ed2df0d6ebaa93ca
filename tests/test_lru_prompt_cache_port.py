"""mlx-lm's own LRUPromptCache tests, run against mlxcache's SharedPromptCache.

Ported from mlx-lm's ``tests/test_server.py`` (class ``TestLRUPromptCache`` and its
``MockCache``), mlx-lm 0.32.0 (github.com/ml-explore/mlx-lm at d78bf58e). The assertions are
the upstream ones (``_kv`` adapts to 0.32.2's ``KVCache.state``); each test runs against the
hot tier alone, over ``memory://`` and over ``file://``, and against mlx-lm's class itself (so
a difference shows as a failure of ours only). MockCache layers cannot be stored: the shared
tier must log and carry on.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, LRUPromptCache

from mlxcache.integrations.mlx_lm.prompt_cache import SharedPromptCache


class MockCache:
    def __init__(self, value, is_trimmable: bool = True):
        self.value = value
        self._is_trimmable = is_trimmable

    @property
    def nbytes(self):
        return len(self.value)

    def __eq__(self, other):
        return other.value == self.value

    def is_trimmable(self):
        return self._is_trimmable

    def trim(self, n):
        assert self._is_trimmable
        return n


def _kv(layer):
    # mlx-lm 0.32.2's KVCache.state is (keys, values, offset) with the whole allocated buffer;
    # upstream's test (0.32.0) unpacked two arrays of exactly the cached tokens.
    keys, values, offset = layer.state
    return keys[..., :offset, :], values[..., :offset, :]


@pytest.fixture(params=["mlx-lm", "hot-only", "memory", "file"])
def make(request, tmp_path):
    made = []

    def factory(**kw):
        if request.param == "mlx-lm":
            return LRUPromptCache(**kw)
        if request.param == "hot-only":
            c = SharedPromptCache(**kw, persist=False)
        elif request.param == "memory":
            c = SharedPromptCache(**kw, backend="memory://")
        else:
            c = SharedPromptCache(**kw, backend=f"file://{tmp_path}/cache")
        made.append(c)
        return c

    yield factory
    for c in made:
        c.close()


def test_caching(make):
    cache = make(max_size=10)

    def get_kv(n):
        keys = mx.arange(n).reshape(1, 1, n, 1)
        return keys, keys

    model = ("test", None, None)
    tokens = [10] * 24

    c, t = cache.fetch_nearest_cache(model, tokens)
    assert c is None
    assert t == tokens

    c = [KVCache()]
    c[0].update_and_fetch(*get_kv(24))
    cache.insert_cache(model, t, c)

    # Fetching a cache that is strictly a prefix doesn't remove it from the lru cache
    tokens = tokens + [20] * 5
    c, t = cache.fetch_nearest_cache(model, tokens)
    k, v = _kv(c[0])
    assert (k == v).all().item()
    assert (k.flatten() == mx.arange(24)).all().item()
    assert t == [20] * 5
    assert len(cache) == 1

    # Inserting a trimmable cache with shared prefix removes the prefixes
    tokens = tokens + [30] * 3
    c[0].update_and_fetch(*get_kv(8))
    cache.insert_cache(model, tokens, c)
    assert len(cache) == 1

    # Fetching a cache with a shared prefix doesn't remove it either
    tokens = tokens[:26] + [40] * 8
    c, t = cache.fetch_nearest_cache(model, tokens)
    k, v = _kv(c[0])
    assert (k == v).all().item()
    assert (k.flatten() == mx.concatenate([mx.arange(24), mx.arange(2)])).all().item()
    assert t == [40] * 8
    assert len(cache) == 1

    # Inserting a diverged cache actually creates another entry
    c[0].update_and_fetch(*get_kv(8))
    cache.insert_cache(model, tokens, c)
    assert len(cache) == 2


def test_lru(make):
    cache = make(max_size=2)
    model = ("test", None, None)
    cache.insert_cache(model, [1, 2], [MockCache("test1")])
    cache.insert_cache(model, [2, 3], [MockCache("test2")])

    c, t = cache.fetch_nearest_cache(model, [1, 2])
    assert c == [MockCache("test1")]
    assert t == []
    c, t = cache.fetch_nearest_cache(model, [1])
    assert c == [MockCache("test1")]
    assert t == [1]
    c, t = cache.fetch_nearest_cache(model, [1, 3, 4])
    assert c == [MockCache("test1")]
    assert t == [3, 4]
    c, t = cache.fetch_nearest_cache(model, [2, 3, 4])
    assert c == [MockCache("test2")]
    assert t == [4]
    c, t = cache.fetch_nearest_cache(model, [2, 4, 5])
    assert c == [MockCache("test2")]
    assert t == [4, 5]

    cache.insert_cache(model, [1, 2], [MockCache("test1")])
    cache.insert_cache(model, [2, 3], [MockCache("test2")])
    cache.insert_cache(model, [3, 4], [MockCache("test3")])

    c, t = cache.fetch_nearest_cache(model, [1, 2])
    assert c is None
    assert t == [1, 2]
    c, t = cache.fetch_nearest_cache(model, [2, 3])
    assert c == [MockCache("test2")]
    assert t == []
    c, t = cache.fetch_nearest_cache(model, [3, 4])
    assert c == [MockCache("test3")]
    assert t == []

    cache.insert_cache(model, [4, 5], [MockCache("test4")], cache_type="user")
    c, t = cache.fetch_nearest_cache(model, [2, 3])
    assert c is None
    assert t == [2, 3]
    c, t = cache.fetch_nearest_cache(model, [3, 4])
    assert c == [MockCache("test3")]
    assert t == []
    c, t = cache.fetch_nearest_cache(model, [4, 5])
    assert c == [MockCache("test4")]
    assert t == []

    cache.insert_cache(model, [5, 6], [MockCache("test5")])
    cache.insert_cache(model, [6, 7], [MockCache("test6")])
    c, t = cache.fetch_nearest_cache(model, [5, 6])
    assert c is None
    assert t == [5, 6]
    c, t = cache.fetch_nearest_cache(model, [6, 7])
    assert c == [MockCache("test6")]
    assert t == []
    c, t = cache.fetch_nearest_cache(model, [4, 5])
    assert c == [MockCache("test4")]
    assert t == []


def test_insert_trimmable_cache_removes_immediate_prefix(make):
    cache = make(max_size=10)
    model = ("test", None, None)

    cache.insert_cache(model, [1, 2], [MockCache("ab")])
    assert len(cache) == 1
    assert cache.nbytes == 2

    cache.insert_cache(model, [1, 2, 3], [MockCache("abc")])
    assert len(cache) == 1
    assert cache.nbytes == 3


def test_insert_empty_tokens_does_not_self_destruct(make):
    cache = make(max_size=10)
    model = ("test", None, None)

    cache.insert_cache(model, [], [MockCache("root")])
    assert len(cache) == 1
    assert cache.nbytes == 4

    c, t = cache.fetch_nearest_cache(model, [])
    assert c is not None
    assert t == []


def test_fetch_empty_tokens_after_root_eviction(make):
    cache = make(max_size=10)
    model = ("test", None, None)

    cache.insert_cache(model, [], [MockCache("root")])
    cache.insert_cache(model, [1], [MockCache("a")])

    c, t = cache.fetch_nearest_cache(model, [])
    assert c is None
    assert t == []


def test_lru_bytes(make):
    cache = make(max_size=100, max_bytes=10)
    model = ("test", None, None)

    cache.insert_cache(model, [1, 2], [MockCache("aaa")])
    cache.insert_cache(model, [3, 4], [MockCache("bbb")])
    cache.insert_cache(model, [4, 5], [MockCache("ccc")])
    cache.insert_cache(model, [6, 7], [MockCache("ddd")])

    assert len(cache) == 3
    assert cache.nbytes == 9

    cache.trim_to(n_bytes=7)
    assert len(cache) == 2
    assert cache.nbytes == 6

    c, t = cache.fetch_nearest_cache(model, [1, 2])
    assert c is None
    assert t == [1, 2]
    c, t = cache.fetch_nearest_cache(model, [3, 4])
    assert c is None
    assert t == [3, 4]


def test_stats_by_type_is_mlx_lms(make):
    cache = make(max_size=10)
    model = ("test", None, None)
    cache.insert_cache(model, [1, 2], [MockCache("ab")], cache_type="system")
    cache.insert_cache(model, [5, 6, 7], [MockCache("xyz")], cache_type="user")
    stats = cache.stats_by_type()
    assert list(stats) == ["assistant", "user", "system"]
    assert stats["system"] == {"n_sequences": 1, "n_bytes": 2}
    assert stats["user"] == {"n_sequences": 1, "n_bytes": 3}
    assert stats["assistant"] == {"n_sequences": 0, "n_bytes": 0}
