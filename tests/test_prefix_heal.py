"""Healing after a lost store (issue 21): when Redis restarts empty, a prompt hot on worker A
is written back from A's hot tier on its next hit, so worker B hits it without recomputing.
Real redis-server (restarted: no persistence), two PrefixCaches as the two workers."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache
from redis_server import RedisServer

import mlxcache
from mlxcache import PrefixCache
from mlxcache.prefix import hot as prefix_hot


def kv(n: int, seed: int = 0) -> list[KVCache]:
    out = []
    for layer in range(2):
        c = KVCache()
        x = mx.random.normal((1, 2, n, 4), key=mx.random.key(seed + layer))
        c.update_and_fetch(x, -x)
        out.append(c)
    return out


def same_state(a: list, b: list) -> bool:
    """The same keys and values up to each layer's offset (a buffer may hold more)."""

    def kv_of(c):
        return [np.array(t[..., : c.offset, :]) for t in (c.keys, c.values)]

    return all(
        x.offset == y.offset and all(map(np.array_equal, kv_of(x), kv_of(y)))
        for x, y in zip(a, b, strict=True)
    )


@pytest.fixture
def server():
    s = RedisServer()
    yield s
    s.close()


@pytest.mark.parametrize("n", [40, 48])  # ending inside a block (a sibling entry), on a boundary
def test_a_hot_prompt_is_written_back_after_redis_restarts_empty(server, monkeypatch, n):
    monkeypatch.setattr(prefix_hot, "TOUCH_EVERY", 0.0)  # every hot hit checks its records
    tokens, cache = list(range(n)), kv(n)
    with mlxcache.open_backend(server.url) as backend:
        a = PrefixCache(backend, model="heal", block_size=16)
        a.store(tokens, cache, extras={"rope": mx.array([1, 2])})
        server.restart()  # empty: no persistence
        b = PrefixCache(backend, model="heal", block_size=16, hot_bytes=0)  # worker B
        assert b.lookup(tokens) is None
        hit = a.lookup(tokens)  # A's hot tier answers, and finds its records gone
        assert hit.num_tokens == n
        assert a.flush(10)
        assert a.stats()["records_healed"] == len(list(backend.keys())) > 0
        again = b.lookup(tokens, require_extras=True)  # B: a backend hit, nothing recomputed
        assert again is not None and again.num_tokens == n
        assert same_state(again.prompt_cache, cache)
        assert again.extras["rope"].tolist() == [1, 2]
        a.lookup(tokens)  # all there now: nothing more is written
        assert a.flush(10) and a.stats()["records_healed"] == len(list(backend.keys()))
        a.close(), b.close()


def test_a_hit_that_ended_between_stored_lengths_gets_no_tail(server, monkeypatch):
    """A hot entry from a hit inside a longer stored prompt has no tail of its own: only its
    blocks are written back, never a tail (with empty extras) at a length never stored."""
    monkeypatch.setattr(prefix_hot, "TOUCH_EVERY", 0.0)
    with mlxcache.open_backend(server.url) as backend:
        w = PrefixCache(backend, model="heal", block_size=16, hot_bytes=0)
        w.store(list(range(64)), kv(64), extras={"rope": mx.array([3])})
        a = PrefixCache(backend, model="heal", block_size=16)
        hit = a.lookup(list(range(32)) + [999] * 5)  # 32 tokens: two whole blocks, no tail there
        assert hit.num_tokens == 32
        server.restart()
        assert a.lookup(list(range(32)) + [999] * 5).num_tokens == 32  # hot
        assert a.flush(10)
        kinds = sorted(k.split("/")[-2] for k in backend.keys())
        assert kinds == ["b", "b"]
        a.close(), w.close()
