"""Records read straight into their rows of final arrays: a run of records joined on axis -2.

A prefix restore joins many block records (each holds the same tensors for a few rows of axis
-2) into one array per tensor. Instead of loading every record and concatenating the pieces
(two passes over every byte and a copy per piece), :class:`Joined` allocates the final arrays
once without filling them, and :func:`read_into` ``preadv``s each record's tensor
bytes straight into its rows there, hashing each piece right after it lands, while it is still
in cache. Every record is verified in full (its checksum, or its MAC with a secret) before its
metadata is decoded and returned; a record that fails is a FormatError (or
UntrustedRecordError) and what it wrote is never served. Format-2 records only; others are
read whole and copied in. docs/format.md, docs/performance.md.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcache.buffers import array_memoryview
from mlxcache.errors import FormatError
from mlxcache.records import digests, reader
from mlxcache.records import format as st
from mlxcache.records import meta as meta_codec
from mlxcache.records.signing import Signer

# bytes read by one preadv, then hashed while they are in the last-level cache: a block record
# (7 MiB for Qwen2-VL-2B's 256 tokens) in one call, so a reader thread gives up and takes
# back the GIL once a record instead of once every 512 KiB (docs/performance.md, issue 28)
GROUP_BYTES = 8 << 20
_IOV_MAX = 1024
_DECODER = json.JSONDecoder()
_HEAD = '{"__metadata__":'
_FIRST_READ = 16 << 10  # a block record's header is a few KiB: one pread gets it all


class Shape:
    """What a placed tensor is, without its data: enough for a record's shape checks (plain
    attributes: the checks read them for every tensor of every block)."""

    __slots__ = ("shape", "dtype", "ndim")

    def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
        self.shape, self.dtype, self.ndim = shape, dtype, len(shape)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Shape) and (self.shape, self.dtype) == (other.shape, other.dtype)

    def __hash__(self) -> int:
        return hash((self.shape, self.dtype))

    def __repr__(self) -> str:
        return f"Shape({self.shape!r}, {self.dtype!r})"


@dataclass(frozen=True)
class Placed:
    """A record read into its rows of a :class:`Joined`: verified metadata and tensor shapes
    (``arrays`` maps names to :class:`Shape`, so record checks read it like a Record's)."""

    index: int
    meta: Mapping[str, Any]
    arrays: Mapping[str, Shape]
    join: Joined
    nbytes: int  # tensor bytes read


class NotJoinable(ValueError):
    """A well-formed record whose tensors do not fit the join (another layout): a miss, and
    nothing was written; not a corrupt record."""


class Joined:
    """Final arrays for ``rows[i]`` rows of record ``i`` each, joined on axis -2.

    The tensor table comes from the first record read (:meth:`prepare`); every later record
    must hold the same tensors (names, dtypes, every axis but -2) with exactly its rows.
    Each join allocates its own arrays, so a restore never shares memory with another.
    """

    def __init__(self, rows: Sequence[int]) -> None:
        if not rows or any(r <= 0 for r in rows):
            raise ValueError("a join needs at least one record of at least one row")
        self.rows = list(rows)
        self.starts = [sum(self.rows[:i]) for i in range(len(self.rows))]
        self.total = sum(self.rows)
        self.table: dict[str, tuple[str, tuple[int, ...]]] | None = None
        self._views: dict[str, memoryview] = {}
        self._final: dict[str, mx.array] = {}
        self._lock = threading.Lock()
        # per tensor table already checked (by identity: Tables hands out one tuple a table):
        # each tensor's (view, bytes of one row, count of leading rows) in file order
        self._plans: dict[int, tuple[Sequence[st.TensorInfo], list[tuple[memoryview, int, int]]]]
        self._plans = {}
        self._cuts: dict[tuple[int, int], Any] = {}  # by (table, rows): see _cut_plan
        self._shapes: dict[int, tuple[Sequence[st.TensorInfo], Mapping[str, Shape]]] = {}

    def prepare(self, tensors: Sequence[st.TensorInfo]) -> None:
        """Allocate the final arrays from the first record's table (once; not filled)."""
        with self._lock:
            if self.table is not None:
                return
            table = {}
            for t in tensors:
                if len(t.shape) < 2 or t.dtype in st._NOT_MX_LOADABLE:
                    raise NotJoinable(f"tensor {t.name!r:.80} has no row axis to join on")
                table[t.name] = (t.dtype, t.shape[:-2] + (self.total,) + t.shape[-1:])
            infos = []
            for name, (dtype, shape) in table.items():
                size = _itemsize(dtype) * math.prod(shape)
                infos.append(st.TensorInfo(name, dtype, shape, 0, size))
            # one array a tensor, as mx.load allocates: glibc reuses freed blocks of up to
            # 32 MiB, while one large buffer would be fresh pages (a fault each) every time
            views = reader.blank_arrays(infos)
            mx.eval(views)
            self._final = dict(zip(table, views, strict=True))
            self._views = {n: _raw(a) for n, a in self._final.items()}
            self.table = table

    def segments(self, index: int, tensors: Sequence[st.TensorInfo]) -> list[list[memoryview]]:
        """For each tensor of record ``index`` (file order), the views its bytes go to, in order."""
        rows, start = self.rows[index], self.starts[index]
        out = []
        for view, row, outer in self._plan(tensors, rows):
            span = row * rows
            out.append(
                [view[(o * self.total + start) * row :][:span] for o in range(outer)]
                if span
                else []
            )
        return out

    def cut(self, index: int, tensors: Sequence[st.TensorInfo]) -> _Cut:
        """Record ``index``'s destination views in file order, cut into hashed pieces and
        read groups (the cut is worked out once per table and row count, then only offset)."""
        rows, start = self.rows[index], self.starts[index]
        plan = self._plan(tensors, rows)
        key = (id(tensors), rows)
        got = self._cuts.get(key)
        if got is None:
            got = _cut_plan(plan, rows, self.total)
            with self._lock:
                self._cuts[key] = got
        spec, bounds, groups = got
        views = [v[c + start * r : c + start * r + n] for v, c, n, r in spec]
        return _Cut(views, bounds, groups)

    def _plan(
        self, tensors: Sequence[st.TensorInfo], rows: int
    ) -> list[tuple[memoryview, int, int]]:
        """Each tensor's (view, row bytes, leading rows), its table checked against the join's
        once per table (the shapes' row axis is checked for every record: ``rows`` differ)."""
        if self.table is None:
            raise RuntimeError("Joined.prepare() first")
        got = self._plans.get(id(tensors))
        if got is None or got[0] is not tensors:
            if {t.name for t in tensors} != set(self.table):
                raise NotJoinable("record tensors differ from the first record's")
            plan = []
            for t in tensors:
                dtype, shape = self.table[t.name]
                if t.dtype != dtype or len(t.shape) != len(shape) or t.shape[:-2] != shape[:-2]:
                    raise NotJoinable(f"tensor {t.name!r:.80} has another shape or dtype")
                if t.shape[-1] != shape[-1]:
                    raise NotJoinable(f"tensor {t.name!r:.80} has another shape or dtype")
                row = _itemsize(dtype) * shape[-1]  # bytes of one row of axis -2
                plan.append((self._views[t.name], row, math.prod(shape[:-2])))
            got = (tensors, plan)
            with self._lock:
                self._plans[id(tensors)] = got
        if any(t.shape[-2] != rows for t in tensors):
            bad = next(t for t in tensors if t.shape[-2] != rows)
            raise NotJoinable(f"tensor {bad.name!r:.80} has another shape or dtype")
        return got[1]

    def shapes(self, tensors: Sequence[st.TensorInfo]) -> Mapping[str, Shape]:
        """The :class:`Shape` of each tensor (one read-only map per table, shared by records)."""
        got = self._shapes.get(id(tensors))
        if got is None or got[0] is not tensors:
            shapes = {t.name: Shape(t.shape, st._BY_NAME[t.dtype][0]) for t in tensors}
            got = (tensors, MappingProxyType(shapes))
            with self._lock:
                self._shapes[id(tensors)] = got
        return got[1]

    def arrays(self, upto: int) -> dict[str, mx.array]:
        """The joined arrays of the first ``upto`` records (the arrays themselves when all of
        them, else new contiguous arrays of the leading rows: the rest may be unfilled)."""
        if self.table is None:
            return {}
        if upto >= len(self.rows):
            return dict(self._final)
        n = self.starts[upto]
        out = {k: mx.contiguous(a[..., :n, :]) for k, a in self._final.items()}
        mx.eval(list(out.values()))
        return out

    def release(self) -> None:
        """Drop our writable views (after the reads; the arrays stay valid)."""
        self._views = {}
        self._plans = {}
        self._cuts = {}


@dataclass(frozen=True)
class _Cut:
    """One record's destination: ``views`` in file order; piece ``i`` is
    ``views[bounds[i]:bounds[i + 1]]``; each group ``(first piece, end piece, bytes)`` is
    read by one ``preadv`` and then hashed."""

    views: list[memoryview]
    bounds: list[int]
    groups: list[tuple[int, int, int]]

    def piece(self, i: int) -> list[memoryview]:
        return self.views[self.bounds[i] : self.bounds[i + 1]]


def _cut_plan(
    plan: list[tuple[memoryview, int, int]], rows: int, total: int
) -> tuple[list[tuple[memoryview, int, int, int]], list[int], list[tuple[int, int, int]]]:
    """For records of ``rows`` rows: each part's (tensor view, offset at row 0, length, row
    bytes), the piece bounds over the parts, and the read groups (see :class:`_Cut`)."""
    spec: list[tuple[memoryview, int, int, int]] = []
    bounds, sizes = [0], []
    for view, row, outer in plan:  # each tensor cut every PIECE bytes, as digests.pieces
        span, size = row * rows, 0
        for o in range(outer):
            lo = 0
            while lo < span:
                take = min(span - lo, digests.PIECE - size)
                spec.append((view, o * total * row + lo, take, row))
                lo, size = lo + take, size + take
                if size == digests.PIECE:
                    bounds.append(len(spec))
                    sizes.append(size)
                    size = 0
        if size:
            bounds.append(len(spec))
            sizes.append(size)
    groups, i = [], 0
    while i < len(sizes):
        j, size = i, 0
        while j < len(sizes) and (size < GROUP_BYTES or j == i):
            size += sizes[j]
            j += 1
        groups.append((i, j, size))
        i = j
    return spec, bounds, groups


def _itemsize(dtype: str) -> int:
    return np.dtype(st._BY_NAME[dtype][1]).itemsize


def _raw(a: mx.array) -> memoryview:
    return array_memoryview(a).cast("B") if a.nbytes else memoryview(b"")


class Tables:
    """Tensor tables already checked, by their header text: block records of one model repeat
    the same table, so it is parsed and checked once per process, not once a block or a restore
    (a bounded LRU shared by every ``Tables``; an entry is a pure function of its text)."""

    KEEP = 64  # tables kept (one a model, block shape and quantization: a few per server)
    KEEP_BYTES = 16 << 20  # and their text, at most (the newest one is kept whatever its size)
    _seen: OrderedDict[bytes, tuple[tuple[st.TensorInfo, ...], bytes, int]] = OrderedDict()
    _bytes = 0
    _lock = threading.Lock()

    def header(self, fd: int) -> tuple[st.Header, bytes]:
        """The checked header of an open record file (meta not decoded) and its packed table."""
        size = os.fstat(fd).st_size
        first = os.pread(fd, _FIRST_READ, 0)
        n = st._header_length(first)
        if size < 8 + n:
            raise FormatError(f"header length {n} does not fit the file ({size} bytes)")
        if len(first) < 8 + n:
            first += os.pread(fd, 8 + n - len(first), len(first))
        raw = first[8 : 8 + n]
        fast = self._fast(raw, size, n)
        if fast is not None:
            return fast
        header = st._parse_header(first[: 8 + n], total_size=size)
        packed = digests.pack_table(header.tensors)
        info = _first_info(raw)
        if info is not None and info[0] == _info_of(raw):  # cache only a table read one way
            self._keep(raw[info[1] :], (header.tensors, packed, header.data_size))
        return header, packed

    @classmethod
    def _keep(cls, text: bytes, entry: tuple[tuple[st.TensorInfo, ...], bytes, int]) -> None:
        with cls._lock:
            if text not in cls._seen:
                cls._bytes += len(text)
            cls._seen[text] = entry
            cls._seen.move_to_end(text)
            while len(cls._seen) > 1 and (len(cls._seen) > cls.KEEP or cls._bytes > cls.KEEP_BYTES):
                cls._bytes -= len(cls._seen.popitem(last=False)[0])

    def _fast(self, raw: bytes, size: int, n: int) -> tuple[st.Header, bytes] | None:
        got = _first_info(raw)
        if got is None:
            return None
        info, end = got
        with self._lock:
            hit = self._seen.get(raw[end:])
            if hit is None:
                return None
            self._seen.move_to_end(raw[end:])
        tensors, packed, data_size = hit
        if size != 8 + n + data_size:
            raise FormatError(f"size is {size} bytes, header says {8 + n + data_size}")
        version, checksum, mac, meta_bytes = st.info_fields(info)
        header = st.Header(version, {}, tensors, checksum, 8 + n, data_size, meta_bytes, mac)
        return header, packed


def _first_info(raw: bytes) -> tuple[dict, int] | None:
    """The ``__metadata__`` object leading an ASCII header and where it ends, else None."""
    if not raw.startswith(_HEAD.encode()) or not raw.isascii():
        return None
    try:
        info, end = _DECODER.raw_decode(raw.decode("ascii"), len(_HEAD))
    except (ValueError, RecursionError):
        return None
    return (info, end) if isinstance(info, dict) else None


def _info_of(raw: bytes) -> Any:
    try:
        return json.loads(raw).get("__metadata__")
    except (ValueError, RecursionError, AttributeError):
        return None


def prepare(
    path: str | os.PathLike, target: Joined, tables: Tables, *, fd: int | None = None
) -> None:
    """Size ``target`` from the header of record file ``path`` (on the thread that will use
    the arrays: MLX allocates them there); its data is read later, by :func:`read_into`.
    ``fd``, if given, is ``path`` already open."""
    if fd is None:
        with open(path, "rb", buffering=0) as f:
            return prepare(path, target, tables, fd=f.fileno())
    target.prepare(tables.header(fd)[0].tensors)
    return None


def read_into(
    path: str | os.PathLike,
    index: int,
    target: Joined,
    tables: Tables,
    *,
    key: str | None = None,
    signer: Signer | None = None,
    fd: int | None = None,
) -> Placed:
    """Read record file ``path`` into its rows of ``target`` (record ``index``), verified.

    ``fd``, if given, is ``path`` already open (a descriptor the caller keeps; read with
    ``pread``, its offset untouched), else the file is opened and closed here.

    A file that cannot be opened or read raises OSError; anything wrong in it (its checksum
    or MAC) a FormatError or UntrustedRecordError; a well-formed record whose tensors do not
    fit the join NotJoinable, before anything is written.
    """
    if fd is None:
        with open(path, "rb", buffering=0) as f:
            return read_into(path, index, target, tables, key=key, signer=signer, fd=f.fileno())
    header, packed = tables.header(fd)
    target.prepare(header.tensors)
    if header.version == 1:
        segments = target.segments(index, header.tensors)
        return _copy_in(path, index, header, target, segments, key, signer)
    first = digests.SUM if signer is None else digests.MAC
    cut = target.cut(index, header.tensors)
    leaves = _read_hashed(fd, header.data_offset, cut, first)

    def all_leaves(kind: str) -> Sequence[bytes]:
        if kind == first:
            return leaves
        return [digests.leaf(kind, cut.piece(i)) for i in range(len(cut.bounds) - 1)]

    check = _Packed(header, packed)
    digests.verify_leaves(check, all_leaves, key, signer)
    return _placed(index, header, target)


class _Packed:
    """A header whose table is given packed (``digests.root`` packs it otherwise)."""

    def __init__(self, header: st.Header, packed: bytes) -> None:
        self.meta_bytes, self.tensors = header.meta_bytes, packed
        self.checksum, self.mac = header.checksum, header.mac


def _placed(index: int, header: st.Header, target: Joined) -> Placed:
    meta = meta_codec.unpack(header.meta_bytes)
    if not isinstance(meta, dict):
        raise FormatError("record metadata is not a map")
    return Placed(index, meta, target.shapes(header.tensors), target, header.data_size)


def _read_hashed(fd: int, offset: int, cut: _Cut, kind: str) -> list[bytes]:
    """Fill the record's views from ``offset`` on, one ``preadv`` a group; hash each piece
    as soon as its group has landed (still in cache). A file cut short is a FormatError."""
    leaves: list[bytes] = []
    views, bounds, leaf = cut.views, cut.bounds, digests.leaf
    for i, j, size in cut.groups:
        _preadv_all(fd, views[bounds[i] : bounds[j]], offset)
        offset += size
        leaves += [leaf(kind, views[bounds[k] : bounds[k + 1]]) for k in range(i, j)]
    return leaves


def _preadv_all(fd: int, views: list[memoryview], offset: int) -> None:
    i, n_views = 0, len(views)
    while i < n_views:
        batch = views[i : i + _IOV_MAX]
        n = os.preadv(fd, batch, offset)
        if n == 0:
            raise FormatError("the file ends before its tensor bytes do (truncated)")
        offset += n
        for v in batch:  # skip the views filled whole; resume a partly filled one
            if n < len(v):
                break
            n -= len(v)
            i += 1
        if n:
            views = [*views[:i], views[i][n:], *views[i + 1 :]]


def _copy_in(
    path: Any,
    index: int,
    header: st.Header,
    target: Joined,
    segments: list[list[memoryview]],
    key: str | None,
    signer: Signer | None,
) -> Placed:
    """A format-1 record: read and verified whole, its bytes copied into their rows."""
    rec = reader.read_file(path, key=key, signer=signer)
    for t, segs in zip(header.tensors, segments, strict=True):
        arr = mx.contiguous(rec.arrays[t.name])
        mx.eval(arr)  # built and evaluated on this thread
        src, pos = _raw(arr), 0
        for seg in segs:
            seg[:] = src[pos : pos + len(seg)]
            pos += len(seg)
    return _placed(index, header, target)


__all__ = ["Joined", "NotJoinable", "Placed", "Shape", "Tables", "prepare", "read_into"]
