"""file:// reads of a run of records straight into joined arrays (``get_joined``).

A prefix restore reads many block records and joins them on axis -2. Here the index is asked
once for every file (the blocks' and those of the records read whole with them: a tail, a
vision entry; all touched in one update), the first record's header is read on the caller's
thread (it sizes the final arrays, see :class:`mlxcache.records.gather.Joined`), then every
record on the reader pool, each file ``preadv``ed into its rows and verified (checksum, or MAC
with a secret) as its pieces land. Files are read through the backend's bounded cache of open
descriptors (``descriptors.py``): a repeated restore opens none of them again. A corrupt or
forged file is handled as by ``get``: a miss, unindexed and quarantined (its descriptor
closed); a record that does not fit the join (another layout) is a quiet miss and stays.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from mlxcache.backends.base import check_key
from mlxcache.records import digests, gather
from mlxcache.records.gather import Joined, Placed
from mlxcache.records.record import Record

_MISFIT = object()  # a record read_into refused before writing anything (NotJoinable)


class JoinMixin:
    """``get_joined`` for :class:`~mlxcache.backends.disk.DiskBackend` (uses its index and
    ``_load``, which follows a concurrent re-put and quarantines unreadable files)."""

    joins = True  # what the prefix cache asks before calling get_joined
    # DiskBackend's, from its other bases (annotations only: the MRO finds the real ones)
    _data: Any
    _lookup: Any
    _load: Any
    _touch: Any
    error: Any
    signer: Any
    latency: Any
    _guard: Any
    _counters: Any
    _maybe_flush: Any
    _fds: Any

    def get_joined(
        self, keys: list[str], target: Joined, more: Sequence[str] = ()
    ) -> list[Placed | Record | None]:
        """Records of ``keys`` read into rows ``0..len(keys)-1`` of ``target``, verified, in
        order, then the records of ``more`` read whole (as ``get_many``: a tail, a vision
        entry), all from one index query and one access-time update; None for each miss.
        Counted as ``get_many`` counts (hits, misses, bytes)."""
        keys = [check_key(k) for k in keys]
        more = [check_key(k) for k in more]
        n = len(keys) + len(more)
        if not n:
            return []
        with self.latency.timer("get"):
            out = self._guard("get", [None] * n, self._get_joined, keys, target, more, n=n)
        found = [p for p in out if p is not None]
        self._counters.add("hits", len(found))
        self._counters.add("misses", n - len(found))
        self._counters.add("bytes_read", sum(p.nbytes for p in found))
        self._maybe_flush()
        return out

    def _get_joined(
        self, keys: list[str], target: Joined, more: list[str]
    ) -> list[Placed | Record | None]:
        files = self._lookup(keys + more)
        got: list[tuple[Placed | Record | None, str | None]] = []
        if keys[0] in files:  # else the run ends before its first record
            got += self._read_joined(keys, target, files)
        got = got or [(None, None)] * len(keys)
        got += [self._read_whole(k, files.get(k)) for k in more]
        pairs = zip(keys + more, got, strict=True)
        self._touch([(k, f) for k, (p, f) in pairs if p is not None and f])
        return [p for p, _ in got]

    def _read_whole(self, key: str, file: str | None) -> tuple[Record | None, str | None]:
        try:
            record: Record | None
            record, file = self._load(key, file)
        except sqlite3.Error as exc:
            self.error("get", exc)
            return None, None
        return record, file

    def _read_joined(
        self, keys: list[str], target: Joined, files: dict[str, str]
    ) -> list[tuple[Placed | None, str | None]]:
        """Each of ``keys`` read into its rows (the first one's file is indexed), with the file
        it was read from; an empty list when the run ends before its first record."""
        tables = gather.Tables()
        skip = len(str(self._data)) + 1  # a data file's name is its path after this

        def one(i: int) -> tuple[Placed | None, str | None]:
            key = keys[i]

            def read(path: Any) -> Any:
                try:
                    with self._fds.borrow(str(path)[skip:], path) as fd:
                        return gather.read_into(
                            path, i, target, tables, key=key, signer=self.signer, fd=fd
                        )
                except gather.NotJoinable:
                    return _MISFIT

            try:
                placed, file = self._load(key, files.get(key), read)
            except sqlite3.Error as exc:
                self.error("get", exc)
                return None, None
            return (None, None) if placed is _MISFIT else (placed, file)

        try:  # the arrays are allocated here, on this thread, from the first header
            with self._fds.borrow(files[keys[0]], self._data / files[keys[0]]) as fd:
                gather.prepare(self._data / files[keys[0]], target, tables, fd=fd)
            ready = True
        except Exception:  # reading the first record below says why (a miss, or quarantine)
            ready = False
        if ready:
            got = digests.pmap(one, list(range(len(keys))), 1 << 30, pool="read")
        else:
            got = [one(0)]  # fails as the header did, or allocates once a re-put is seen
            if got[0][0] is None:  # the run ends before its first record: nothing is used
                return []
            got += digests.pmap(one, list(range(1, len(keys))), 1 << 30, pool="read")
        target.release()
        return got
