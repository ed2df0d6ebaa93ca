"""Record <-> safetensors bytes or file, with a format version and a checksum.

Layout (docs/format.md): the standard safetensors container, an 8-byte little-endian header
length, a JSON header and the raw tensor bytes. Our header ``__metadata__`` carries the format
name and version, the record metadata as base64 msgpack, and an xxh3-128 checksum of the
metadata, the tensor table and the tensor bytes. We write the container ourselves so tensors go
to disk or Redis straight from their buffers (bf16 included) and every read is verified.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import dataclasses
import json
import math
import re
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcache.buffers import array_memoryview
from mlxcache.errors import (
    FormatError,
    RecordTooLargeError,
    UnsupportedVersionError,
)
from mlxcache.records import digests
from mlxcache.records import meta as meta_codec
from mlxcache.records.digests import FORMAT_VERSION, READ_VERSIONS, digest, vcheck, verify
from mlxcache.records.digests import checksum as _checksum  # noqa: F401 - tests forge with it
from mlxcache.records.digests import vcheck as _vcheck  # noqa: F401
from mlxcache.records.record import Record
from mlxcache.records.signing import MAC_ALGO, Signer

FORMAT_NAME = "mlxcache"
# Bounds no real record approaches (docs/reliability.md): the largest real header we build is
# about 1.5 MB (a 100-layer quantized cache with a 128k-token prompt in its metadata).
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_TENSORS = 65536  # a 100-layer quantized cache has 600
MAX_RANK = 32  # cache tensors have rank <= 5
MAX_DIM = 2**31 - 1  # MLX shapes are 32-bit
MAX_ELEMENTS = 2**48

# mx dtype -> (safetensors dtype, numpy carrier of the same item size, needs .view after load)
_DTYPES: dict[Any, tuple[str, Any]] = {
    mx.bool_: ("BOOL", np.bool_),
    mx.uint8: ("U8", np.uint8),
    mx.uint16: ("U16", np.uint16),
    mx.uint32: ("U32", np.uint32),
    mx.uint64: ("U64", np.uint64),
    mx.int8: ("I8", np.int8),
    mx.int16: ("I16", np.int16),
    mx.int32: ("I32", np.int32),
    mx.int64: ("I64", np.int64),
    mx.float16: ("F16", np.float16),
    mx.bfloat16: ("BF16", np.uint16),
    mx.float32: ("F32", np.float32),
    mx.float64: ("F64", np.uint64),
    mx.complex64: ("C64", np.complex64),
}
_BY_NAME = {name: (dtype, carrier) for dtype, (name, carrier) in _DTYPES.items()}
# dtypes whose numpy carrier differs from the real type: rebuilt with .view(dtype)
_VIEWED = {"BF16", "F64"}
# dtypes mx.load cannot read from safetensors: decoded from bytes instead
_NOT_MX_LOADABLE = {"F64"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """Everything about a stored record except its tensor bytes (checked, not yet verified)."""

    version: int
    meta: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    checksum: str
    data_offset: int  # where tensor bytes start in the blob
    data_size: int
    meta_bytes: bytes
    mac: str | None = None  # "blake3:<key id>:<hex>" when the writer had a secret

    @property
    def total_size(self) -> int:
        return self.data_offset + self.data_size


# ---------------------------------------------------------------- writing


def _contiguous(arrays: dict[str, mx.array]) -> dict[str, mx.array]:
    """Row-major, evaluated arrays whose memoryview is the logical tensor."""
    out = {name: mx.contiguous(a) for name, a in arrays.items()}
    mx.eval(list(out.values()))
    return out


def encode(
    record: Record, *, key: str | None = None, signer: Signer | None = None
) -> tuple[bytes, list[memoryview]]:
    """Header bytes plus the tensor buffers to write after it (no copy of tensor data).

    With a ``signer`` the record carries a MAC bound to ``key`` (its cache key, required).
    A header over ``MAX_HEADER_BYTES`` (metadata far beyond any real record) is a
    RecordTooLargeError (a ValueError).
    """
    if signer is not None and not isinstance(key, str):
        raise TypeError("a signed record needs its cache key (key=str)")
    arrays = _contiguous(dict(record.arrays))
    meta_bytes = meta_codec.pack(dict(record.meta))
    table: list[TensorInfo] = []
    views: list[memoryview] = []
    offset = 0
    for name, a in arrays.items():
        if a.dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r} has unsupported dtype {a.dtype}")
        view = array_memoryview(a).cast("B") if a.nbytes else memoryview(b"")
        table.append(
            TensorInfo(name, _DTYPES[a.dtype][0], tuple(a.shape), offset, offset + a.nbytes)
        )
        views.append(view)
        offset += a.nbytes
    checksum, mac = digest(
        meta_bytes,
        table,
        views,
        checksum=True,
        mac=None if signer is None else signer.hasher(),
        key=key or "",
    )
    info: dict[str, str] = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "meta": base64.b64encode(meta_bytes).decode("ascii"),
        "checksum": checksum,  # type: ignore[dict-item]
    }
    if signer is not None:
        info["mac"] = f"{MAC_ALGO}:{signer.key_id}:{mac}"
    info["vcheck"] = vcheck(info["format_version"], info["checksum"], info.get("mac", ""))
    header: dict[str, Any] = {"__metadata__": info}
    for t in table:
        header[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [t.begin, t.end],
        }
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(len(text) + 8) % 8)  # safetensors pads the header to 8 bytes
    if len(text) > MAX_HEADER_BYTES:
        raise RecordTooLargeError(
            f"record header is {len(text)} bytes, over the {MAX_HEADER_BYTES}-byte limit: "
            "its metadata or tensor table is far larger than any cache record"
        )
    return struct.pack("<Q", len(text)) + text, views


def to_bytes(record: Record, *, key: str | None = None, signer: Signer | None = None) -> bytes:
    """The whole record as one safetensors blob (one copy of the tensor bytes)."""
    head, views = encode(record, key=key, signer=signer)
    return b"".join([head, *views])


# ---------------------------------------------------------------- reading


def _header_length(first: bytes | memoryview) -> int:
    if len(first) < 8:
        raise FormatError("too short for a safetensors header")
    (n,) = struct.unpack("<Q", bytes(first[:8]))
    if n > MAX_HEADER_BYTES:
        raise FormatError(f"header length {n} is over the {MAX_HEADER_BYTES}-byte limit")
    return n


def _version(info: dict[str, Any]) -> int:
    """The format version, if it is ours; a newer one only with a valid version check."""
    raw = info.get("format_version")
    if not isinstance(raw, str) or not re.fullmatch(r"[0-9]{1,9}", raw):
        raise FormatError(f"bad format version {raw!r:.40}")
    version = int(raw)
    if version in READ_VERSIONS:
        return version
    parts = [info.get("checksum"), info.get("mac", ""), info.get("vcheck")]
    if all(isinstance(p, str) for p in parts) and parts[2] == vcheck(raw, parts[0], parts[1]):
        raise UnsupportedVersionError(
            f"record format version {version}; this mlxcache reads versions {READ_VERSIONS}"
        )
    raise FormatError(f"format version {raw!r} without a valid version check: corrupt")


def _tensor(name: str, spec: Any) -> TensorInfo:
    if not isinstance(spec, dict):
        raise FormatError(f"tensor {name!r:.80} has no spec")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if type(dtype) is not str or dtype not in _BY_NAME:
        raise FormatError(f"tensor {name!r:.80} has unknown dtype {dtype!r:.40}")
    if not (
        type(shape) is list
        and len(shape) <= MAX_RANK
        and all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)
        and math.prod(d for d in shape if d) <= MAX_ELEMENTS
    ):
        raise FormatError(f"tensor {name!r:.80} has a bad shape {shape!r:.80}")
    if not (type(offsets) is list and len(offsets) == 2 and all(type(x) is int for x in offsets)):
        raise FormatError(f"tensor {name!r:.80} has bad data_offsets {offsets!r:.80}")
    return TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])


def parse_header(prefix: bytes | memoryview, total_size: int | None = None) -> Header:
    """Parse and check the header at the start of a blob; tensor bytes are not touched.

    ``prefix`` must hold at least the 8-byte length and the JSON header. ``total_size`` is the
    size of the whole blob when known, so a truncated one is caught here. Any malformed,
    inconsistent or oversized input is a FormatError (UnsupportedVersionError for a genuine
    newer format), in time and memory proportional to the header.
    """
    return _with_meta(_parse_header(prefix, total_size))


def _with_meta(header: Header) -> Header:
    """The header with its metadata decoded (after the checksum or MAC, when reading data)."""
    meta = meta_codec.unpack(header.meta_bytes)
    if not isinstance(meta, dict):
        raise FormatError("record metadata is not a map")
    return dataclasses.replace(header, meta=meta)


def info_fields(info: dict[str, Any]) -> tuple[int, str, str | None, bytes]:
    """The checked fields of a header's ``__metadata__``: version, checksum, MAC, meta bytes."""
    if info.get("format") != FORMAT_NAME:
        raise FormatError(f"not an mlxcache record (format={info.get('format')!r:.40})")
    version = _version(info)
    checksum, mac, meta_b64 = info.get("checksum"), info.get("mac"), info.get("meta")
    if not isinstance(checksum, str) or not isinstance(meta_b64, str):
        raise FormatError("header lacks its checksum or metadata")
    if mac is not None and not isinstance(mac, str):
        raise FormatError("header has a malformed MAC field")
    try:
        meta_bytes = base64.b64decode(meta_b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise FormatError(f"malformed metadata base64: {exc}") from None
    return version, checksum, mac, meta_bytes


def _parse_header(prefix: bytes | memoryview, total_size: int | None = None) -> Header:
    """:func:`parse_header` without decoding the metadata bytes (``meta`` is left empty)."""
    n = _header_length(prefix)
    if len(prefix) < 8 + n or (total_size is not None and total_size < 8 + n):
        raise FormatError(f"header length {n} does not fit the data")
    raw = bytes(prefix[8 : 8 + n])
    if raw.count(b"{") > MAX_TENSORS + 2 or raw.count(b"[") > 2 * MAX_TENSORS + 2:
        raise FormatError(f"header lists more than {MAX_TENSORS} tensors")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"malformed header JSON: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise FormatError("not an mlxcache record (no __metadata__)")
    version, checksum, mac, meta_bytes = info_fields(header.pop("__metadata__"))
    tensors = sorted((_tensor(k, v) for k, v in header.items()), key=lambda t: (t.begin, t.end))
    expected = 0
    for t in tensors:
        itemsize = np.dtype(_BY_NAME[t.dtype][1]).itemsize
        if t.begin != expected or t.end - t.begin != itemsize * math.prod(t.shape):
            raise FormatError(f"tensor {t.name!r:.80} has inconsistent offsets")
        expected = t.end
    data_offset = 8 + n
    if total_size is not None and total_size != data_offset + expected:
        raise FormatError(f"size is {total_size} bytes, header says {data_offset + expected}")
    return Header(version, {}, tuple(tensors), checksum, data_offset, expected, meta_bytes, mac)


def _array_from_buffer(t: TensorInfo, buf: memoryview | bytes) -> mx.array:
    """The tensor from exactly its bytes; ``mx.array`` copies, so it never aliases ``buf``."""
    dtype, carrier = _BY_NAME[t.dtype]
    try:
        a = mx.array(np.frombuffer(buf, dtype=carrier).reshape(t.shape))
    except ValueError as exc:
        raise FormatError(f"tensor {t.name!r:.80} cannot be built: {exc}") from None
    a = a.view(dtype) if t.dtype in _VIEWED else a
    _check_array(t, a)
    return a


def _check_array(t: TensorInfo, a: mx.array | None) -> None:
    """A loaded array must be exactly what the verified header says (shape, dtype, bytes)."""
    if (
        a is None
        or tuple(a.shape) != t.shape
        or a.dtype != _BY_NAME[t.dtype][0]
        or a.nbytes != t.end - t.begin
    ):
        got = None if a is None else (tuple(a.shape), str(a.dtype))
        raise FormatError(f"tensor {t.name!r:.80} loaded as {got}, header says {t.shape}")


def _record(arrays: dict[str, mx.array], meta: dict[str, Any]) -> Record:
    try:
        return Record(arrays=arrays, meta=meta)
    except (TypeError, ValueError) as exc:  # e.g. metadata nested deeper than msgpack packs
        raise FormatError(f"not a valid record: {exc}") from None


class _Chunks:
    """Byte ranges of a blob held as consecutive buffers, read without joining them."""

    def __init__(self, chunks: Sequence[bytes | bytearray | memoryview]) -> None:
        self.views: list[memoryview | None] = [memoryview(c).cast("B") for c in chunks]
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.size = 0
        for v in self.views:
            self.starts.append(self.size)
            self.size += len(v)  # type: ignore[arg-type]
            self.ends.append(self.size)

    def pieces(self, lo: int, hi: int) -> Iterator[memoryview]:
        """Zero-copy views covering ``[lo, hi)``, in order."""
        i = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        while lo < hi and i < len(self.views):
            end = min(hi, self.ends[i])
            if end > lo:
                yield self.views[i][lo - self.starts[i] : end - self.starts[i]]  # type: ignore[index]
                lo = end
            i += 1

    def release(self, upto: int, source: list) -> None:
        """Drop our views of, and the caller's references to, buffers that end by ``upto``."""
        for i in range(bisect.bisect_right(self.ends, upto)):
            self.views[i] = source[i] = None

    def span(self, lo: int, hi: int) -> memoryview | bytes:
        """``[lo, hi)`` as one buffer: a view inside one chunk, a copy only across a boundary."""
        parts = list(self.pieces(lo, hi))
        if len(parts) == 1:
            return parts[0]
        return b"".join(parts)


def from_buffers(
    chunks: Sequence[bytes | bytearray | memoryview],
    *,
    consume: bool = False,
    key: str | None = None,
    signer: Signer | None = None,
) -> Record:
    """Decode and verify a blob given as consecutive buffers (e.g. Redis chunks), unjoined.

    The checksum (or MAC) streams over the buffers; each tensor is built from a view of the
    buffer that holds it, and only a tensor (or header) that straddles a boundary is copied.
    With ``consume=True`` the caller hands over ``chunks`` (a list): each entry is set to None
    once its bytes are in the arrays, so peak memory is one record plus a chunk, not two.
    With a ``signer`` only a record signed for ``key`` with an accepted secret is returned
    (else UntrustedRecordError). Any other bad input is a FormatError.
    """
    blob = _Chunks(chunks)
    n = _header_length(blob.span(0, min(8, blob.size)))
    if blob.size < 8 + n:
        raise FormatError(f"header length {n} does not fit the data")
    # metadata is decoded only once the checksum or MAC holds: a forged header costs one hash
    header = _parse_header(blob.span(0, 8 + n), total_size=blob.size)
    base = header.data_offset

    def buffers() -> Iterator[memoryview]:
        for t in header.tensors:
            yield from blob.pieces(base + t.begin, base + t.end)

    if header.version == 1:
        verify(header, buffers, key, signer)
    else:  # each piece hashed from the buffers that hold it, pieces spread over the cores
        ranges = digests.pieces(header.tensors)

        def leaves(kind: str) -> list[bytes]:
            parts = lambda r: list(blob.pieces(base + r[0], base + r[1]))  # noqa: E731
            return digests.pmap(lambda r: digests.leaf(kind, parts(r)), ranges, header.data_size)

        digests.verify_leaves(header, leaves, key, signer)
    header = _with_meta(header)
    arrays = {}
    for t in header.tensors:
        arrays[t.name] = _array_from_buffer(t, blob.span(base + t.begin, base + t.end))
        if consume:
            mx.eval(arrays[t.name])
            blob.release(base + t.end, chunks)  # type: ignore[arg-type]
    mx.eval(list(arrays.values()))
    return _record(arrays, header.meta)


def from_bytes(
    blob: bytes | bytearray | memoryview,
    *,
    key: str | None = None,
    signer: Signer | None = None,
) -> Record:
    """Decode and verify a blob written by :func:`to_bytes`."""
    return from_buffers([blob], key=key, signer=signer)


def header_bytes_needed(prefix: bytes) -> int:
    """Bytes a blob's header takes, from its first bytes (8 if fewer are known; capped)."""
    if len(prefix) < 8:
        return 8
    return 8 + min(int.from_bytes(prefix[:8], "little"), MAX_HEADER_BYTES)


def header_of(record: Record, *, key: str | None = None, signer: Signer | None = None) -> Header:
    """The header :func:`encode` writes for ``record`` (for stores that hold records, not bytes)."""
    head, views = encode(record, key=key, signer=signer)
    return parse_header(head, total_size=len(head) + sum(v.nbytes for v in views))


def describe(header: Header) -> dict[str, Any]:
    """A JSON-friendly summary of a header (used by ``mlxcache inspect``)."""
    return {
        "format_version": header.version,
        "checksum": header.checksum,
        "signed_by": header.mac.split(":")[1]
        if header.mac and header.mac.count(":") == 2
        else None,
        "bytes": header.total_size,
        "meta": jsonable(header.meta),
        "tensors": [
            {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.end - t.begin}
            for t in header.tensors
        ],
    }


def jsonable(obj: Any) -> Any:
    if isinstance(obj, bytes):
        return obj.hex()
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    return obj


__all__ = [
    "FORMAT_VERSION",
    "Header",
    "TensorInfo",
    "describe",
    "encode",
    "from_buffers",
    "from_bytes",
    "header_of",
    "parse_header",
    "to_bytes",
]
