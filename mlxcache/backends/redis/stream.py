"""Streaming a large Redis value into its arrays: bounded memory, verified before it is returned.

A value larger than :data:`FIRST_READ` is not fetched with one ``GET`` (redis-py would hold the
whole reply, and its parser's buffer, beside the decoded arrays: 2-3x the value). Its first
bytes come with the first round trip; the arrays are then allocated from the header and the
rest arrives as ``GETRANGE`` slices of :data:`SLICE` bytes on one connection, :data:`WINDOW`
commands in flight, each slice copied into the arrays and hashed before the next is read. The
checksum (or MAC) is checked over the whole record before it is returned; a slice that comes
back short (a chunk evicted, the value deleted or replaced mid-read) raises :class:`Vanished`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import redis
from redis._parsers import _HiredisParser
from redis.connection import DefaultParser

from mlxcache.buffers import array_memoryview
from mlxcache.errors import FormatError, UntrustedRecordError
from mlxcache.records import digests
from mlxcache.records import format as st
from mlxcache.records.digests import verify
from mlxcache.records.record import Record
from mlxcache.records.signing import Signer

SLICE = 1 << 20  # bytes per GETRANGE: the reply and the parser's buffer are all we hold
WINDOW = 16  # GETRANGEs in flight (16 MiB) with hiredis: the link never idles
FIRST_READ = SLICE  # bytes of every value read in the first round trip (smaller: whole)

# the dtype an array is allocated in (and viewed as its real dtype once filled), see format.py
_CARRIERS = {"BF16": mx.uint16, "F64": mx.uint64}


class Vanished(Exception):
    """Part of a value was missing or shorter than its size when read (changed under us)."""


@dataclass
class Source:
    """A value too large to read whole: where its bytes are, and its first bytes (``head``).

    ``keys``/``sizes`` are the Redis strings that hold the blob in order (the value key, or
    the chunk keys of a manifest); ``seen`` is what the value key held when it was read
    (its head, or the manifest), to tell a value replaced mid-read from a corrupt one.
    """

    client: redis.Redis
    keys: list[str]
    sizes: list[int]
    head: bytes
    seen: bytes
    watch: bool = False  # one value key, which a writer can SET in place (chunks: never)

    @property
    def size(self) -> int:
        return sum(self.sizes)


def ranges(sizes: list[int], start: int, stop: int, step: int) -> Iterator[tuple[int, int, int]]:
    """``(segment, lo, hi)`` pieces of at most ``step`` bytes covering blob bytes [start, stop)."""
    base = 0
    for i, n in enumerate(sizes):
        lo, hi = max(start, base), min(stop, base + n)
        while lo < hi:
            end = min(hi, lo + step)
            yield i, lo - base, end - base
            lo = end
        base += n


def slices(src: Source, start: int, stop: int, guard: bytes = b"") -> Iterator[bytes]:
    """Blob bytes [start, stop) as pipelined GETRANGE replies, at most ``WINDOW`` in flight.

    With a ``guard`` (the header bytes read before) the value key is WATCHed first and its
    header read again, and a MULTI/EXEC follows the last slice: a value rewritten before or
    during the read (even with the same size, or back to what it was) raises Vanished. One
    pooled connection is taken on the first ``next()``; a consumer that stops early (or an
    error) leaves replies unread, so the connection is then closed rather than pooled.
    """
    todo: list[tuple[tuple, int]] = []  # (command, bytes expected: -1 none, -2 EXEC)
    if guard:
        todo += [(("WATCH", src.keys[0]), -1), (("GETRANGE", src.keys[0], 0, len(guard) - 1), -1)]
    todo += [
        (("GETRANGE", src.keys[i], lo, hi - 1), hi - lo)
        for i, lo, hi in ranges(src.sizes, start, stop, SLICE)
    ]
    if guard:
        todo += [(("MULTI",), -1), (("EXEC",), -2)]
    if not todo:
        return
    pool = src.client.connection_pool
    window = WINDOW if _hiredis(pool) else 1
    conn = _connection(pool)
    sent = got = 0
    clean = False
    try:
        while got < len(todo):
            if sent - got <= window // 2 and sent < len(todo):  # refill: replies keep coming
                batch = todo[sent : got + window]
                conn.send_packed_command(conn.pack_commands([c for c, _ in batch]))
                sent += len(batch)
            try:
                reply = conn.read_response()
            except redis.ResponseError as exc:  # e.g. the key now holds another type
                raise Vanished(f"reading a slice: {exc}") from None
            cmd, expect = todo[got]
            got += 1
            if expect >= 0:
                if not isinstance(reply, bytes) or len(reply) != expect:
                    raise Vanished(f"{cmd[1]!r} has fewer bytes than its size")
                yield reply
            elif cmd[0] == "GETRANGE" and reply != guard:
                raise Vanished("the value was replaced before it was read")
            elif expect == -2 and reply is None:
                raise Vanished("the value was written while it was read")
            del reply  # only the slice being copied is held while the next one arrives
        clean = True
    finally:
        if not clean:
            conn.disconnect()
        pool.release(conn)


def _connection(pool: redis.ConnectionPool) -> Any:
    """A pooled connection (redis-py < 5.3 needs a command name, >= 5.3 warns about one)."""
    try:
        return pool.get_connection()
    except TypeError:
        return pool.get_connection("GETRANGE")


def _hiredis(pool: redis.ConnectionPool) -> bool:
    """Whether replies are parsed by hiredis. redis-py's own parser frees its buffer only once
    it has read all it received: with replies in flight it would grow to the whole value, so
    it gets one slice at a time (one round trip per slice)."""
    parser = pool.connection_kwargs.get("parser_class") or DefaultParser
    return isinstance(parser, type) and issubclass(parser, _HiredisParser)


class _Filler:
    """Writes consecutive bytes across the destination arrays' buffers, in blob order."""

    def __init__(self, views: list[memoryview]) -> None:
        self.views = [v for v in views if len(v)]
        self.i = self.off = 0

    def write(self, data: memoryview) -> Iterator[memoryview]:
        """Copy ``data`` in; yields each destination piece written (hashed while in cache)."""
        while len(data):
            if self.i == len(self.views):
                raise FormatError("more tensor bytes than the header says")
            dest = self.views[self.i]
            n = min(len(dest) - self.off, len(data))
            piece = dest[self.off : self.off + n]
            piece[:] = data[:n]
            yield piece
            data = data[n:]
            self.off += n
            if self.off == len(dest):
                self.i, self.off = self.i + 1, 0

    @property
    def full(self) -> bool:
        return self.i == len(self.views)


def _allocate(t: st.TensorInfo) -> tuple[mx.array, memoryview]:
    """A new evaluated array for tensor ``t`` and a writable byte view of its buffer."""
    dtype = _CARRIERS.get(t.dtype, st._BY_NAME[t.dtype][0])
    a = mx.zeros(t.shape, dtype=dtype)
    mx.eval(a)
    if a.nbytes == 0:
        return a, memoryview(bytearray())
    view = array_memoryview(a).cast("B")
    if view.readonly or not view.c_contiguous or view.nbytes != t.end - t.begin:
        raise RuntimeError(f"MLX gave no writable buffer for {t.name!r:.80}")
    return a, view


def _header(src: Source) -> tuple[st.Header, bytes]:
    """The parsed header (metadata not yet decoded) and the blob bytes read so far."""
    head = src.head
    while (need := st.header_bytes_needed(head)) > len(head):  # a header over the first read
        if need > src.size:
            raise FormatError(f"header of {need} bytes does not fit the {src.size}-byte value")
        head = b"".join([head, *slices(src, len(head), need)])  # (twice if under 8 bytes)
    return st._parse_header(head, total_size=src.size), head


def decode(src: Source, *, key: str, signer: Signer | None) -> Record:
    """Stream ``src`` into new arrays and verify them; FormatError/Vanished when it fails."""
    header, head = _header(src)
    allocated = [_allocate(t) for t in header.tensors]  # sorted by offset: blob order
    views = [v for _, v in allocated]
    fill = _Filler(views)
    base = header.data_offset

    passes = [0]

    def stream() -> Iterator[memoryview]:
        passes[0] += 1
        if passes[0] > 1:  # a second pass (verify naming the cause of a failed MAC)
            yield from fill.views
            return
        yield from fill.write(memoryview(head)[base:])
        guard = head[:base] if src.watch else b""  # one key, rewritable: watch it
        for piece in slices(src, max(len(head), base), src.size, guard):
            yield from fill.write(memoryview(piece))
            del piece
        if not fill.full:
            raise FormatError("fewer tensor bytes than the header says")

    if header.version == 1:
        verify(header, stream, key, signer)  # hashes each slice as it lands in the arrays
    else:
        _verify_pieces(header, views, stream, key, signer)
    if not fill.full:  # never return arrays whose bytes were not all read and hashed
        raise FormatError("the record's bytes were not all verified")
    header = st._with_meta(header)
    arrays: dict[str, mx.array] = {}
    for t, (a, _) in zip(header.tensors, allocated, strict=True):
        arrays[t.name] = a.view(st._BY_NAME[t.dtype][0]) if t.dtype in _CARRIERS else a
    del views, allocated
    mx.eval(list(arrays.values()))
    for t in header.tensors:
        st._check_array(t, arrays[t.name])
    return st._record(arrays, header.meta)


def _verify_pieces(
    header: st.Header,
    views: list[memoryview],
    stream: Callable[[], Iterator[memoryview]],
    key: str,
    signer: Signer | None,
) -> None:
    """Format 2: each 256 KiB piece hashed as soon as its last byte lands, then verified."""
    if signer is not None and header.mac is None:  # refused before its tensors are fetched
        raise UntrustedRecordError("unsigned record: this cache accepts only signed records")
    ranges = digests.pieces(header.tensors)
    begins = [t.begin for t in header.tensors]

    def view(lo: int, hi: int) -> memoryview:  # a piece never crosses a tensor
        i = bisect.bisect_right(begins, lo) - 1
        while header.tensors[i].end <= lo:  # skip empty tensors that begin at lo too
            i += 1
        t = header.tensors[i]
        return views[i][lo - t.begin : hi - t.begin]

    first = digests.SUM if signer is None else digests.MAC
    got: list[bytes] = []
    pos = 0
    for piece in stream():
        pos += len(piece)
        while len(got) < len(ranges) and ranges[len(got)][1] <= pos:
            got.append(digests.leaf(first, [view(*ranges[len(got)])]))

    def leaves(kind: str) -> Sequence[bytes]:
        if kind == first:
            return got
        return [digests.leaf(kind, [view(lo, hi)]) for lo, hi in ranges]

    digests.verify_leaves(header, leaves, key, signer)
