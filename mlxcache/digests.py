"""Checksums and MACs of records: what a record's header promises about its bytes.

The xxh3-128 checksum (public, against accidents) covers the metadata bytes, the tensor table
and the tensor bytes; the keyed BLAKE3 MAC (with a secret, against writers without it) covers
the same plus the format version and the record's cache key. Both are computed in one pass.
The version check ties a record's version field to its checksum (docs/format.md).
"""

from __future__ import annotations

import hmac
import re
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgpack
import xxhash

from mlxcache.errors import FormatError, UntrustedRecordError
from mlxcache.signing import MAC_ALGO, Signer

FORMAT_VERSION = 1
CHECKSUM_ALGO = "xxh3_128"
_MAC_DOMAIN = b"mlxcache record MAC v1\0"
_SLICE = 1 << 20


def pack_table(table: Sequence[Any]) -> bytes:
    return msgpack.packb(
        [[t.name, t.dtype, list(t.shape), t.begin, t.end] for t in table], use_bin_type=True
    )


def digest(
    meta_bytes: bytes,
    table: Sequence[Any],
    buffers: Iterable[memoryview],
    *,
    checksum: bool,
    mac: Any = None,
    key: str = "",
) -> tuple[str | None, str | None]:
    """The xxh3 checksum and/or the keyed MAC of a record, in one pass over its bytes.

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
        for part in (key.encode("utf-8"), str(FORMAT_VERSION).encode(), meta_bytes, table_bytes):
            mac.update(struct.pack("<Q", len(part)))
            mac.update(part)
    for buf in buffers:
        if h is None or mac is None:
            (h if mac is None else mac).update(buf)
            continue
        for i in range(0, len(buf), _SLICE):  # both hashes over a slice while it is in cache
            piece = buf[i : i + _SLICE]
            h.update(piece)
            mac.update(piece)
    return (
        None if h is None else f"{CHECKSUM_ALGO}:{h.hexdigest()}",
        None if mac is None else mac.hexdigest(),
    )


def checksum(meta_bytes: bytes, table: Sequence[Any], buffers: Iterable[memoryview]) -> str:
    """The public xxh3 checksum alone (what any writer, with or without a secret, can make)."""
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
    """Check the checksum, or with a signer the MAC (which covers everything it covers)."""
    if signer is None:
        actual_sum, _ = digest(header.meta_bytes, header.tensors, buffers(), checksum=True)
        if actual_sum != header.checksum:
            raise FormatError("checksum mismatch: the record is corrupt")
        return
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
    _, actual = digest(
        header.meta_bytes, header.tensors, buffers(), checksum=False, mac=hasher, key=key
    )
    if not hmac.compare_digest(actual or "", expected):
        actual_sum, _ = digest(header.meta_bytes, header.tensors, buffers(), checksum=True)
        if actual_sum != header.checksum:  # a second pass only on failure, to name the cause
            raise FormatError("checksum mismatch: the record is corrupt")
        raise UntrustedRecordError("MAC mismatch: forged, or replayed from another key")
