"""redis:// against a real redis-server: atomic records, shared LRU budget, TTL, failures."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import mlx.core as mx
import pytest
import redis
from helpers import assert_same, bits, blob_record, run_py, sample_record
from redis_server import RedisServer, free_port

import mlxcache
from mlxcache import Record
from mlxcache.backends.redis import RedisBackend
from mlxcache.records import format as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stored_size(record: Record) -> int:
    return len(st.to_bytes(record))


def raw(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


# ---------------------------------------------------------------- round trips


def test_bytes_are_the_stored_value_sizes(redis_url):
    rec = sample_record()
    with mlxcache.open_backend(redis_url) as b:
        b.put("prefix/abc", rec)
        assert (
            b.stats()["bytes"]
            == stored_size(rec)
            == raw(redis_url).strlen("mlxcache:{0}v:prefix/abc")
        )


def test_contains_many_asks_a_batch_of_keys_per_command(redis_url):
    """A prefix lookup's probe asks up to a block's worth of keys: one script call per 512
    keys of a group, not one per key (packing those cost more than the server's answer)."""
    names = [f"probe/{i}" for i in range(1100)]
    with mlxcache.open_backend(redis_url) as b:
        b.put_many([(n, blob_record(8)) for n in names[::3]])
        r = raw(redis_url)
        r.config_resetstat()
        assert b.contains_many(names) == [i % 3 == 0 for i in range(1100)]
        b.touch_many(names[:700])
        assert r.info("commandstats")["cmdstat_evalsha"]["calls"] == 3 + 2
        assert b.contains_many(names[:2]) == [True, False]


def test_key_layout_keeps_user_and_internal_keys_apart(redis_url):
    b = mlxcache.open_backend(redis_url, chunk_size=1024)
    r = raw(redis_url)
    r.set("unrelated", b"keep me")
    names = ["a*b", "a[1]", "a?c", "abc", "b\\x", "ünï:cödé", "chunked"]
    for name in names:
        rec = blob_record(5000 if name == "chunked" else 10)
        b.put(name, rec)
    assert sorted(b.keys()) == sorted(names)
    assert sorted(b.keys("a*")) == ["a*b"]  # wildcards in the prefix are literal
    assert sorted(b.keys("a[")) == ["a[1]"]
    assert sorted(b.keys("a")) == ["a*b", "a?c", "a[1]", "abc"]
    assert list(b.keys("b\\")) == ["b\\x"]
    assert len(b) == len(names)
    layout = {k.decode() for k in r.scan_iter(match="mlxcache:*")}
    assert {"mlxcache:{0}i:lru", "mlxcache:{0}i:size", "mlxcache:{0}i:total"} <= layout
    assert any(k.startswith("mlxcache:{0}c:") for k in layout)
    assert "mlxcache:{0}v:a*b" in layout
    other = mlxcache.open_backend(redis_url, prefix="other:")
    other.put("x", blob_record(10))
    assert list(other.keys()) == ["x"] and "x" not in b
    b.clear()
    assert list(b.keys()) == [] and len(b) == 0 and b.stats()["bytes"] == 0
    # only the fleet counters stay: clear() deletes entries, never counts
    assert [k for k in r.scan_iter(match="mlxcache:*")] == [b"mlxcache:{0}f:counters"]
    assert r.get("unrelated") == b"keep me" and other.get("x") is not None


def test_delete_and_contains(redis_url):
    b = mlxcache.open_backend(redis_url, chunk_size=1024)
    b.put("small", blob_record(10))
    b.put("big", blob_record(5000))
    assert b.contains_many(["small", "big", "nope"]) == [True, True, False]
    assert "big" in b and "nope" not in b
    assert b.delete("big") and not b.delete("big")
    assert b.delete("small")
    assert len(b) == 0 and b.stats()["bytes"] == 0
    assert list(raw(redis_url).scan_iter(match="mlxcache:{0}c:*")) == []


def test_overwrite_counts_once_and_removes_old_chunks(redis_url):
    b = mlxcache.open_backend(redis_url, chunk_size=1024)
    r = raw(redis_url)
    big, small = blob_record(10_000, 1), blob_record(100, 2)
    b.put("k", big)
    assert len(list(r.scan_iter(match="mlxcache:{0}c:*"))) == 10
    b.put("k", big)  # a new generation replaces the old one
    assert len(list(r.scan_iter(match="mlxcache:{0}c:*"))) == 10
    assert b.stats()["bytes"] == stored_size(big) and len(b) == 1
    b.put("k", small)
    assert list(r.scan_iter(match="mlxcache:{0}c:*")) == []
    assert b.stats()["bytes"] == stored_size(small)
    assert_same(small, b.get("k"))


# ---------------------------------------------------------------- chunked values


def test_chunked_round_trip(redis_url):
    b = mlxcache.open_backend(redis_url, chunk_size="1KiB")
    rec = Record({"kv": mx.random.normal((5000,)).astype(mx.bfloat16)}, {"n": 5000})
    b.put("big", rec)
    value = raw(redis_url).get("mlxcache:{0}v:big")
    assert value.startswith(b"mlxcache-chunks:1\n") and len(value) < 200
    assert_same(rec, b.get("big"))
    assert_same(rec, b.get_many(["big"])[0])


@pytest.mark.parametrize("chunk_size", [7, 100, 1000])
def test_chunked_values_are_decoded_without_joining(redis_url, monkeypatch, chunk_size):
    """Header and tensors straddle chunk boundaries; nothing joins the whole value."""
    b = mlxcache.open_backend(redis_url, chunk_size=chunk_size)
    rec = sample_record()
    b.put("big", rec)
    assert raw(redis_url).get("mlxcache:{0}v:big").startswith(b"mlxcache-chunks:1\n")
    joined = []
    monkeypatch.setattr(st, "from_bytes", lambda blob: joined.append(blob))
    assert_same(rec, b.get("big"))
    assert_same(rec, b.get_many(["x", "big"])[1])
    assert joined == [] and b.stats()["errors"] == 0


def test_lost_chunk_is_a_miss_counted_and_dropped(redis_url, caplog):
    """A chunk evicted by Redis' maxmemory (or deleted by hand) must not leave a dead entry."""
    b = mlxcache.open_backend(redis_url, chunk_size=1024)
    r = raw(redis_url)
    b.put("big", blob_record(5000))
    b.put("other", blob_record(5000, 1))
    r.delete(sorted(r.scan_iter(match="mlxcache:{0}c:*"))[0])
    with caplog.at_level(logging.WARNING, logger="mlxcache"):
        hits = [x is not None for x in b.get_many(["big", "other"])]
    assert sum(hits) == 1 and b.stats()["errors"] == 1 and "missing" in caplog.text
    assert len(b) == 1 and len(list(b.keys())) == 1
    assert b.stats()["bytes"] == stored_size(blob_record(5000))
    survivor = -(-stored_size(blob_record(5000)) // 1024)  # the lost value's chunks are gone
    assert len(list(r.scan_iter(match="mlxcache:{0}c:*"))) == survivor


def test_corrupt_chunk_is_a_miss_and_dropped(redis_url):
    b = mlxcache.open_backend(redis_url, chunk_size=1024)
    r = raw(redis_url)
    b.put("big", blob_record(5000))
    chunk = sorted(r.scan_iter(match="mlxcache:{0}c:*"))[2]
    r.setrange(chunk, 10, b"\xff\x00")
    assert b.get("big") is None and b.stats()["errors"] == 1
    assert len(b) == 0 and list(r.scan_iter(match="mlxcache:*")) != []  # index keys only
    assert list(r.scan_iter(match="mlxcache:[vc]:*")) == []


def test_foreign_value_with_a_valid_checksum_is_a_miss(redis_url):
    """A bad shape behind a correct checksum (another writer) is a miss, never an exception."""
    import base64

    b = mlxcache.open_backend(redis_url)
    blob = st.to_bytes(Record({"x": mx.zeros((2,), dtype=mx.uint8)}, {}))
    (n,) = st.struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    header["x"]["shape"] = [-1, -2]
    meta = base64.b64decode(header["__metadata__"]["meta"])
    table = [st.TensorInfo("x", "U8", (-1, -2), 0, 2)]
    header["__metadata__"]["checksum"] = st._checksum(meta, table, iter([blob[-2:]]))
    text = json.dumps(header).encode()
    raw(redis_url).set("mlxcache:{0}v:f", st.struct.pack("<Q", len(text)) + text + blob[-2:])
    assert b.get("f") is None and b.stats()["errors"] == 1


def test_concurrent_reader_never_sees_a_mix(redis_url):
    b = mlxcache.open_backend(redis_url, chunk_size=1024)
    a_rec, b_rec = blob_record(10_000, 1), blob_record(10_000, 2)
    versions = {bits(a_rec.arrays["x"]), bits(b_rec.arrays["x"])}
    b.put("k", a_rec)
    stop = threading.Event()
    seen: list[bytes | None] = []
    failures: list[BaseException] = []
    writes = [0]

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # a thread's exception would otherwise be lost
                failures.append(exc)

        return threading.Thread(target=run)

    def writer():
        while not stop.is_set():
            b.put("k", (a_rec, b_rec)[writes[0] % 2])
            writes[0] += 1

    def reader():
        other = mlxcache.open_backend(redis_url, chunk_size=1024)
        for _ in range(150):
            got = other.get("k")
            seen.append(None if got is None else bits(got.arrays["x"]))

    threads = [guarded(writer)] + [guarded(reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    assert not failures, failures
    found = [s for s in seen if s is not None]
    assert writes[0] > 20 and len(seen) == 300
    assert len(found) > len(seen) // 2
    assert set(found) <= versions  # every hit is one whole version, never a mix
    assert b.stats()["errors"] == 0
    assert len(list(raw(redis_url).scan_iter(match="mlxcache:{0}c:*"))) == 10


def test_write_rejected_when_chunks_vanish(redis_url, caplog, monkeypatch):
    b = RedisBackend(redis_url, chunk_size=1024)
    real = b._script

    def lose_chunks(name, g, args, keys=None):
        if name == "commit":
            b.client.unlink(keys[-1])
        return real(name, g, args, keys)

    monkeypatch.setattr(b, "_script", lose_chunks)
    b.put("k", blob_record(3000))
    assert "k" not in b and b.stats()["errors"] == 1
    assert list(raw(redis_url).scan_iter(match="mlxcache:{0}c:*")) == []


# ---------------------------------------------------------------- batch


def test_batches_are_one_round_trip(redis_url, monkeypatch):
    b = mlxcache.open_backend(redis_url, chunk_size=1024)
    for i in range(5):
        b.put(f"k{i}", blob_record(100, i))
    b.put("big", blob_record(5000, 9))
    calls = {"pipeline": 0, "direct": 0}
    pipe_execute = redis.client.Pipeline.execute
    direct = redis.Redis.execute_command

    def counted_execute(self, *a, **kw):
        calls["pipeline"] += 1
        return pipe_execute(self, *a, **kw)

    def counted_direct(self, *a, **kw):
        calls["direct"] += 1
        return direct(self, *a, **kw)

    monkeypatch.setattr(redis.client.Pipeline, "execute", counted_execute)
    monkeypatch.setattr(redis.Redis, "execute_command", counted_direct)
    keys = [f"k{i}" for i in range(5)] + ["nope"]
    got = b.get_many(keys)
    assert calls == {"pipeline": 1, "direct": 0}
    assert [g is not None for g in got] == [True] * 5 + [False]
    assert_same(got[3], blob_record(100, 3))
    assert b.contains_many(keys + ["big"]) == [True] * 5 + [False, True]
    assert calls == {"pipeline": 2, "direct": 0}
    got = b.get_many(["k0", "big"])  # a chunked value costs one more round trip
    assert calls == {"pipeline": 4, "direct": 0}
    assert_same(got[1], blob_record(5000, 9))
    assert b.get_many([]) == [] and b.contains_many([]) == []


def test_get_refreshes_lru_order(redis_url):
    b = mlxcache.open_backend(redis_url)
    for k in ("a", "b", "c"):
        b.put(k, blob_record(10))
    b.get("a")
    order = [m.decode() for m in raw(redis_url).zrange("mlxcache:{0}i:lru", 0, -1)]
    assert order == ["b", "c", "a"]


# ---------------------------------------------------------------- TTL


def test_ttl_applies_to_values_and_chunks(redis_url):
    b = mlxcache.open_backend(redis_url + "?ttl=1&chunk_size=1KiB")
    r = raw(redis_url)
    b.put("small", blob_record(10))
    b.put("big", blob_record(5000))
    for key in r.scan_iter(match="mlxcache:[vc]:*"):
        assert 0 < r.pttl(key) <= 1000, key
    assert b.stats()["entries"] == 2
    time.sleep(1.5)
    assert b.get("small") is None and b.get("big") is None
    assert b.stats()["entries"] == 0 and b.stats()["bytes"] == 0  # expired members swept
    assert list(r.scan_iter(match="mlxcache:[vc]:*")) == []


def test_expired_entries_do_not_count_against_the_budget(redis_url):
    one = stored_size(blob_record(1000))
    short = mlxcache.open_backend(redis_url, ttl=0.3, max_bytes=2 * one)
    keep = mlxcache.open_backend(redis_url, max_bytes=2 * one)
    short.put("old1", blob_record(1000))
    keep.put("live", blob_record(1000))
    time.sleep(0.5)
    keep.put("new", blob_record(1000))  # old1 has expired: nothing live is evicted
    assert "live" in keep and "new" in keep
    assert keep.stats()["evictions"] == 0 and keep.stats()["bytes"] == 2 * one


# ---------------------------------------------------------------- budget


def test_budget_counts_each_key_once_and_evicts_lru(redis_url):
    one = stored_size(blob_record(1000))
    b = mlxcache.open_backend(redis_url, max_bytes=2 * one + 10)
    b.put("a", blob_record(1000))
    b.put("a", blob_record(1000))
    assert b.stats()["bytes"] == one
    b.put("b", blob_record(1000))
    assert b.get("a") is not None  # a becomes most recent
    b.put("c", blob_record(1000))  # evicts b
    assert "b" not in b and "a" in b and "c" in b
    s = b.stats()
    assert s["evictions"] == 1 and s["bytes"] == 2 * one and s["entries"] == 2


def test_eviction_removes_chunks_of_chunked_victims(redis_url):
    one = stored_size(blob_record(3000))
    b = mlxcache.open_backend(redis_url, chunk_size=1024, max_bytes=2 * one)
    for k in ("a", "b", "c"):
        b.put(k, blob_record(3000))
    assert "a" not in b and len(b) == 2
    assert len(list(raw(redis_url).scan_iter(match="mlxcache:{0}c:*"))) == 2 * -(-one // 1024)


# ---------------------------------------------------------------- bad data


def test_corrupt_value_is_a_miss_counted_logged_and_deleted(redis_url, caplog):
    b = mlxcache.open_backend(redis_url, chunk_size=1024)
    r = raw(redis_url)
    b.put("k", blob_record(100))
    blob = bytearray(r.get("mlxcache:{0}v:k"))
    blob[-1] ^= 1
    r.set("mlxcache:{0}v:k", bytes(blob))
    r.set("mlxcache:{0}v:garbage", b"not a record at all")
    r.set("mlxcache:{0}v:manifest", b"mlxcache-chunks:1\n{broken")
    with caplog.at_level(logging.WARNING, logger="mlxcache"):
        assert b.get_many(["k", "garbage", "manifest"]) == [None, None, None]
    assert b.stats()["errors"] == 3 and b.stats()["misses"] == 3
    assert "checksum" in caplog.text and "unreadable" in caplog.text
    assert r.exists("mlxcache:{0}v:k", "mlxcache:{0}v:garbage", "mlxcache:{0}v:manifest") == 0
    assert len(b) == 0 and b.stats()["bytes"] == 0


def test_newer_format_version_is_a_miss_and_kept(redis_url, caplog):
    b = mlxcache.open_backend(redis_url)
    r = raw(redis_url)
    blob = st.to_bytes(blob_record(10))
    from record_bytes import with_version

    r.set("mlxcache:{0}v:future", with_version(blob, 9))
    with caplog.at_level(logging.WARNING, logger="mlxcache"):
        assert b.get("future") is None
    assert "version 9" in caplog.text and r.exists("mlxcache:{0}v:future")


def test_index_drift_is_cleaned_lazily(redis_url):
    b = mlxcache.open_backend(redis_url)
    b.put("k", blob_record(10))
    raw(redis_url).delete("mlxcache:{0}v:k")  # as if Redis' maxmemory policy had evicted it
    assert len(b) == 1
    assert b.get("k") is None
    assert len(b) == 0 and b.stats()["bytes"] == 0


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "uri,match",
    [
        ("redis://127.0.0.1:1/0?ttl=abc", "ttl"),
        ("redis://127.0.0.1:1/0?ttl=0", "ttl"),
        ("redis://127.0.0.1:1/0?max_bytes=lots", "max_bytes"),
        ("redis://127.0.0.1:1/0?chunk_size=1GiB", "chunk_size"),
        ("redis://127.0.0.1:1/0?timeout=-1", "timeout"),
        ("redis://127.0.0.1:1/0?prefixx=a", "prefixx.*valid options.*prefix"),
        ("redis://127.0.0.1:1/0?prefix=", "prefix"),
        ("redis://127.0.0.1:1/zero", "database number"),
        ("redis://127.0.0.1:notaport/0", "port"),
        ("unix://", "socket path"),
        ("unix://host/x.sock", "socket path"),
    ],
)
def test_bad_uris_and_options_name_the_problem(uri, match):
    with pytest.raises(ValueError, match=match):
        mlxcache.open_backend(uri)


def test_rediss_uses_ssl_without_connecting():
    port = free_port()
    b = mlxcache.open_backend(f"rediss://alice:s3cret@127.0.0.1:{port}/2?ssl_cert_reqs=none")
    assert issubclass(b.pool.connection_class, redis.SSLConnection)  # with the call deadline
    kw = b.pool.connection_kwargs
    assert (kw["host"], kw["port"], kw["db"], kw["username"]) == ("127.0.0.1", port, 2, "alice")
    assert kw["password"] == "s3cret" and kw["socket_timeout"] == 5.0
    assert b.url == f"rediss://alice:***@127.0.0.1:{port}/2"


def test_timeout_option_reaches_the_pool():
    b = mlxcache.open_backend(f"redis://127.0.0.1:{free_port()}/0?timeout=0.25")
    kw = b.pool.connection_kwargs
    assert kw["socket_timeout"] == kw["socket_connect_timeout"] == 0.25


def test_unix_socket(redis_server, redis_url):
    rec = sample_record()
    tcp = mlxcache.open_backend(redis_url)
    unix = mlxcache.open_backend(redis_server.unix_url)
    assert issubclass(unix.pool.connection_class, redis.UnixDomainSocketConnection)
    unix.put("u", rec)
    assert_same(rec, tcp.get("u"))
    assert_same(rec, unix.get("u"))
    assert unix.stats()["url"] == f"unix://{redis_server.socket}"
    other_db = mlxcache.open_backend(redis_server.unix_url.replace("db=0", "db=3"))
    assert other_db.get("u") is None


# ---------------------------------------------------------------- failures


def test_unreachable_server_at_construction():
    port = free_port()
    b = mlxcache.open_backend(f"redis://user:pw@127.0.0.1:{port}/0?timeout=0.5")
    t0 = time.monotonic()
    b.put("k", blob_record(10))
    assert b.get("k") is None
    assert "k" not in b and list(b.keys()) == [] and len(b) == 0
    assert b.get_many(["a", "b"]) == [None, None] and b.contains_many(["a"]) == [False]
    assert b.delete("k") is False
    b.clear()
    s = b.stats()
    assert time.monotonic() - t0 < 2
    assert s["errors"] >= 1 and s["available"] is False and s["entries"] == 0
    assert "pw" not in s["url"] and s["url"] == f"redis://user:***@127.0.0.1:{port}/0"
    b.close()


def test_recovers_by_itself_when_redis_returns(caplog, monkeypatch):
    connects = [0]
    connect = redis.connection.AbstractConnection.connect

    def counted_connect(self, *a, **kw):
        connects[0] += 1
        return connect(self, *a, **kw)

    monkeypatch.setattr(redis.connection.AbstractConnection, "connect", counted_connect)
    with RedisServer() as server:
        b = mlxcache.open_backend(server.url + "?timeout=1&backoff=0.2&max_backoff=0.4")
        b.put("k", blob_record(10))
        assert b.get("k") is not None
        server.stop()
        connects[0] = 0
        with caplog.at_level(logging.WARNING, logger="mlxcache"):
            for _ in range(20):
                b.put("k2", blob_record(10))
                assert b.get("k") is None
                assert "k" not in b and len(b) == 0 and list(b.keys()) == []
                assert b.get_many(["k", "k2"]) == [None, None]
        assert connects[0] <= 4  # one failed call (plus its retry), then skipped during backoff
        assert "unreachable" in caplog.text
        assert b.stats()["errors"] > 0
        server.start()  # same port; the data (and the server's script cache) are gone
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            b.put("k", blob_record(10, 7))
            if b.get("k") is not None:
                break
            time.sleep(0.05)
        assert_same(b.get("k"), blob_record(10, 7))
        assert len(b) == 1 and b.stats()["available"] is True
        b.close()


def test_backoff_grows_and_resets(monkeypatch):
    port = free_port()
    b = RedisBackend(f"redis://127.0.0.1:{port}/0", timeout=0.5, backoff=0.1, max_backoff=0.4)
    delays = []
    for _ in range(5):
        b.breaker.down_until = 0.0  # let the call through to hit the dead port
        b.get("k")
        delays.append(b.breaker.delay)
    assert delays == [0.2, 0.4, 0.4, 0.4, 0.4]
    b.breaker.ok()
    assert b.breaker.delay == 0.1


# ---------------------------------------------------------------- other processes


def test_write_in_one_process_read_in_another(redis_url):
    rec = sample_record()
    b = mlxcache.open_backend(redis_url, chunk_size="4KiB")
    b.put("from-parent", rec)
    code = """
        import hashlib, sys
        import mlx.core as mx, mlxcache
        b = mlxcache.open_backend(sys.argv[1], chunk_size="4KiB")
        got = b.get("from-parent")
        h = hashlib.sha256()
        for name in sorted(got.arrays):
            a = got.arrays[name]
            h.update(f"{name}{a.dtype}{a.shape}".encode() + bytes(memoryview(mx.contiguous(a))))
        print(h.hexdigest())
        b.put("from-child", got)
    """
    out = run_py(code, redis_url).strip()
    h = hashlib.sha256()
    for name in sorted(rec.arrays):
        a = rec.arrays[name]
        h.update(f"{name}{a.dtype}{a.shape}".encode() + bits(a))
    assert out == h.hexdigest()
    assert_same(rec, b.get("from-child"))


def test_many_processes_share_one_budget(redis_url):
    max_bytes = 40_000
    code = """
        import hashlib, random, sys, time
        import mlx.core as mx, mlxcache, redis
        from mlxcache import Record

        def sha(a):
            return hashlib.sha256(bytes(memoryview(a))).hexdigest()

        url, seed, max_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        b = mlxcache.open_backend(url, max_bytes=max_bytes, chunk_size=2048)
        barrier = redis.Redis.from_url(url)
        barrier.incr("test:barrier")
        while int(barrier.get("test:barrier")) < 4:  # start together
            time.sleep(0.005)
        rng = random.Random(seed)
        hits = 0
        for i in range(150):
            key = mx.random.key(seed * 1000 + i)
            data = mx.random.randint(0, 256, (rng.randrange(500, 9000),), mx.uint8, key=key)
            b.put(f"k{rng.randrange(12)}", Record({"x": data}, {"sha": sha(data)}))
            got = b.get(f"k{rng.randrange(12)}")
            if got is not None:
                hits += 1
                assert sha(got.arrays["x"]) == got.meta["sha"]
        assert b.stats()["errors"] == 0, b.stats()
        print(hits, b.stats()["evictions"])
    """
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), redis_url, str(seed), str(max_bytes)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": ROOT},
        )  # fmt: skip
        for seed in range(4)
    ]
    counts = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        counts.append([int(x) for x in out.split()])
    assert all(hits > 0 and evictions > 0 for hits, evictions in counts), counts
    raw(redis_url).delete("test:barrier")
    b = mlxcache.open_backend(redis_url, max_bytes=max_bytes, chunk_size=2048)
    r = raw(redis_url)
    s = b.stats()
    sizes = {k.decode(): int(v) for k, v in r.hgetall("mlxcache:{0}i:size").items()}
    values = {k.decode()[len("mlxcache:{0}v:") :] for k in r.scan_iter(match="mlxcache:{0}v:*")}
    assert 0 < s["bytes"] <= max_bytes
    assert s["bytes"] == sum(sizes.values()) and set(sizes) == values
    assert {m.decode() for m in r.zrange("mlxcache:{0}i:lru", 0, -1)} == values
    chunk_keys = {k.decode() for k in r.scan_iter(match="mlxcache:{0}c:*")}
    expected = set()
    for info in r.hgetall("mlxcache:{0}i:chunks").values():
        gen, n = info.decode().split(":")
        expected |= {f"mlxcache:{{0}}c:{gen}:{i}" for i in range(int(n))}
    assert chunk_keys == expected  # no orphaned chunks
    for key in values:
        got = b.get(key)
        assert got is not None
        digest = hashlib.sha256(bytes(memoryview(got.arrays["x"]))).hexdigest()
        assert digest == got.meta["sha"]
    assert b.stats()["errors"] == 0
    json.dumps(s)  # stats are plain data


@pytest.mark.parametrize("chunk_size", ["256MiB", "7", "1KiB"])
def test_header_reads_no_tensor_data(redis_url, chunk_size):
    rec = sample_record()
    b = mlxcache.open_backend(f"{redis_url}?chunk_size={chunk_size}")
    b.put("k", rec)
    header = b.header("k")
    expected = st.parse_header(st.to_bytes(rec))
    assert header is not None
    assert (header.meta, header.tensors, header.checksum) == (
        expected.meta,
        expected.tensors,
        expected.checksum,
    )
    assert b.header("missing") is None and b.stats()["errors"] == 0
    raw(redis_url).set("mlxcache:{0}v:bad", b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    assert b.header("bad") is None and b.stats()["errors"] == 1


def test_opening_with_a_smaller_budget_evicts_lru_down_to_it(redis_url):
    b = mlxcache.open_backend(redis_url)
    for i in range(4):
        b.put(f"k{i}", blob_record(1000, seed=i))
    b.get("k0")  # k0 is now the most recently used
    size = stored_size(blob_record(1000))
    trimmed = mlxcache.open_backend(redis_url, max_bytes=2 * size)
    assert sorted(trimmed.keys()) == ["k0", "k3"]
    assert trimmed.stats()["bytes"] <= 2 * size and trimmed.stats()["evictions"] == 2
