"""Record files -> Records, verified: two read paths, chosen by the record's size.

A format-2 record of ``PIECEWISE_MIN_BYTES`` or more is read in one pass: ``mx.load`` of a
stand-in file (tensor table only, no bytes) allocates the arrays from MLX's buffer cache
without filling them, then a pool of threads ``preadv``s each 256 KiB piece of each tensor
straight into its array's memory and hashes it right away (xxh3-128, or BLAKE3 with a
secret), on every core. A smaller one (most block records) is ``mx.load``ed and its pieces
hashed afterwards on every core; format-1 files are loaded and hashed in one sequential pass,
as before. docs/format.md, docs/performance.md.
"""

from __future__ import annotations

import atexit
import json
import os
import struct
import time
import weakref
from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx

from mlxcache.buffers import array_memoryview
from mlxcache.errors import FormatError
from mlxcache.records import digests
from mlxcache.records import format as st
from mlxcache.records.record import Record
from mlxcache.records.signing import Signer


def read_header(path: str | os.PathLike) -> st.Header:
    """Read only the header of a record file (cheap: tensor bytes stay on disk)."""
    with open(path, "rb", buffering=0) as f:
        return st._with_meta(_header_of_fd(f.fileno()))


def _header_of_fd(fd: int) -> st.Header:
    """The checked header of an open record file (metadata not decoded)."""
    size = os.fstat(fd).st_size
    first = os.pread(fd, 8, 0)
    n = st._header_length(first)
    if size < 8 + n:
        raise FormatError(f"header length {n} does not fit the file ({size} bytes)")
    return st._parse_header(first + os.pread(fd, n, 8), total_size=size)


def read_file(
    path: str | os.PathLike, *, key: str | None = None, signer: Signer | None = None
) -> Record:
    """Load and verify a record file.

    The checksum (with a ``signer``: the MAC for ``key``) is verified over the bytes read,
    and every array is checked against the header (shape, dtype, byte size). A file that
    cannot be opened or read raises OSError; anything wrong in it is a FormatError.
    """
    with open(path, "rb", buffering=0) as f:
        header = _header_of_fd(f.fileno())
        if any(t.dtype in st._NOT_MX_LOADABLE for t in header.tensors):
            f.seek(0)
            return st.from_bytes(f.read(), key=key, signer=signer)
        if header.version == 1 or header.data_size < PIECEWISE_MIN_BYTES:
            return _read_loaded(path, header, key, signer)
        arrays = _read_pieces(f.fileno(), header, key, signer)
    return st._record(arrays, st._with_meta(header).meta)


# Format 2 records of at least this many tensor bytes are read piece by piece into arrays a
# stand-in load allocated (one pass, each piece hashed in cache); smaller ones by ``mx.load``
# and a parallel hash of the loaded pieces. Measured on 2 cores (docs/performance.md): 58.7 MB
# 10.7 against 16-22 ms, 470 MB 77-79 against 66-72 ms.
PIECEWISE_MIN_BYTES = 256 << 20
# bytes one reader job reads in one call and then hashes piece by piece (a multiple of PIECE):
# fewer, larger reads, and a thread gives up the GIL once a run, not once a piece (issue 28)
RUN_BYTES = 32 * digests.PIECE


def _read_pieces(
    fd: int, header: st.Header, key: str | None, signer: Signer | None
) -> dict[str, mx.array]:
    """Format 2: every piece read into its array and hashed in the same job; then verified."""
    arrays = dict(zip((t.name for t in header.tensors), blank_arrays(header.tensors), strict=True))
    jobs: list[tuple[memoryview, int]] = []  # runs of whole pieces: one pread, then hashed
    for t in header.tensors:  # the order of digests.pieces: tensors by offset, each cut every PIECE
        if t.end == t.begin:
            continue
        view = array_memoryview(arrays[t.name]).cast("B")
        start = header.data_offset + t.begin
        jobs += [(view[i : i + RUN_BYTES], start + i) for i in range(0, len(view), RUN_BYTES)]
    first = digests.SUM if signer is None else digests.MAC

    def read_and_hash(job: tuple[memoryview, int]) -> list[bytes]:
        _pread_into(fd, *job)
        run = job[0]
        return [
            digests.leaf(first, [run[i : i + digests.PIECE]])
            for i in range(0, len(run), digests.PIECE)
        ]

    got = [d for run in digests.pmap(read_and_hash, jobs, header.data_size) for d in run]

    def leaves(kind: str) -> Sequence[bytes]:
        if kind == first:
            return got
        pieces = [
            run[i : i + digests.PIECE] for run, _ in jobs for i in range(0, len(run), digests.PIECE)
        ]
        return digests.pmap(lambda p: digests.leaf(kind, [p]), pieces, header.data_size)

    digests.verify_leaves(header, leaves, key, signer)
    for t in header.tensors:
        st._check_array(t, arrays[t.name])
    return arrays


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` from ``offset``; a file cut short since its size was checked is corrupt."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise FormatError("the file ends before its tensor bytes do (truncated)")
        done += n


class _Blank:
    """A stand-in safetensors file with the record's tensor table, whose bytes are never read.

    ``mx.load`` of it allocates each array (reusing MLX's buffer cache, as a real load does)
    and asks us to fill it; we leave it as is, to be filled straight from the record file.
    """

    closed = False

    def __init__(self, tensors: Sequence[st.TensorInfo]) -> None:
        table, offset = {}, 0
        for i, t in enumerate(tensors):  # by index: a record's names never reach MLX's parser
            n = t.end - t.begin
            spec = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
            table[str(i)] = spec
            offset += n
        text = json.dumps(table).encode()
        text += b" " * (-len(text) % 8)
        self._head = struct.pack("<Q", len(text)) + text
        self._size = len(self._head) + offset
        self._pos = 0

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset + (0, self._pos, self._size)[whence]
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        if self._pos < len(self._head):
            part = self._head[self._pos : self._pos + len(view)]
            view[: len(part)] = part
        self._pos += len(view)
        return len(view)


# Stand-ins MLX still holds. Its I/O threads drop them a moment after a load returns, and a
# thread that needs the GIL once the interpreter is finalizing aborts the whole process
# ("terminate called without an active exception"), so exit waits for them first.
_held: weakref.WeakSet[_Blank] = weakref.WeakSet()


@atexit.register
def _wait_for_stand_ins(timeout: float = 2.0) -> None:
    """Let MLX's I/O threads release every stand-in while they may still take the GIL."""
    deadline = time.monotonic() + timeout
    while len(_held) and time.monotonic() < deadline:
        time.sleep(0.001)


def blank_arrays(tensors: Sequence[st.TensorInfo]) -> list[mx.array]:
    """Evaluated, unfilled arrays of these dtypes and shapes (no pass over their memory)."""
    if not tensors:
        return []
    blank = _Blank(tensors)
    _held.add(blank)
    # a file-like stand-in is what mx.load reads; its stub names only BinaryIO, str and Path
    loaded = cast(
        "dict[str, mx.array]",
        mx.load(blank, format="safetensors"),  # type: ignore[arg-type]
    )
    del blank  # ours goes now; MLX's references go on its I/O threads
    out = [loaded[str(i)] for i in range(len(tensors))]
    mx.eval(out)
    return out


def _read_loaded(
    path: str | os.PathLike, header: st.Header, key: str | None, signer: Signer | None
) -> Record:
    """``mx.load`` straight into arrays, then the hash over their bytes: format 1's one
    sequential pass, or format 2's pieces spread over the cores (the faster read below
    ``PIECEWISE_MIN_BYTES``, where the stand-in's per-tensor cost outweighs a second pass)."""
    try:
        loaded = mx.load(str(path)) if header.tensors else {}
        if not isinstance(loaded, dict) or set(loaded) != {t.name for t in header.tensors}:
            raise FormatError("the file's tensors differ from its header")
        arrays = {t.name: loaded[t.name] for t in header.tensors}
        mx.eval(list(arrays.values()))
    except (RuntimeError, ValueError) as exc:
        if not isinstance(exc, FormatError):
            os.close(os.open(path, os.O_RDONLY))  # still openable: the contents are bad
            exc = FormatError(f"unreadable tensor data: {exc}")
        raise exc from None
    for t in header.tensors:
        st._check_array(t, arrays[t.name])
    views = [_raw_view(arrays[t.name]) for t in header.tensors]
    if header.version == 1:
        digests.verify(header, lambda: iter(views), key, signer)
    else:
        digests.verify_views(header, views, key, signer)
    return st._record(arrays, st._with_meta(header).meta)


def _raw_view(a: mx.array) -> memoryview:
    return array_memoryview(a).cast("B") if a.nbytes else memoryview(b"")


__all__ = ["read_file", "read_header"]
