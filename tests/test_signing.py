"""Signed records: a MAC bound to the cache key, secret rotation, and a writer without the
secret that forges and replays records into a shared Redis and a shared folder."""

from __future__ import annotations

import json
import os
import sqlite3

import mlx.core as mx
import pytest
from helpers import assert_same, bits, full_kv, run_py, sample_record

import mlxcache
from mlxcache import PrefixCache, Record, UntrustedRecordError
from mlxcache.cli import main as cli_main
from mlxcache.mllm_cache import MLLMPrefixCacheManager
from mlxcache.records import format as st
from mlxcache.records import reader as format_read
from mlxcache.records.signing import Signer, from_env
from mlxcache.vision_embedding_cache import VisionEmbeddingCache

SECRET = "s3cret-for-tests-only-0123456789"
OLD = "an-older-secret-still-accepted-42"
VAR = "MLXCACHE_TEST_SECRET"


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv(VAR, SECRET)
    monkeypatch.delenv(VAR + "_OLD", raising=False)
    monkeypatch.delenv("MLXCACHE_SECRET", raising=False)
    monkeypatch.delenv("MLXCACHE_SECRET_OLD", raising=False)
    return SECRET


@pytest.fixture(params=["redis", "file"])
def shared(request, tmp_path, secret):
    """(signed URI, unsigned URI) of one shared store: a real Redis or a folder."""
    if request.param == "redis":
        base = request.getfixturevalue("redis_url")
    else:
        base = f"file://{tmp_path / 'shared'}"
    return f"{base}?secret_env={VAR}", base


# ---------------------------------------------------------------- the format layer


def test_mac_binds_the_key_and_the_secret():
    rec, signer = sample_record(), Signer(SECRET)
    blob = st.to_bytes(rec, key="ns1/x", signer=signer)
    assert_same(rec, st.from_bytes(blob, key="ns1/x", signer=signer))
    assert st.from_bytes(blob).meta == rec.meta  # readers without a secret still check xxh3
    with pytest.raises(UntrustedRecordError, match="MAC mismatch"):
        st.from_bytes(blob, key="ns2/x", signer=signer)  # replayed under another key
    with pytest.raises(UntrustedRecordError, match="not accepted"):
        st.from_bytes(blob, key="ns1/x", signer=Signer("another-secret-of-16+chars"))
    with pytest.raises(UntrustedRecordError, match="unsigned"):
        st.from_bytes(st.to_bytes(rec), key="ns1/x", signer=signer)


def test_forged_data_with_a_fresh_checksum_is_rejected_and_corruption_named():
    from record_bytes import split

    signer = Signer(SECRET)
    blob = st.to_bytes(Record({"x": mx.arange(8, dtype=mx.int32)}, {}), key="k", signer=signer)
    header, data = split(blob)
    # the forger re-checksums modified data (the checksum is public), keeping the old MAC
    poisoned = mx.full((8,), 666, dtype=mx.int32)
    forged = st.to_bytes(Record({"x": poisoned}, {}))
    fheader, fdata = split(forged)
    fheader["__metadata__"]["mac"] = header["__metadata__"]["mac"]
    from record_bytes import join

    with pytest.raises(UntrustedRecordError, match="MAC mismatch"):
        st.from_bytes(join(fheader, fdata), key="k", signer=signer)
    flipped = bytearray(blob)
    flipped[-1] ^= 1
    with pytest.raises(st.FormatError, match="checksum") as err:
        st.from_bytes(bytes(flipped), key="k", signer=signer)
    assert not isinstance(err.value, UntrustedRecordError)
    assert data != fdata


def test_signed_file_round_trip_through_read_file(tmp_path):
    signer = Signer(SECRET)
    path = tmp_path / "r.safetensors"
    rec = sample_record()
    path.write_bytes(st.to_bytes(rec, key="k", signer=signer))
    assert_same(rec, format_read.read_file(path, key="k", signer=signer))
    with pytest.raises(UntrustedRecordError):
        format_read.read_file(path, key="other", signer=signer)


def test_rotation_old_secrets_verify_new_writes_use_the_current_one(monkeypatch):
    monkeypatch.setenv(VAR, OLD)
    before = from_env(VAR)
    blob = st.to_bytes(sample_record(), key="k", signer=before)
    monkeypatch.setenv(VAR, SECRET)
    monkeypatch.setenv(VAR + "_OLD", f" {OLD} , another-old-secret-123456 ")
    after = from_env(VAR)
    assert len(after.accepted) == 3 and after.key_id != before.key_id
    st.from_bytes(blob, key="k", signer=after)  # the old secret still verifies
    new = st.to_bytes(sample_record(), key="k", signer=after)
    with pytest.raises(UntrustedRecordError, match="not accepted"):
        st.from_bytes(new, key="k", signer=before)  # readers not yet rotated reject it
    monkeypatch.delenv(VAR + "_OLD")
    with pytest.raises(UntrustedRecordError, match="not accepted"):
        st.from_bytes(blob, key="k", signer=from_env(VAR))  # old secret dropped: rejected


def test_secrets_are_never_shown_and_must_be_long(monkeypatch):
    signer = Signer(SECRET, [OLD])
    assert SECRET not in repr(signer) and OLD not in str(signer)
    with pytest.raises(ValueError, match="too short") as err:
        Signer("short")
    assert "short" not in str(err.value).replace("too short", "")
    monkeypatch.delenv("MLXCACHE_NOT_SET", raising=False)
    with pytest.raises(ValueError, match="MLXCACHE_NOT_SET"):
        mlxcache.open_backend("memory://?secret_env=MLXCACHE_NOT_SET")
    monkeypatch.setenv("MLXCACHE_TOO_SHORT", "abc")
    with pytest.raises(ValueError, match="too short") as err:
        mlxcache.open_backend("file:///tmp/x?secret_env=MLXCACHE_TOO_SHORT")
    assert "abc" not in str(err.value)


# ---------------------------------------------------------------- backends


def test_default_secret_variable_signs_every_persistent_backend(tmp_path, redis_url, monkeypatch):
    monkeypatch.setenv("MLXCACHE_SECRET", SECRET)
    for uri in (redis_url, f"file://{tmp_path}"):
        b = mlxcache.open_backend(uri)
        assert b.signer is not None and b.signer.key_id == Signer(SECRET).key_id
        assert b.stats()["signed_by"] == b.signer.key_id and SECRET not in str(b.stats())
        b.put("k", sample_record())
        assert_same(sample_record(), b.get("k"))
        b.close()
    monkeypatch.delenv("MLXCACHE_SECRET")
    b = mlxcache.open_backend(f"file://{tmp_path}")
    assert b.signer is None
    assert b.get("k") is not None  # a reader without the secret still reads (checksum only)


def test_unsigned_records_are_rejected_counted_and_removed(shared):
    signed_uri, plain_uri = shared
    plain = mlxcache.open_backend(plain_uri)
    plain.put("old", sample_record())  # written before the secret was configured
    signed = mlxcache.open_backend(signed_uri)
    assert signed.get("old") is None
    stats = signed.stats()
    assert stats["rejected"] == 1 and stats["errors"] == 0
    assert "old" not in signed and "unsigned" in signed.last_error
    signed.put("new", sample_record())
    assert_same(sample_record(), signed.get("new"))
    assert signed.stats()["rejected"] == 1


# ---------------------------------------------------------------- the attack

ATTACKER = r"""
import json, os, sqlite3, sys
import mlx.core as mx
import redis
import mlxcache
from mlxcache import PrefixCache, Record
from mlxcache.records import format as st
from record_bytes import join, split
from helpers import full_kv

assert not any(v for k, v in os.environ.items() if "SECRET" in k), "no secret here"
kind, base = sys.argv[1], sys.argv[2]
plain = mlxcache.open_backend(base)  # no secret: reads checksums only, writes unsigned

if kind == "redis":
    r = redis.Redis.from_url(base)
    def raw_keys():
        return sorted(k.decode()[len("mlxcache:{0}v:"):] for k in r.scan_iter("mlxcache:{0}v:*"))
    def raw_get(key):
        return r.get("mlxcache:{0}v:" + key)
    def raw_set(key, blob):
        r.set("mlxcache:{0}v:" + key, blob)  # a plain SET: no index entry needed to be read
else:
    root = base[len("file://"):]
    def rows():
        with sqlite3.connect(os.path.join(root, "index.sqlite")) as db:
            return dict(db.execute("SELECT key, file FROM entries"))
    def raw_keys():
        return sorted(rows())
    def raw_get(key):
        with open(os.path.join(root, "data", rows()[key]), "rb") as f:
            return f.read()
    def raw_set(key, blob):
        if key not in rows():
            plain.put(key, Record({}, {}))  # a row and a file of our own, then its bytes
        path = os.path.join(root, "data", rows()[key])
        with open(path + ".new", "wb") as f:
            f.write(blob)
        os.replace(path + ".new", path)

def poisoned(blob):
    rec = st.from_bytes(blob)  # the checksum is public: anyone can decode and re-encode
    arrays = {n: mx.full(a.shape, 66, dtype=a.dtype) for n, a in rec.arrays.items()}
    return Record(arrays, {**rec.meta, "forged": True})  # a checked field could be changed too

legit = {k: raw_get(k) for k in raw_keys()}
# tenant B's keys for the same prompt, then tenant A's signed records replayed onto them
PrefixCache(plain, model="m", salt="B", block_size=4).store(list(range(10)), full_kv(10))
def slot(blob):
    m = st.from_bytes(blob).meta
    return (m.get("kind"), m.get("start"), m.get("length"))
by_slot = {slot(b): b for k, b in legit.items() if "/" in k and k.startswith("mlxcache/")}
replayed = 0
for key in raw_keys():
    if key not in legit and slot(raw_get(key)) in by_slot:
        raw_set(key, by_slot[slot(raw_get(key))])
        replayed += 1
raw_set("ns2/x", legit["ns1/x"])  # the same record under another namespace
# every legitimate record is replaced by a poisoned one: unsigned, or keeping the old MAC
for i, (key, blob) in enumerate(sorted(legit.items())):
    forged = st.to_bytes(poisoned(blob))
    if i % 2:
        h, data = split(forged)
        h["__metadata__"]["mac"] = split(blob)[0]["__metadata__"]["mac"]
        forged = join(h, data)
    raw_set(key, forged)
# a reader without the secret is poisoned: the attack is real
got = mlxcache.open_backend(base).get("ns1/x")
assert got is not None and got.arrays["t3"].tolist() == [[66] * 5] * 3
print(json.dumps({"forged": len(legit), "replayed": replayed}))
"""


def test_writer_without_the_secret_never_gets_served(shared, images_dir):
    signed_uri, plain_uri = shared
    kind = "redis" if plain_uri.startswith("redis") else "file"
    tokens = list(range(10))
    img = [str(images_dir)]
    # legitimate writers, with the secret
    pc_a = PrefixCache(signed_uri, model="m", salt="A", block_size=4)
    pc_a.store(tokens, full_kv(10))
    raw = mlxcache.open_backend(signed_uri)
    raw.put("ns1/x", sample_record())
    mllm = MLLMPrefixCacheManager(backend=signed_uri)
    mllm.store(img, "describe", None, full_kv(6), list(range(6)))
    vision = VisionEmbeddingCache(backend=signed_uri)
    vision.set_pixel_cache(img, "describe", mx.ones((1, 3, 4, 4)), mx.array([[1, 2, 3]]))
    # control: with the secret, everything is served before the attack
    assert pc_a.lookup(tokens).num_tokens == 10
    assert MLLMPrefixCacheManager(backend=signed_uri).fetch(img, "describe")[0] is not None
    assert VisionEmbeddingCache(backend=signed_uri).get_pixel_cache(img, "describe") is not None
    assert raw.get("ns1/x") is not None
    n_keys = len(list(raw.keys()))

    out = run_py(ATTACKER, kind, plain_uri, env={VAR: "", VAR + "_OLD": ""} | _no_secrets())
    report = json.loads(out.strip().splitlines()[-1])
    assert report["forged"] == n_keys and report["replayed"] >= 3

    # readers with the secret: nothing forged or replayed is ever served
    for salt in ("A", "B"):
        hit = PrefixCache(signed_uri, model="m", salt=salt, block_size=4).lookup(tokens)
        assert hit is None or hit.num_tokens == 0, salt
    warm = MLLMPrefixCacheManager(backend=signed_uri)
    assert warm.fetch(img, "describe") == (None, 0)
    assert warm.fetch(img, "describe", list(range(6))) == (None, 0)
    assert VisionEmbeddingCache(backend=signed_uri).get_pixel_cache(img, "describe") is None
    reader = mlxcache.open_backend(signed_uri)
    assert reader.get_many(["ns1/x", "ns2/x"]) == [None, None]
    for key in list(reader.keys()):
        assert reader.get(key) is None, key
    assert reader.stats()["rejected"] >= 2
    assert list(reader.keys()) == []  # every forged and replayed record was removed
    # and the legitimate writers carry on: a new signed store is served again
    assert pc_a.store(tokens, full_kv(10)) == 10, (pc_a.backend.stats(), pc_a.backend.last_error)
    fresh = PrefixCache(signed_uri, model="m", salt="A", block_size=4)
    assert fresh.lookup(tokens) is not None, (fresh.backend.stats(), fresh.backend.last_error)


def _no_secrets() -> dict[str, str]:
    return {k: "" for k in os.environ if "SECRET" in k}


@pytest.fixture
def images_dir(tmp_path):
    from PIL import Image

    path = tmp_path / "cat.png"
    Image.new("RGB", (8, 8), (200, 10, 10)).save(path)
    return path


def test_cli_verify_reports_unsigned_and_forged_entries(tmp_path, secret, capsys):
    signed_uri = f"file://{tmp_path}?secret_env={VAR}"
    signed = mlxcache.open_backend(signed_uri)
    signed.put("good", sample_record())
    signed.put("forged", sample_record())
    mlxcache.open_backend(f"file://{tmp_path}").put("unsigned", sample_record())
    with sqlite3.connect(tmp_path / "index.sqlite") as db:
        (file,) = db.execute("SELECT file FROM entries WHERE key='forged'").fetchone()
    from record_bytes import join, split

    path = tmp_path / "data" / file
    h, data = split(path.read_bytes())
    forged = st.to_bytes(Record({"x": mx.zeros(3)}, {}))
    fh, fdata = split(forged)
    fh["__metadata__"]["mac"] = h["__metadata__"]["mac"]
    path.write_bytes(join(fh, fdata))
    capsys.readouterr()
    assert cli_main(["verify", signed_uri, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["checked"] == 3 and sorted(report["bad"]) == ["forged", "unsigned"]
    assert "unsigned" in report["reasons"]["unsigned"]
    assert "MAC mismatch" in report["reasons"]["forged"]
    assert SECRET not in json.dumps(report)
    assert bits(signed.get("good").arrays["t0"]) == bits(sample_record().arrays["t0"])
