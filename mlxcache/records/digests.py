"""Checksums and MACs of records: what a record's header promises about its bytes.

The xxh3-128 checksum (public, against accidents) covers the metadata bytes, the tensor table
and the tensor bytes; the keyed BLAKE3 MAC (with a secret, against writers without it) covers
the same plus the format version and the record's cache key. Format 2 hashes each tensor in
1 MiB pieces (in parallel, each piece while it is in cache) and hashes the pieces' digests;
format 1 streamed one hash over everything and is still read. The version check ties a
record's version field to its checksum (docs/format.md).
"""

from __future__ import annotations

import hmac
import os
import re
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import blake3
import msgpack
import xxhash

from mlxcache.errors import FormatError, UntrustedRecordError
from mlxcache.records.signing import MAC_ALGO, Signer

FORMAT_VERSION = 2  # what we write
READ_VERSIONS = (1, 2)  # what we read
CHECKSUM_ALGO = "xxh3_128"
_MAC_DOMAIN = b"mlxcache record MAC v1\0"
_MAC_DOMAIN_V2 = b"mlxcache record MAC v2\0"
_SLICE = 1 << 20
PIECE = 1 << 18  # format 2: each tensor's bytes are hashed in 256 KiB pieces (fit in L2)
SUM, MAC = "sum", "mac"  # the two kinds of piece digest: xxh3-128 (16 bytes), BLAKE3 (32)
_INLINE_BYTES = 2 * PIECE  # below this, hashing in the calling thread beats a hand-off
_T = TypeVar("_T")


def pack_table(table: Sequence[Any]) -> bytes:
    return msgpack.packb(
        [[t.name, t.dtype, list(t.shape), t.begin, t.end] for t in table], use_bin_type=True
    )


def _digest_v1(
    meta_bytes: bytes,
    table: Sequence[Any],
    buffers: Iterable[memoryview],
    checksum: bool,
    mac: Any,
    key: str,
) -> tuple[str | None, str | None]:
    """Format 1: the xxh3 checksum and/or the keyed MAC in one sequential pass over the bytes.

    The checksum covers the meta bytes, the tensor table and the tensor bytes. The MAC covers
    the same, plus the format version and the record's cache key (length-prefixed), so a
    record copied under another key does not verify.
    """
    h = xxhash.xxh3_128() if checksum else None
    table_bytes = pack_table(table)
    if h is not None:
        h.update(meta_bytes)
        h.update(table_bytes)
    if mac is not None:
        mac.update(_MAC_DOMAIN)
        for part in (key.encode("utf-8"), b"1", meta_bytes, table_bytes):
            mac.update(struct.pack("<Q", len(part)))
            mac.update(part)
    for buf in buffers:
        if h is None or mac is None:
            one = h if mac is None else mac
            assert one is not None  # every caller asks for the checksum, a MAC or both
            one.update(buf)
            continue
        for i in range(0, len(buf), _SLICE):  # both hashes over a slice while it is in cache
            piece = buf[i : i + _SLICE]
            h.update(piece)
            mac.update(piece)
    return (
        None if h is None else f"{CHECKSUM_ALGO}:{h.hexdigest()}",
        None if mac is None else mac.hexdigest(),
    )


# ---------------------------------------------------------------- format 2: hashed pieces


def pieces(table: Sequence[Any]) -> list[tuple[int, int]]:
    """The ``[begin, end)`` data ranges hashed one by one: each tensor cut every PIECE bytes."""
    out = []
    for t in table:
        out += [(lo, min(lo + PIECE, t.end)) for lo in range(t.begin, t.end, PIECE)]
    return out


def cut(views: Sequence[memoryview]) -> list[memoryview]:
    """Each tensor's bytes (one view a tensor, in table order) cut into its pieces."""
    return [v[lo : lo + PIECE] for v in views for lo in range(0, len(v), PIECE)]


def verify_views(
    header: Any, views: Sequence[memoryview], key: str | None, signer: Signer | None
) -> None:
    """Format 2: :func:`verify_leaves` over tensors held whole, one view each, pieces hashed
    on the pool."""
    jobs = cut(views)
    size = sum(len(v) for v in views)
    verify_leaves(header, lambda kind: pmap(lambda j: leaf(kind, [j]), jobs, size), key, signer)


def leaf(kind: str, parts: Sequence[memoryview | bytes]) -> bytes:
    """The digest of one piece, given as the consecutive buffers that hold it."""
    if len(parts) == 1:
        if kind == SUM:
            return xxhash.xxh3_128_digest(parts[0])
        return blake3.blake3(parts[0]).digest()
    h: Any = xxhash.xxh3_128() if kind == SUM else blake3.blake3()
    for p in parts:
        h.update(p)
    return h.digest()


_pools: dict[str, tuple[int, ThreadPoolExecutor, int]] = {}
_pool_lock = threading.Lock()
READERS = 4  # threads that read files (blocked in the kernel, like MLX's 4 I/O threads)


def _executor(kind: str = "hash") -> tuple[ThreadPoolExecutor, int]:
    """Process-wide pools: ``hash`` has one thread a core (at most 4), ``read`` has READERS;
    a forked child makes its own."""
    with _pool_lock:
        pool = _pools.get(kind)
        if pool is None or pool[0] != os.getpid():
            n = max(1, min(4, os.cpu_count() or 1)) if kind == "hash" else READERS
            pool = (os.getpid(), ThreadPoolExecutor(n, thread_name_prefix=f"mlxcache-{kind}"), n)
            _pools[kind] = pool
        return pool[1], pool[2]


def pmap(
    fn: Callable[[Any], _T], items: Sequence[Any], nbytes: int, *, pool: str = "hash"
) -> list[_T]:
    """``[fn(x) for x in items]``, spread over the cores when ``nbytes`` make it pay.

    The calling thread works too, and every thread takes the next item as it finishes one, so a
    pool thread that is slow to be scheduled (a busy machine) costs nothing but its share.
    ``fn`` must release the GIL for most of its work (file reads, xxhash and BLAKE3 on large
    buffers do), so the pieces really run on every core. The first error is raised.
    ``pool="read"`` runs on the reader pool instead (jobs that read files); a job on one pool
    may use the other, never its own (its helpers could wait behind it).
    """
    if nbytes < _INLINE_BYTES or len(items) < 2:
        return [fn(x) for x in items]
    executor, workers = _executor(pool)
    results: list[Any] = [None] * len(items)
    todo = iter(range(len(items)))  # next() on it is atomic under the GIL: one taker per item
    failed: list[BaseException] = []

    def drain() -> None:
        for i in todo:
            if failed:
                return
            try:
                results[i] = fn(items[i])
            except BaseException as exc:
                failed.append(exc)
                return

    helpers = [executor.submit(drain) for _ in range(min(workers, len(items)) - 1)]
    drain()
    for h in helpers:
        h.result()
    if failed:
        raise failed[0]
    return results


def root(
    kind: str,
    meta_bytes: bytes,
    table: Sequence[Any],
    leaves: Sequence[bytes],
    *,
    hasher: Any = None,
    key: str = "",
) -> str:
    """Format 2: the checksum (``SUM``) or MAC (``MAC``, keyed ``hasher``) from piece digests.

    The checksum hashes the meta bytes, the tensor table and the pieces' xxh3-128 digests in
    order; the MAC (keyed BLAKE3) the length-prefixed cache key, format version, meta bytes and
    table, then the pieces' BLAKE3 digests, so a changed byte changes a collision-resistant
    digest under the key.
    """
    table_bytes = table if isinstance(table, bytes) else pack_table(table)  # packed once
    if kind == SUM:
        h = xxhash.xxh3_128()
        for part in (meta_bytes, table_bytes, b"".join(leaves)):
            h.update(part)
        return f"{CHECKSUM_ALGO}:{h.hexdigest()}"
    hasher.update(_MAC_DOMAIN_V2)
    for part in (key.encode("utf-8"), b"2", meta_bytes, table_bytes):
        hasher.update(struct.pack("<Q", len(part)))
        hasher.update(part)
    hasher.update(b"".join(leaves))
    return hasher.hexdigest()


def digest(
    meta_bytes: bytes,
    table: Sequence[Any],
    buffers: Iterable[memoryview],
    *,
    checksum: bool,
    mac: Any = None,
    key: str = "",
    version: int = FORMAT_VERSION,
) -> tuple[str | None, str | None]:
    """The checksum and/or the MAC of a record whose tensors are ``buffers``.

    ``buffers`` holds each tensor's bytes, in table order. Format 2 takes both digests of a
    piece while it is in cache, pieces spread over the cores; format 1 is one sequential pass.
    """
    if version == 1:
        return _digest_v1(meta_bytes, table, buffers, checksum, mac, key)
    views = [memoryview(b).cast("B") for b in buffers]
    jobs = [(p,) for p in cut(views)]
    kinds = ([SUM] if checksum else []) + ([MAC] if mac is not None else [])
    got = pmap(lambda j: [leaf(k, j) for k in kinds], jobs, sum(len(v) for v in views))
    out: dict[str, str] = {}
    for i, k in enumerate(kinds):
        out[k] = root(k, meta_bytes, table, [g[i] for g in got], hasher=mac, key=key)
    return out.get(SUM), out.get(MAC)


def checksum(meta_bytes: bytes, table: Sequence[Any], buffers: Iterable[memoryview]) -> str:
    """The public checksum alone (format 2; what any writer, with or without a secret, makes)."""
    return digest(meta_bytes, table, buffers, checksum=True)[0]  # type: ignore[return-value]


def vcheck(version: str, checksum: str, mac: str) -> str:
    """Ties the version field to the checksum: a flipped version is corrupt, not newer."""
    text = f"mlxcache-version\n{version}\n{checksum}\n{mac}".encode("utf-8", "surrogatepass")
    return xxhash.xxh3_64_hexdigest(text)


def verify(
    header: Any,
    buffers: Callable[[], Iterable[memoryview]],
    key: str | None,
    signer: Signer | None,
) -> None:
    """Format 1: check the checksum, or with a signer the MAC (which covers all it covers)."""
    if signer is None:
        actual_sum, _ = digest(
            header.meta_bytes, header.tensors, buffers(), checksum=True, version=1
        )
        if actual_sum != header.checksum:
            raise FormatError("checksum mismatch: the record is corrupt")
        return
    hasher, expected = _mac_hasher(header, key, signer)
    _, actual = digest(
        header.meta_bytes,
        header.tensors,
        buffers(),
        checksum=False,
        mac=hasher,
        key=key or "",
        version=1,
    )
    if not hmac.compare_digest(actual or "", expected):
        actual_sum, _ = digest(
            header.meta_bytes, header.tensors, buffers(), checksum=True, version=1
        )
        if actual_sum != header.checksum:  # a second pass only on failure, to name the cause
            raise FormatError("checksum mismatch: the record is corrupt")
        raise UntrustedRecordError("MAC mismatch: forged, or replayed from another key")


def verify_leaves(
    header: Any,
    leaves: Callable[[str], Sequence[bytes]],
    key: str | None,
    signer: Signer | None,
) -> None:
    """Format 2: check the checksum, or with a signer the MAC, from ``leaves(kind)``.

    ``leaves(kind)`` returns the digests of :func:`pieces` of the tensor bytes (``SUM`` or
    ``MAC``); the checksum's are asked for after a MAC failure only, to name the cause.
    """
    meta, table = header.meta_bytes, header.tensors
    if signer is None:
        if root(SUM, meta, table, leaves(SUM)) != header.checksum:
            raise FormatError("checksum mismatch: the record is corrupt")
        return
    hasher, expected = _mac_hasher(header, key, signer)
    actual = root(MAC, meta, table, leaves(MAC), hasher=hasher, key=key or "")
    if not hmac.compare_digest(actual, expected):
        if root(SUM, meta, table, leaves(SUM)) != header.checksum:
            raise FormatError("checksum mismatch: the record is corrupt")
        raise UntrustedRecordError("MAC mismatch: forged, or replayed from another key")


def _mac_hasher(header: Any, key: str | None, signer: Signer) -> tuple[Any, str]:
    """The keyed hasher of the secret that signed ``header`` and the MAC it claims."""
    if not isinstance(key, str):
        raise TypeError("verifying a signed record needs its cache key (key=str)")
    if header.mac is None:
        raise UntrustedRecordError("unsigned record: this cache accepts only signed records")
    algo, _, rest = header.mac.partition(":")
    key_id, _, expected = rest.partition(":")
    if algo != MAC_ALGO or not re.fullmatch(r"[0-9a-f]{64}", expected):
        raise UntrustedRecordError(f"malformed MAC {header.mac!r:.40}")
    hasher = signer.hasher(key_id)
    if hasher is None:
        raise UntrustedRecordError(
            f"signed with a secret not accepted here (key id {key_id!r:.20})"
        )
    return hasher, expected
