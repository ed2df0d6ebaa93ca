"""Record <-> safetensors bytes or file, with a format version and a checksum.

Layout (docs/format.md): the standard safetensors container, an 8-byte little-endian header
length, a JSON header and the raw tensor bytes. Our header ``__metadata__`` carries the format
name and version, the record metadata as base64 msgpack, and an xxh3-128 checksum of the
metadata, the tensor table and the tensor bytes. We write the container ourselves so tensors go
to disk or Redis straight from their buffers (bf16 included) and every read is verified.
"""

from __future__ import annotations

import base64
import bisect
import json
import math
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import xxhash

from mlxcache import meta as meta_codec
from mlxcache.errors import FormatError, UnsupportedVersionError
from mlxcache.record import Record

FORMAT_NAME = "mlxcache"
FORMAT_VERSION = 1
CHECKSUM_ALGO = "xxh3_128"
MAX_HEADER_BYTES = 64 * 1024 * 1024

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
    """Everything about a stored record except its tensor bytes."""

    version: int
    meta: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    checksum: str
    data_offset: int  # where tensor bytes start in the blob
    data_size: int
    meta_bytes: bytes

    @property
    def total_size(self) -> int:
        return self.data_offset + self.data_size


# ---------------------------------------------------------------- writing


def _contiguous(arrays: dict[str, mx.array]) -> dict[str, mx.array]:
    """Row-major, evaluated arrays whose memoryview is the logical tensor."""
    out = {name: mx.contiguous(a) for name, a in arrays.items()}
    mx.eval(list(out.values()))
    return out


def _checksum(meta_bytes: bytes, table: list[TensorInfo], buffers: Iterator[memoryview]) -> str:
    h = xxhash.xxh3_128()
    h.update(meta_bytes)
    h.update(meta_codec.pack([[t.name, t.dtype, list(t.shape), t.begin, t.end] for t in table]))
    for buf in buffers:
        h.update(buf)
    return f"{CHECKSUM_ALGO}:{h.hexdigest()}"


def encode(record: Record) -> tuple[bytes, list[memoryview]]:
    """Header bytes plus the tensor buffers to write after it (no copy of tensor data)."""
    arrays = _contiguous(dict(record.arrays))
    meta_bytes = meta_codec.pack(dict(record.meta))
    table: list[TensorInfo] = []
    views: list[memoryview] = []
    offset = 0
    for name, a in arrays.items():
        if a.dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r} has unsupported dtype {a.dtype}")
        view = memoryview(a).cast("B") if a.nbytes else memoryview(b"")
        table.append(
            TensorInfo(name, _DTYPES[a.dtype][0], tuple(a.shape), offset, offset + a.nbytes)
        )
        views.append(view)
        offset += a.nbytes
    header: dict[str, Any] = {
        "__metadata__": {
            "format": FORMAT_NAME,
            "format_version": str(FORMAT_VERSION),
            "meta": base64.b64encode(meta_bytes).decode("ascii"),
            "checksum": _checksum(meta_bytes, table, iter(views)),
        }
    }
    for t in table:
        header[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [t.begin, t.end],
        }
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(len(text) + 8) % 8)  # safetensors pads the header to 8 bytes
    return struct.pack("<Q", len(text)) + text, views


def to_bytes(record: Record) -> bytes:
    """The whole record as one safetensors blob (one copy of the tensor bytes)."""
    head, views = encode(record)
    return b"".join([head, *views])


# ---------------------------------------------------------------- reading


def parse_header(prefix: bytes | memoryview, total_size: int | None = None) -> Header:
    """Parse and check the header at the start of a blob; tensor bytes are not touched.

    ``prefix`` must hold at least the 8-byte length and the JSON header. ``total_size`` is the
    size of the whole blob when known, so a truncated one is caught here.
    """
    if len(prefix) < 8:
        raise FormatError("too short for a safetensors header")
    (n,) = struct.unpack("<Q", bytes(prefix[:8]))
    if n > MAX_HEADER_BYTES or len(prefix) < 8 + n:
        raise FormatError(f"header length {n} does not fit the data")
    try:
        header = json.loads(bytes(prefix[8 : 8 + n]))
        info = header.pop("__metadata__")
        if info.get("format") != FORMAT_NAME:
            raise FormatError(f"not an mlxcache record (format={info.get('format')!r})")
        version = int(info["format_version"])
        if version > FORMAT_VERSION or version < 1:
            raise UnsupportedVersionError(
                f"record format version {version}; this mlxcache reads up to {FORMAT_VERSION}"
            )
        meta_bytes = base64.b64decode(info["meta"], validate=True)
        meta = meta_codec.unpack(meta_bytes)
        checksum = str(info["checksum"])
        tensors = []
        for name, spec in header.items():
            begin, end = (int(x) for x in spec["data_offsets"])
            shape = tuple(spec["shape"])
            if not all(type(d) is int and d >= 0 for d in shape):
                raise FormatError(f"tensor {name!r} has a bad shape {spec['shape']!r}")
            tensors.append(TensorInfo(name, str(spec["dtype"]), shape, begin, end))
    except FormatError:
        raise
    except Exception as exc:  # any malformed JSON/base64/msgpack/field is foreign data
        raise FormatError(f"malformed header: {exc}") from exc
    tensors.sort(key=lambda t: (t.begin, t.end))
    expected = 0
    for t in tensors:
        if t.dtype not in _BY_NAME:
            raise FormatError(f"tensor {t.name!r} has unknown dtype {t.dtype!r}")
        itemsize = np.dtype(_BY_NAME[t.dtype][1]).itemsize
        if t.begin != expected or t.end - t.begin != itemsize * math.prod(t.shape):
            raise FormatError(f"tensor {t.name!r} has inconsistent offsets")
        expected = t.end
    data_offset = 8 + n
    if total_size is not None and total_size != data_offset + expected:
        raise FormatError(f"size is {total_size} bytes, header says {data_offset + expected}")
    if not isinstance(meta, dict):
        raise FormatError("record metadata is not a map")
    return Header(version, meta, tuple(tensors), checksum, data_offset, expected, meta_bytes)


def _array_from_buffer(t: TensorInfo, buf: memoryview | bytes) -> mx.array:
    """The tensor from exactly its bytes; ``mx.array`` copies, so it never aliases ``buf``."""
    dtype, carrier = _BY_NAME[t.dtype]
    a = mx.array(np.frombuffer(buf, dtype=carrier).reshape(t.shape))
    return a.view(dtype) if t.dtype in _VIEWED else a


def _verify(header: Header, buffers: Iterator[memoryview]) -> None:
    actual = _checksum(header.meta_bytes, list(header.tensors), buffers)
    if actual != header.checksum:
        raise FormatError("checksum mismatch: the record is corrupt")


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
    chunks: Sequence[bytes | bytearray | memoryview], *, consume: bool = False
) -> Record:
    """Decode and verify a blob given as consecutive buffers (e.g. Redis chunks), unjoined.

    The checksum streams over the buffers; each tensor is built from a view of the buffer that
    holds it, and only a tensor (or header) that straddles a boundary is copied to join it.
    With ``consume=True`` the caller hands over ``chunks`` (a list): each entry is set to None
    once its bytes are in the arrays, so peak memory is one record plus a chunk, not two.
    """
    blob = _Chunks(chunks)
    if blob.size < 8:
        raise FormatError("too short for a safetensors header")
    (n,) = struct.unpack("<Q", bytes(blob.span(0, 8)))
    if n > MAX_HEADER_BYTES or blob.size < 8 + n:
        raise FormatError(f"header length {n} does not fit the data")
    header = parse_header(blob.span(0, 8 + n), total_size=blob.size)
    base = header.data_offset
    _verify(header, (p for t in header.tensors for p in blob.pieces(base + t.begin, base + t.end)))
    arrays = {}
    for t in header.tensors:
        arrays[t.name] = _array_from_buffer(t, blob.span(base + t.begin, base + t.end))
        if consume:
            mx.eval(arrays[t.name])
            blob.release(base + t.end, chunks)  # type: ignore[arg-type]
    mx.eval(list(arrays.values()))
    return Record(arrays=arrays, meta=header.meta)


def from_bytes(blob: bytes | bytearray | memoryview) -> Record:
    """Decode and verify a blob written by :func:`to_bytes`."""
    return from_buffers([blob])


def header_bytes_needed(prefix: bytes) -> int:
    """Bytes a blob's header takes, from its first bytes (8 if fewer are known; capped)."""
    if len(prefix) < 8:
        return 8
    return 8 + min(int.from_bytes(prefix[:8], "little"), MAX_HEADER_BYTES)


def read_header(path: str | os.PathLike) -> Header:
    """Read only the header of a record file (cheap: tensor bytes stay on disk)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        first = f.read(8)
        if len(first) < 8:
            raise FormatError("file too short")
        (n,) = struct.unpack("<Q", first)
        if n > MAX_HEADER_BYTES:
            raise FormatError(f"header length {n} is implausible")
        return parse_header(first + f.read(n), total_size=size)


def read_file(path: str | os.PathLike) -> Record:
    """Load and verify a record file; tensors are read by ``mx.load`` straight into arrays."""
    header = read_header(path)
    if any(t.dtype in _NOT_MX_LOADABLE for t in header.tensors):
        with open(path, "rb") as f:
            return from_bytes(f.read())
    loaded = mx.load(str(path)) if header.tensors else {}
    arrays = {t.name: loaded[t.name] for t in header.tensors}
    mx.eval(list(arrays.values()))
    _verify(header, (_raw_view(arrays[t.name]) for t in header.tensors))
    return Record(arrays=arrays, meta=header.meta)


def header_of(record: Record) -> Header:
    """The header :func:`encode` writes for ``record`` (for stores that hold records, not bytes)."""
    head, views = encode(record)
    return parse_header(head, total_size=len(head) + sum(v.nbytes for v in views))


def _raw_view(a: mx.array) -> memoryview:
    return memoryview(a).cast("B") if a.nbytes else memoryview(b"")


def describe(header: Header) -> dict[str, Any]:
    """A JSON-friendly summary of a header (used by ``mlxcache inspect``)."""
    return {
        "format_version": header.version,
        "checksum": header.checksum,
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
    "read_file",
    "read_header",
    "to_bytes",
]
