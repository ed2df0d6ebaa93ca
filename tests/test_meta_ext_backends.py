"""A stored record whose meta holds a msgpack extension type (a Timestamp) is a miss on every
persistent backend: counted as an error, logged, and the entry removed (issue 21). The
record is checksummed as the library would have written it, so only the meta decoder stops it."""

from __future__ import annotations

import sqlite3

import msgpack
import redis
from helpers import assert_same, sample_record
from test_fuzz_decoders import ext_record

import mlxcache
from mlxcache.backends.tiered import tiered_uri

GOOD = sample_record()
FORGED = ext_record(msgpack.Timestamp(1_700_000_000, 0))


def _check(b, plant) -> None:
    b.put("good", GOOD)
    b.put("k", GOOD)
    plant()
    before = b.counters()["errors"]
    good, k = b.get_many(["good", "k"])
    assert_same(good, GOOD)
    assert k is None
    assert b.counters()["errors"] == before + 1
    assert "k" not in b  # removed
    assert b.get("k") is None


def test_file(tmp_path):
    root = tmp_path / "c"
    with mlxcache.open_backend(f"file://{root}") as b:

        def plant():
            with sqlite3.connect(root / "index.sqlite") as db:
                (name,) = db.execute("SELECT file FROM entries WHERE key = 'k'").fetchone()
            (root / "data" / name).write_bytes(FORGED)

        _check(b, plant)


def test_redis(redis_url):
    with redis.Redis.from_url(redis_url) as r, mlxcache.open_backend(redis_url) as b:
        _check(b, lambda: r.set(b.layout.vkey("k"), FORGED))


def test_tiered_over_redis(redis_url):
    uri = tiered_uri("memory://", redis_url)
    with redis.Redis.from_url(redis_url) as r, mlxcache.open_backend(uri) as b:
        b.put("good", GOOD)
        r.set(b.l2.layout.vkey("k"), FORGED)  # in L2 only: L1 never held it
        assert_same(b.get("good"), GOOD)
        assert b.get("k") is None and "k" not in b.l2
