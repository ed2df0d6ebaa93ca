"""Crafted stored values through every public call: backends, PrefixCache and the vllm-mlx
managers never raise for what they read (hypothesis; ``--fuzz-long`` for more examples).

A file entry is crafted as its file's bytes or its index row, a Redis one as a raw SET of the
value, its chunks or the index values; the managers are fed crafted Records (any shape, dtype
and metadata) under their own keys in a memory backend, and crafted bytes through Redis.
"""

from __future__ import annotations

import sqlite3

import mlx.core as mx
import pytest
import redis
from helpers import assert_same, full_kv, sample_record
from hypothesis import given
from hypothesis import strategies as s
from test_fuzz_decoders import BLOBS, edited_header, is_plain, msgpack_values, mutated_bytes

import mlxcache
from mlxcache import PrefixCache, Record
from mlxcache.backends.disk import DiskBackend
from mlxcache.backends.memory import MemoryBackend
from mlxcache.backends.redis.chunks import MANIFEST_MAGIC
from mlxcache.mllm_cache import MLLMPrefixCacheManager
from mlxcache.vision_embedding_cache import VisionEmbeddingCache

GOOD = sample_record()
crafted_value = (
    s.binary(max_size=64) | mutated_bytes() | edited_header() | s.sampled_from(BLOBS)
).map(bytes)


# ---------------------------------------------------------------- file://


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzzdisk")
    b = DiskBackend(root)
    b.put("good", GOOD)
    outside = root.parent / "outside.txt"
    outside.write_text("not the cache's")
    yield b, root, outside
    b.close()


def _file_of(root, key):
    with sqlite3.connect(root / "index.sqlite") as db:
        row = db.execute("SELECT file FROM entries WHERE key = ?", (key,)).fetchone()
    return None if row is None else root / "data" / row[0]


@given(crafted_value)
def test_file_entry_with_crafted_bytes(disk, blob):
    b, root, _ = disk
    if _file_of(root, "k") is None:
        b.put("k", Record({"x": mx.zeros(4)}, {}))
    _file_of(root, "k").write_bytes(blob)
    good, k = b.get_many(["good", "k"])
    assert_same(good, GOOD)
    assert k is None or isinstance(k, Record)
    if k is None:  # unreadable: unindexed (quarantined), never an error on every later get
        assert "k" not in b or b.get("k") is not None


index_cell = (
    s.text(max_size=20)
    | s.binary(max_size=20)
    | s.integers(-(2**63), 2**63 - 1)
    | s.floats(allow_nan=False)  # NaN is SQL NULL: the schema refuses it
    | s.sampled_from(["../outside.txt", "../../outside.txt", "/etc/hostname", "ab/../../x"])
)


@given(index_cell, index_cell, s.sampled_from(["get", "delete", "put", "trim", "clear"]))
def test_file_index_rows_with_crafted_cells(disk, file, size, op):
    b, root, outside = disk
    if "good" not in b:  # a crafted total can make an earlier trim evict it: that is allowed
        b.put("good", GOOD)
    with sqlite3.connect(root / "index.sqlite") as db:
        db.execute(
            "INSERT OR REPLACE INTO entries (key, file, size, access_time, store_time) "
            "VALUES ('k', ?, ?, 0, 0)",
            (file, size if isinstance(size, int) else 0),
        )
        db.execute(
            "INSERT OR REPLACE INTO entries (key, file, size, access_time, store_time) "
            "VALUES (?, 'x', 1, 0, 0)",
            (b"\xff\xfe",),
        )
        db.execute("UPDATE settings SET value = ? WHERE key = 'size'", (size,))
    got = b.get_many(["k", "good"])
    assert got[0] is None and got[1] is not None  # one bad row never spoils the batch
    if op == "delete":
        b.delete("k")
    elif op == "put":
        b.put("k", Record({"x": mx.zeros(2)}, {}))
    elif op == "trim":
        b.trim(10**12)
    elif op == "clear":
        b.clear()
        b.put("good", GOOD)
    len(b), b.stats(), list(b.keys()), "k" in b
    assert outside.read_text() == "not the cache's"  # nothing outside data/ is touched
    with sqlite3.connect(root / "index.sqlite") as db:
        db.execute("DELETE FROM entries WHERE typeof(key) = 'blob'")


# ---------------------------------------------------------------- redis://

manifest = s.fixed_dictionaries(
    {"gen": s.sampled_from(["0" * 32, "f" * 32, "x"]), "n": s.integers(-2, 5)},
    optional={"size": s.integers(-5, 10**6) | s.floats()},
).map(lambda m: MANIFEST_MAGIC + repr(m).replace("'", '"').encode())


@given(
    crafted_value | manifest,
    s.lists(s.binary(max_size=40) | s.sampled_from(BLOBS), max_size=3),
    s.sampled_from(["size", "chunks", "total", "clock", "lru"]),
    s.binary(max_size=12) | s.sampled_from([b"-5", b"1e308", b"99999999999999999999", b"0"]),
)
def test_redis_values_chunks_and_index_values(redis_url, value, chunks, field, index_value):
    with redis.Redis.from_url(redis_url) as r, mlxcache.open_backend(redis_url, chunk_size=64) as b:
        _crafted_redis_values(r, b, value, chunks, field, index_value)


def _crafted_redis_values(r, b, value, chunks, field, index_value) -> None:
    if not r.exists("mlxcache:{0}v:good"):
        b.put("good", GOOD)
    r.set("mlxcache:{0}v:k", value)
    for i, c in enumerate(chunks):
        for gen in ("0" * 32, "f" * 32):
            r.set(f"mlxcache:{{0}}c:{gen}:{i}", c)
    where = {"size": "i:size", "chunks": "i:chunks", "lru": "i:lru"}.get(field)
    if field in ("total", "clock"):
        r.set(f"mlxcache:{{0}}i:{field}", index_value)
    elif where == "i:lru":
        r.delete("mlxcache:{0}i:lru")
        r.set("mlxcache:{0}i:lru", index_value)  # even the wrong Redis type
    else:
        r.hset(f"mlxcache:{{0}}{where}", "k", index_value)
    good, k = b.get_many(["good", "k"])
    assert k is None or isinstance(k, Record)
    if field != "lru":
        assert_same(good, GOOD)
    b.put("p", Record({"x": mx.zeros(3)}, {}))
    b.delete("k"), len(b), b.stats(), list(b.keys()), b.header("good"), b.trim(10**12)
    r.delete("mlxcache:{0}i:lru")


# ---------------------------------------------------------------- the managers


def _mutate_meta(meta: dict, draw) -> dict:
    """A copy of ``meta`` with one field, at any depth, replaced by any plain value."""
    import copy

    from test_fuzz_decoders import _paths, _set

    meta = copy.deepcopy(dict(meta))
    paths = list(_paths(meta))[1:]
    if not paths:
        return {"x": draw(msgpack_values.filter(is_plain))}
    value = draw(msgpack_values.filter(is_plain))
    return _set(meta, draw(s.sampled_from(paths)), value)


def _mutate_arrays(arrays: dict, draw) -> dict:
    arrays = dict(arrays)
    if arrays and draw(s.booleans()):
        name = draw(s.sampled_from(sorted(arrays)))
        how = draw(s.sampled_from(["drop", "reshape", "dtype", "scalar"]))
        a = arrays[name]
        if how == "drop":
            del arrays[name]
        elif how == "reshape":
            arrays[name] = a.reshape(-1)
        elif how == "dtype":
            arrays[name] = a.astype(draw(s.sampled_from([mx.int8, mx.bool_, mx.float16])))
        else:
            arrays[name] = mx.array(3)
    if draw(s.booleans()):
        arrays["extra"] = mx.zeros((2, 2))
    return arrays


@s.composite
def crafted_record(draw, rec: Record) -> Record:
    meta = _mutate_meta(rec.meta, draw) if draw(s.booleans()) else dict(rec.meta)
    return Record(_mutate_arrays(rec.arrays, draw), meta)


def _stored(backend) -> dict[str, Record]:
    return {k: backend.get(k) for k in backend.keys()}


@pytest.fixture(scope="module")
def prefix_store():
    backend = MemoryBackend()
    pc = PrefixCache(backend, model="m", block_size=4)
    pc.store(list(range(10)), full_kv(10), extras={"rope_deltas": mx.array([1])})
    return pc, backend, _stored(backend)


@given(s.data())
def test_prefix_cache_lookup_of_crafted_records(prefix_store, data):
    pc, backend, legit = prefix_store
    keys = data.draw(s.lists(s.sampled_from(sorted(legit)), min_size=1, max_size=3, unique=True))
    for key in keys:
        backend.put(key, data.draw(crafted_record(legit[key])))
    for require in (False, True):
        hit = pc.lookup(list(range(10)), require_extras=require)
        assert hit is None or 0 <= hit.num_tokens <= 10
    for key in keys:
        backend.put(key, legit[key])


@pytest.fixture(scope="module")
def manager_store(tmp_path_factory):
    from PIL import Image

    img = tmp_path_factory.mktemp("img") / "a.png"
    Image.new("RGB", (4, 4), (1, 2, 3)).save(img)
    backend = MemoryBackend()
    m = MLLMPrefixCacheManager(backend=backend)
    m.store([str(img)], "p", mx.ones((1, 4)), full_kv(6), list(range(6)))
    v = VisionEmbeddingCache(backend=backend)
    v.set_pixel_cache([str(img)], "p", mx.ones((1, 3, 4, 4)), mx.array([[1, 2]]))
    v.set_encoding_cache([str(img)], "p", mx.ones((1, 5)), 3, mx.ones((1, 5)))
    return [str(img)], backend, _stored(backend)


@given(s.data())
def test_vllm_mlx_managers_on_crafted_records(manager_store, data):
    img, backend, legit = manager_store
    keys = data.draw(s.lists(s.sampled_from(sorted(legit)), min_size=1, max_size=3, unique=True))
    for key in keys:
        backend.put(key, data.draw(crafted_record(legit[key])))
    m = MLLMPrefixCacheManager(backend=backend)  # the warm start reads the index records
    m.fetch(img, "p"), m.fetch(img, "p", list(range(8))), m.fetch(img, "q", [0, 1])
    m.get_stats(), len(m)
    v = VisionEmbeddingCache(backend=backend)
    v.get_pixel_cache(img, "p"), v.get_encoding_cache(img, "p"), v.get_pixel_values(img)
    for key in keys:
        backend.put(key, legit[key])


@given(s.data())
def test_managers_through_redis_on_crafted_bytes(redis_url, data):
    with redis.Redis.from_url(redis_url) as r, mlxcache.open_backend(redis_url) as backend:
        _managers_on_crafted_bytes(r, backend, data)


def _managers_on_crafted_bytes(r, backend, data) -> None:
    pc = PrefixCache(backend, model="m", block_size=4)
    pc.store(list(range(10)), full_kv(10))  # writes back whatever an earlier example dropped
    MLLMPrefixCacheManager(backend=backend).store(["x"], "p", None, full_kv(3), [1, 2, 3])
    keys = sorted(k.decode()[len("mlxcache:{0}v:") :] for k in r.scan_iter("mlxcache:{0}v:*"))
    victim = data.draw(s.sampled_from(keys))
    r.set("mlxcache:{0}v:" + victim, data.draw(crafted_value))
    hit = pc.lookup(list(range(10)))
    assert hit is None or 0 <= hit.num_tokens <= 10
    m = MLLMPrefixCacheManager(backend=backend)
    entry, n = m.fetch(["x"], "p", [1, 2, 3])
    assert (entry is None) == (n == 0) and 0 <= n <= 3


def test_an_undecodable_index_row_no_longer_spoils_its_batch(tmp_path):
    """Regression: a row whose text is not UTF-8 made SQLite's fetch raise, so every get_many
    batch containing that key missed, forever; now that row alone is unindexed."""
    b = DiskBackend(tmp_path)
    b.put("good", GOOD)
    b.put("k", GOOD)
    with sqlite3.connect(tmp_path / "index.sqlite") as db:
        db.execute("UPDATE entries SET file = CAST(x'fffe41' AS TEXT) WHERE key = 'k'")
        db.execute(
            "INSERT INTO entries (key, file, size, access_time, store_time) "
            "VALUES (CAST(x'ff' AS TEXT), 'x', 1, 0, 0)"
        )
    good, k = b.get_many(["good", "k"])
    assert_same(good, GOOD)
    assert k is None
    assert "k" not in b and sorted(b.keys()) == ["good"] and b.stats()["errors"] == 1
    assert b.get_many(["good", "k"])[0] is not None  # and it stays fixed
