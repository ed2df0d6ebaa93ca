"""A third-party backend as a plugin author would write it: one module, one entry point.

``dict://`` keeps each record as its serialized bytes in a dict of this process. It is
registered through the ``mlxcache.backends`` entry point (see the .dist-info beside it), not
by mlxcache itself, and runs the whole backend contract suite.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from urllib.parse import SplitResult

from mlxcache.backends.base import BackendBase
from mlxcache.options import Options
from mlxcache.records import format as fmt
from mlxcache.records.record import Record


class DictBackend(BackendBase):
    """Serialized records in an LRU dict; only the raw operations, the base does the rest."""

    scheme = "dict"

    def __init__(self, max_bytes: int | None = None) -> None:
        super().__init__(max_bytes=max_bytes)
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def _prepare(self, key: str, record: Record) -> tuple[bytes, int]:
        blob = fmt.to_bytes(record)
        return blob, len(blob)

    def _put(self, key: str, payload: bytes, size: int) -> int:
        with self._lock:
            self._data.pop(key, None)
            self._data[key] = payload
        return 0 if self.max_bytes is None else self._trim(self.max_bytes)

    def _get_many(self, keys: list[str]) -> list[Record | None]:
        with self._lock:
            blobs = [self._data.get(k) for k in keys]
            for k, blob in zip(keys, blobs, strict=True):
                if blob is not None:
                    self._data.move_to_end(k)
        return [None if b is None else fmt.from_bytes(b) for b in blobs]

    def _contains_many(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [k in self._data for k in keys]

    def _delete(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None

    def _keys(self, prefix: str) -> list[str]:
        with self._lock:
            return [k for k in self._data if k.startswith(prefix)]

    def _count(self) -> int:
        return len(self._data)

    def _clear(self) -> None:
        with self._lock:
            self._data.clear()

    def _stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._data), "bytes": sum(map(len, self._data.values()))}

    def _trim(self, max_bytes: int) -> int:
        evicted = 0
        with self._lock:
            total = sum(map(len, self._data.values()))
            while self._data and total > max_bytes:
                _, blob = self._data.popitem(last=False)
                total -= len(blob)
                evicted += 1
        return evicted


def from_uri(url: SplitResult, opts: Options) -> DictBackend:
    max_bytes = opts.size("max_bytes", None)
    opts.done()
    return DictBackend(max_bytes=max_bytes)
