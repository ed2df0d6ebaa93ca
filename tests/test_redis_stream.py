"""redis:// reads of large values, streamed into their arrays: bits, corruption, values that
change or vanish mid-read, a server killed mid-read (real redis-server, real MLX arrays)."""

from __future__ import annotations

import logging
import time

import mlx.core as mx
import pytest
import redis
from helpers import assert_same, blob_record, sample_record
from redis._parsers import _RESP2Parser

import mlxcache
from mlxcache import Record
from mlxcache.backends.redis import RedisBackend
from mlxcache.backends.redis import reads as redis_reads
from mlxcache.backends.redis import stream as redis_stream
from mlxcache.backends.redis.chunks import parse_manifest
from mlxcache.records import format as st
from mlxcache.records.signing import Signer

SLICE, WINDOW = 64, 3  # small slices and window, so small records cross every boundary


@pytest.fixture
def small_slices(monkeypatch):
    """Stream in slices of SLICE bytes, WINDOW in flight, after a FIRST_READ of SLICE bytes."""
    monkeypatch.setattr(redis_stream, "SLICE", SLICE)
    monkeypatch.setattr(redis_stream, "WINDOW", WINDOW)
    monkeypatch.setattr(redis_reads, "FIRST_READ", SLICE)


def raw(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def chunk_keys(url: str) -> list[bytes]:
    return list(raw(url).scan_iter(match="mlxcache:{0}c:*"))


def chunks_of(url: str, key: str) -> list[str]:
    """The chunk keys a stored value's manifest names, in order."""
    m = parse_manifest(raw(url).get(f"mlxcache:{{0}}v:{key}"))
    assert m is not None, "not a chunked value"
    return [f"mlxcache:{{0}}c:{m['gen']}:{i}" for i in range(m["n"])]


def during_stream(monkeypatch, after: int, action) -> list[int]:
    """Run ``action()`` once, after ``after`` slices of a streamed read have arrived."""
    real, seen = redis_stream.slices, [0]

    def hooked(*args):
        for piece in real(*args):
            seen[0] += 1
            if seen[0] == after:
                action()
            yield piece

    monkeypatch.setattr(redis_stream, "slices", hooked)
    return seen


def stored_size(record: Record) -> int:
    return len(st.to_bytes(record))


# ---------------------------------------------------------------- bits


@pytest.mark.parametrize("parser", [None, _RESP2Parser], ids=["default", "python-parser"])
@pytest.mark.parametrize("chunk_size", [None, 100, SLICE * WINDOW, 1000])
def test_round_trip_is_bit_exact_across_every_boundary(redis_url, small_slices, parser, chunk_size):
    """Sizes below, at and above a slice, a window and a chunk; header and tensors straddle."""
    kw = {"parser_class": parser} if parser else {}
    b = RedisBackend(redis_url, chunk_size=chunk_size or 2**20, **kw)
    records = {"sample": sample_record()}
    for n in (1, SLICE - 1, SLICE, SLICE + 1, SLICE * WINDOW, SLICE * WINDOW * 2 + 7, 5000):
        header = stored_size(blob_record(0, n))  # stored size n exactly, when n > the header
        records[f"n{n}"] = blob_record(max(0, n - header), n)
    for name, rec in records.items():
        b.put(name, rec)
    for name, rec in records.items():
        assert_same(rec, b.get(name))
    got = b.get_many([*records, "missing"])
    for rec, g in zip(records.values(), got, strict=False):
        assert_same(rec, g)
    assert got[-1] is None and b.stats()["errors"] == 0
    if chunk_size:
        assert raw(redis_url).get("mlxcache:{0}v:n5000").startswith(b"mlxcache-chunks:1\n")


def test_default_slices_round_trip_and_stream(redis_url, monkeypatch):
    """With the real slice size: a value over FIRST_READ is streamed, whole or chunked."""
    streamed = during_stream(monkeypatch, -1, lambda: None)
    b = RedisBackend(redis_url, chunk_size=2 * 2**20 + 5)
    small, large = blob_record(1000, 1), blob_record(5 * 2**20 + 3, 2)
    b.put("small", small)
    b.put("large", large)
    assert_same(small, b.get("small"))
    assert streamed[0] == 0  # read whole in the first round trip
    assert_same(large, b.get("large"))
    assert streamed[0] >= 5  # 5 MiB + header after the first 1 MiB, at most 1 MiB at a time
    with RedisBackend(redis_url) as whole:
        whole.put("one", large)
        assert_same(large, whole.get("one"))


def test_signed_records_stream_and_unsigned_ones_are_rejected_unread(
    redis_url, small_slices, monkeypatch
):
    signer = Signer("stream-test-secret-0123456789")
    b = RedisBackend(redis_url, signer=signer, chunk_size=1000)
    rec = blob_record(4000, 3)
    b.put("k", rec)
    assert_same(rec, b.get("k"))
    RedisBackend(redis_url, chunk_size=1000).put("plain", rec)
    streamed = during_stream(monkeypatch, -1, lambda: None)
    assert b.get("plain") is None and b.stats()["rejected"] == 1
    assert 0 < streamed[0] < stored_size(rec) // SLICE // 4  # refused from its header
    b.put("k", rec)
    raw(redis_url).setrange(chunks_of(redis_url, "k")[2], 5, b"\x00\xff\x00")
    assert b.get("k") is None and b.stats()["errors"] == 1 and "k" not in b


# ---------------------------------------------------------------- corruption


@pytest.mark.parametrize("where", ["middle", "last"])
@pytest.mark.parametrize("chunked", [True, False])
def test_corrupt_slice_is_a_miss_logged_and_dropped(
    redis_url, small_slices, caplog, where, chunked
):
    b = RedisBackend(redis_url, chunk_size=700 if chunked else 2**20)
    rec = blob_record(5000, 4)
    b.put("k", rec)
    b.put("other", blob_record(3000, 5))
    r, size = raw(redis_url), stored_size(rec)
    at = size // 2 if where == "middle" else size - 3
    if chunked:
        key, offset = chunks_of(redis_url, "k")[at // 700], at % 700
    else:
        key, offset = "mlxcache:{0}v:k", at
    old = r.getrange(key, offset, offset)
    r.setrange(key, offset, bytes([old[0] ^ 0xFF]))
    with caplog.at_level(logging.WARNING, logger="mlxcache"):
        assert b.get("k") is None
    assert "checksum mismatch" in caplog.text and "'k'" in caplog.text
    assert b.stats()["errors"] == 1 and "k" not in b and len(b) == 1
    assert_same(blob_record(3000, 5), b.get("other"))  # the connection is still in step


# ---------------------------------------------------------------- changes mid-read


def test_chunk_evicted_mid_read_is_a_miss_and_dropped(redis_url, small_slices, monkeypatch, caplog):
    b = RedisBackend(redis_url, chunk_size=1000)
    b.put("k", blob_record(8000, 6))
    b.put("other", blob_record(500, 7))
    last = chunks_of(redis_url, "k")[-1]
    during_stream(monkeypatch, 4, lambda: raw(redis_url).delete(last))
    with caplog.at_level(logging.WARNING, logger="mlxcache"):
        assert b.get("k") is None
    assert "missing" in caplog.text and b.stats()["errors"] == 1
    assert "k" not in b and b.stats()["bytes"] == stored_size(blob_record(500, 7))
    assert chunk_keys(redis_url) == []  # the lost value's other chunks went with it
    assert_same(blob_record(500, 7), b.get("other"))


@pytest.mark.parametrize("chunked", [True, False])
def test_value_replaced_mid_read_is_read_again_never_mixed(
    redis_url, small_slices, monkeypatch, chunked
):
    b = RedisBackend(redis_url, chunk_size=1000 if chunked else 2**20)
    first, second = blob_record(6000, 8), blob_record(6000, 9)
    b.put("k", first)
    writer = RedisBackend(redis_url, chunk_size=1000 if chunked else 2**20)
    during_stream(monkeypatch, 3, lambda: writer.put("k", second))
    assert_same(second, b.get("k"))  # the old chunks vanished, or the checksum failed: again
    assert b.stats()["errors"] == 0 and "k" in b
    assert_same(second, b.get("k"))


def test_value_deleted_mid_read_is_a_plain_miss(redis_url, small_slices, monkeypatch):
    b = RedisBackend(redis_url)
    b.put("k", blob_record(6000, 10))
    during_stream(monkeypatch, 2, lambda: RedisBackend(redis_url).delete("k"))
    assert b.get("k") is None
    assert b.stats()["errors"] == 0 and len(b) == 0


def test_server_killed_mid_read_is_a_miss(redis_server, redis_url, small_slices, monkeypatch):
    b = RedisBackend(redis_url, chunk_size=1000, timeout=2, backoff=0.01, max_backoff=0.01)
    rec = blob_record(9000, 11)
    b.put("k", rec)

    def kill():
        redis_server.proc.kill()
        redis_server.proc.wait()

    during_stream(monkeypatch, 2, kill)
    assert b.get("k") is None and b.get_many(["k", "x"]) == [None, None]
    assert b.stats()["errors"] >= 1 and b.last_error
    redis_server.start()  # empty again: a plain miss, no error, the pool reconnects
    monkeypatch.undo()
    time.sleep(2 * b.max_backoff)  # calls are skipped until the backoff ends (a fast restart)
    b.put("k", rec)
    assert_same(rec, b.get("k"))


def test_empty_value_is_unreadable_and_dropped(redis_url):
    b = RedisBackend(redis_url)
    b.put("k", Record({"x": mx.zeros((3,))}, {}))
    raw(redis_url).set("mlxcache:{0}v:k", b"")
    assert b.get("k") is None and b.stats()["errors"] == 1 and "k" not in b


def test_streams_over_tls(monkeypatch):
    """rediss://: the slices come through the TLS socket like any reply (a signed record)."""
    from tls_redis import TLSRedis

    monkeypatch.setenv("MLXCACHE_SECRET", "tls-stream-secret-0123456789")
    server = TLSRedis()
    try:
        streamed = during_stream(monkeypatch, -1, lambda: None)
        rec = blob_record(3 * 2**20 + 11, 12)
        for uri in (server.uri(), server.uri() + "&chunk_size=1MiB"):
            with mlxcache.open_backend(uri) as b:
                b.put("tls", rec)
                assert_same(rec, b.get("tls"))
                assert b.stats()["errors"] == 0
        assert streamed[0] >= 4
    finally:
        server.close()


@pytest.mark.parametrize("chunked", [True, False])
def test_streamed_reads_under_concurrent_rewrites_are_never_mixed(redis_url, small_slices, chunked):
    """A writer replaces the value in a loop: every hit is one whole version, none is dropped."""
    import threading

    from helpers import bits

    size = 1000 if chunked else 2**20
    b, writer = RedisBackend(redis_url, chunk_size=size), RedisBackend(redis_url, chunk_size=size)
    versions = [blob_record(2000, 20), blob_record(2000, 21)]
    b.put("k", versions[0])
    stop, failures, writes = threading.Event(), [], [0]

    def write():
        try:
            while not stop.wait(0.005):  # a pause: some reads must finish between writes
                writer.put("k", versions[writes[0] % 2])
                writes[0] += 1
        except BaseException as exc:  # a thread's exception would otherwise be lost
            failures.append(exc)

    thread = threading.Thread(target=write)
    thread.start()
    try:
        got = [b.get("k") for _ in range(100)]
    finally:
        stop.set()
        thread.join()
    assert not failures and writes[0] > 10
    found = {bits(g.arrays["x"]) for g in got if g is not None}
    assert found and found <= {bits(v.arrays["x"]) for v in versions}
    assert b.stats()["errors"] == 0 and "k" in b


def test_prefix_walk_streams_large_blocks(redis_url, monkeypatch):
    """PrefixCache on one server (one walk_chain script): blocks over 1 MiB are streamed."""
    from helpers import bits
    from mlx_lm.models.cache import KVCache

    from mlxcache import PrefixCache

    caches = []
    for layer in range(2):
        c = KVCache()
        x = mx.random.normal((1, 8, 40, 1024), key=mx.random.key(layer))  # 2.5 MiB per block
        c.update_and_fetch(x, -x)
        caches.append(c)
    ids = list(range(1, 41))
    streamed = during_stream(monkeypatch, -1, lambda: None)
    with PrefixCache(redis_url, model="m", block_size=16, hot_bytes=0) as pc:
        assert pc.backend._can_walk()
        pc.store(ids, caches)
        hit = pc.lookup(ids)
        assert hit is not None and hit.num_tokens == 40
        for got, want in zip(hit.prompt_cache, caches, strict=True):
            for x in ("keys", "values"):
                a, b = getattr(got, x), getattr(want, x)
                assert bits(a[..., : got.offset, :]) == bits(b[..., : want.offset, :])
        assert streamed[0] > 0 and pc.backend.stats()["errors"] == 0
