"""Signed records (keyed BLAKE3 MAC, see mlxcache.records.signing) against unsigned ones.

Every ratio is ``unsigned time / signed time`` measured in the same run on the same record
(1.0 = signing is free; 0.8 = signed takes 25% longer). The MAC rows compare keyed BLAKE3 with
HMAC-SHA256 over the same tensor bytes, which is why BLAKE3 was chosen.
"""

from __future__ import annotations

import hashlib
import hmac
import os

import blake3
import xxhash

from benchmarks.common import Row, evaluate
from benchmarks.throughput import KEY, Context, _Sizer
from mlxcache import open_backend
from mlxcache.records import format as st
from mlxcache.records.signing import Signer

SECRET_VAR = "MLXCACHE_BENCH_SECRET"


def _hash_rows(s: _Sizer) -> None:
    key = os.urandom(32)

    def over(update) -> None:
        for v in s.views:
            update(v)

    def hmac_sha256() -> None:
        h = hmac.new(key, digestmod=hashlib.sha256)
        over(h.update)
        h.digest()

    def keyed_blake3() -> None:
        h = blake3.blake3(key=key)
        over(h.update)
        h.digest()

    def xxh3() -> None:
        h = xxhash.xxh3_128()
        over(h.update)
        h.digest()

    s.baseline("HMAC-SHA256 (MAC candidate)", s.time(hmac_sha256))
    s.ours("keyed BLAKE3 (the MAC)", s.time(keyed_blake3), "HMAC-SHA256 (MAC candidate)")
    s.ours("xxh3-128 (the checksum, no key)", s.time(xxh3), "HMAC-SHA256 (MAC candidate)")


def _format_rows(s: _Sizer, signer: Signer) -> None:
    s.baseline("unsigned to_bytes", s.time(lambda: st.to_bytes(s.record)))
    s.ours(
        "signed to_bytes",
        s.time(lambda: st.to_bytes(s.record, key=KEY, signer=signer)),
        "unsigned to_bytes",
        note="xxh3 and the MAC in one pass",
    )
    blob = st.to_bytes(s.record)
    signed = st.to_bytes(s.record, key=KEY, signer=signer)
    s.baseline("unsigned from_bytes", s.time(lambda: evaluate(st.from_bytes(blob))))
    s.ours(
        "signed from_bytes",
        s.time(lambda: evaluate(st.from_bytes(signed, key=KEY, signer=signer))),
        "unsigned from_bytes",
        note="the MAC replaces the xxh3 check",
    )


def _backend_rows(s: _Sizer, name: str, uri: str) -> None:
    sep = "&" if "?" in uri else "?"
    with open_backend(uri) as plain, open_backend(f"{uri}{sep}secret_env={SECRET_VAR}") as sig:
        for label, b in (("unsigned", plain), ("signed", sig)):
            put = s.time(lambda b=b: b.put(KEY, s.record), setup=lambda b=b: b.delete(KEY))
            if label == "unsigned":
                s.baseline(f"unsigned {name} put", put)
            else:
                s.ours(f"signed {name} put", put, f"unsigned {name} put", 0.8)
            b.put(KEY, s.record)
            s.check(b.get(KEY), f"{label} {name}")
            get = s.time(lambda b=b: evaluate(b.get(KEY)))
            if label == "unsigned":
                s.baseline(f"unsigned {name} get", get)
            else:
                s.ours(f"signed {name} get", get, f"unsigned {name} get", 0.8)
            b.clear()


def run(sizes: list[int], ctx: Context) -> list[Row]:
    os.environ[SECRET_VAR] = "benchmark-secret-" + os.urandom(8).hex()
    signer = Signer(os.environ[SECRET_VAR])
    rows: list[Row] = []
    try:
        for tokens in sizes:
            s = _Sizer(tokens, ctx)
            for row in s.rows:
                row.section = "signed"
            _hash_rows(s)
            _format_rows(s, signer)
            _backend_rows(s, "file://", f"file://{ctx.tmpdir / 'signed'}")
            if ctx.redis_url:
                _backend_rows(s, "redis://", ctx.redis_url + "?timeout=300&prefix=signed:")
            for row in s.rows:
                row.section = "signed"
            rows += s.rows
    finally:
        os.environ.pop(SECRET_VAR, None)
    return rows
