"""Entry lifetimes on every backend: ttl, idle_ttl and pins, on a clock the test moves.

No sleeps: ``mlxcache.backends.clock.clock`` is replaced by a fake that the test advances;
``redis://`` follows it through the offset its scripts add to the server's TIME.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from backend_factories import BACKENDS
from helpers import blob_record
from mlx_lm.models.cache import KVCache

import mlxcache
from mlxcache import PrefixCache
from mlxcache.backends import clock
from mlxcache.backends.tiered import tiered_uri


class FakeClock:
    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def fake_clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(clock, "clock", fake)
    return fake


def _tiered(request: Any, tmp_path: Path, **opts: Any) -> mlxcache.CacheBackend:
    """memory:// over file://, both with the same lifetimes; max_bytes is L2's."""
    query = "&".join(f"{k}={v}" for k, v in opts.items() if k != "max_bytes")
    l1 = "memory://" + (f"?{query}" if query else "")
    l2 = f"file://{tmp_path}/l2" + (f"?{query}" if query else "")
    extra = {"max_bytes": opts["max_bytes"]} if "max_bytes" in opts else {}
    return mlxcache.open_backend(tiered_uri(l1, l2), **extra)


def _plain(name: str) -> Callable[..., mlxcache.CacheBackend]:
    def open_(request: Any, tmp_path: Path, **opts: Any) -> mlxcache.CacheBackend:
        return mlxcache.open_backend(BACKENDS[name](request, tmp_path).uri, **opts)

    return open_


OPENERS = {
    "memory": _plain("memory"),
    "file": _plain("file"),
    "redis": _plain("redis"),
    "redis-cluster": _plain("redis-cluster"),
    "redis-sentinel": _plain("redis-sentinel"),
    "tiered": _tiered,
}


@pytest.fixture(params=sorted(OPENERS))
def opener(request, tmp_path) -> Callable[..., mlxcache.CacheBackend]:
    return lambda **opts: OPENERS[request.param](request, tmp_path, **opts)


def test_ttl_expires_on_the_controlled_clock(opener, fake_clock):
    b = opener(ttl=100)
    b.put("k", blob_record(1000))
    fake_clock.advance(60)
    assert b.get("k") is not None  # a read does not extend a ttl
    fake_clock.advance(50)
    assert b.get("k") is None and "k" not in b
    assert list(b.keys()) == [] and len(b) == 0 and b.stats()["entries"] == 0
    b.put("k", blob_record(1000, seed=1))  # a put starts a new lifetime
    fake_clock.advance(60)
    assert b.get("k") is not None
    b.close()


def test_idle_ttl_expires_unused_entries_only(opener, fake_clock):
    b = opener(idle_ttl=100)
    b.put("used", blob_record(1000))
    b.put("unused", blob_record(1000, seed=1))
    for _ in range(3):  # 180 s after the put, but never 100 s without a read
        fake_clock.advance(60)
        assert b.get("used") is not None
    assert b.get("unused") is None and "unused" not in b
    fake_clock.advance(101)
    assert b.get("used") is None and len(b) == 0
    b.close()


def test_expired_entries_do_not_count_against_the_budget(opener, fake_clock):
    probe = opener()
    probe.put("unit", blob_record(1000))
    unit = probe.stats()["bytes"]
    probe.clear()
    probe.close()
    b = opener(ttl=100, max_bytes=3 * unit + unit // 2)
    for k in "abc":
        b.put(k, blob_record(1000))
    fake_clock.advance(101)
    for k in "def":
        b.put(k, blob_record(1000))
    assert b.contains_many(list("abcdef")) == [False] * 3 + [True] * 3
    stats = b.stats()
    assert stats["evictions"] == 0 and stats["entries"] == 3 and stats["bytes"] == 3 * unit
    b.close()


def test_pinned_entries_outlive_ttl_and_unpin_restores_them(opener, fake_clock):
    b = opener(ttl=100, idle_ttl=50)
    b.put("p", blob_record(1000))
    assert b.pin("p") and b.pin("p")  # pinning twice is fine
    assert not b.pin("missing")
    fake_clock.advance(1000)
    assert b.get("p") is not None and b.stats()["pinned_entries"] == 1
    assert b.unpin("p") and not b.unpin("p")
    fake_clock.advance(30)  # an ordinary entry again: ttl and idle_ttl count from the unpin
    assert "p" in b and b.stats()["pinned_entries"] == 0
    fake_clock.advance(21)
    assert b.get("p") is None
    b.close()


def test_a_pin_over_pin_max_bytes_is_refused_with_a_log_line(opener, caplog):
    b = opener(pin_max_bytes=1500)
    b.put("a", blob_record(1000))
    b.put("b", blob_record(1000, seed=1))
    assert b.pin("a")
    with caplog.at_level(logging.WARNING, logger="mlxcache"):
        assert not b.pin("b")
    assert any("not pinning" in r.getMessage() for r in caplog.records)
    assert b.stats()["pinned_entries"] == 1
    assert b.unpin("a") and b.pin("b")
    b.close()


# ---------------------------------------------------------------- a pinned system prompt

BLOCK = 16


def kv_cache(tokens: list[int], layers: int = 2) -> list[KVCache]:
    """A real KVCache per layer holding ``len(tokens)`` positions (values from the tokens)."""
    out = []
    base = mx.array(tokens, dtype=mx.float16)[None, None, :, None]
    for layer in range(layers):
        c = KVCache()
        kv = mx.broadcast_to(base + layer, (1, 2, len(tokens), 8))
        c.update_and_fetch(kv, kv * 2)
        out.append(c)
    mx.eval([c.state for c in out])
    return out


def test_a_pinned_system_prompt_survives_a_burst_10x_the_budget(opener):
    system = list(range(1, 65))  # 4 blocks
    probe = PrefixCache(opener(), model="pin-test", block_size=BLOCK)
    probe.store(system, kv_cache(system))
    size = probe.backend.stats()["bytes"]  # what one such prompt takes on this backend
    probe.backend.clear()
    probe.backend.close()
    budget = 4 * size
    cache = PrefixCache(opener(max_bytes=budget), model="pin-test", block_size=BLOCK)
    assert cache.store(system, kv_cache(system), pin=True) == len(system)
    burst = 0
    seed = 1000
    while burst < 10 * budget:  # one-off prompts, never pinned
        other = list(range(seed, seed + 64))
        seed += 64
        cache.store(other, kv_cache(other))
        burst += size
    stats = cache.backend.stats()
    assert stats["evictions"] > 0 and stats["bytes"] - stats["pinned_bytes"] <= budget
    hit = cache.lookup([*system, 7, 7, 7])
    assert hit is not None and hit.num_tokens == len(system)
    assert cache.stats()["records_pinned"] == 5  # 4 blocks and the tail
    cache.close()


def test_store_pin_on_a_backend_that_cannot_pin_is_a_clear_error(request, tmp_path):
    b = mlxcache.open_backend(BACKENDS["plugin"](request, tmp_path).uri)
    assert not getattr(b, "pinnable", False)
    with pytest.raises(NotImplementedError, match="cannot pin"):
        b.pin("k")
    cache = PrefixCache(b, model="pin-test", block_size=BLOCK)
    with pytest.raises(NotImplementedError, match="cannot pin"):
        cache.store([1, 2, 3], kv_cache([1, 2, 3]), pin=True)


def test_lifetime_options_are_checked():
    for bad in ("ttl=0", "idle_ttl=-1", "pin_max_bytes=lots"):
        with pytest.raises(ValueError, match=bad.split("=")[0]):
            mlxcache.open_backend(f"memory://?{bad}")


def test_a_file_index_made_before_pins_gets_its_column(tmp_path):
    import sqlite3

    uri = f"file://{tmp_path}/old"
    with mlxcache.open_backend(uri) as b:
        b.put("k", blob_record(1000))
    db = sqlite3.connect(tmp_path / "old" / "index.sqlite")
    db.execute("DROP INDEX entries_pinned")
    db.execute("ALTER TABLE entries DROP COLUMN pinned")  # the layout of an older mlxcache
    db.commit()
    db.close()
    with mlxcache.open_backend(uri, readonly=True) as b:  # read-only: nothing is changed
        assert b.get("k") is not None and b.stats()["pinned_entries"] == 0
    with mlxcache.open_backend(uri) as b:
        assert b.get("k") is not None and b.pin("k") and b.stats()["pinned_entries"] == 1
