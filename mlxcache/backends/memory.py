"""In-process backend: an OrderedDict LRU with a byte budget. Nothing survives the process."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any
from urllib.parse import SplitResult

import mlx.core as mx

from mlxcache import meta as meta_codec
from mlxcache.backends.base import BackendBase, Counters, check_key, check_record, log
from mlxcache.options import Options
from mlxcache.record import Record


def detached(record: Record) -> Record:
    """A Record of new array objects over the same data, with its own copy of ``meta``.

    MLX arrays are immutable values, but a cache's slice assignment rewrites the *object* it
    holds; a new object per array (O(1), no data copy) keeps such writes on either side from
    reaching the other.
    """
    arrays = {name: a[...] for name, a in record.arrays.items()}
    return Record(arrays=arrays, meta=meta_codec.unpack(meta_codec.pack(dict(record.meta))))


class MemoryBackend(BackendBase):
    """LRU over ``max_bytes`` (tensor bytes, once per key) and ``max_entries``; thread-safe."""

    def __init__(self, max_bytes: int | None = None, max_entries: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._data: OrderedDict[str, tuple[Record, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.RLock()
        self._counters = Counters()

    def get(self, key: str) -> Record | None:
        check_key(key)
        with self._lock:
            item = self._data.get(key)
            if item is None:
                self._counters.add("misses")
                return None
            self._data.move_to_end(key)
            self._counters.add("hits")
            return detached(item[0])

    def put(self, key: str, record: Record) -> None:
        check_key(key)
        check_record(record)
        size = record.nbytes
        if self.max_entries == 0 or self.max_bytes == 0:
            return
        if self.max_bytes is not None and size > self.max_bytes:
            log.warning(
                "memory cache: refusing %r (%d bytes) larger than max_bytes=%d",
                key, size, self.max_bytes,
            )  # fmt: skip
            return
        stored = detached(record)
        mx.eval(list(stored.arrays.values()))
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._data[key] = (stored, size)
            self._bytes += size
            self._evict()

    def _evict(self) -> None:
        while self._data and (
            (self.max_bytes is not None and self._bytes > self.max_bytes)
            or (self.max_entries is not None and len(self._data) > self.max_entries)
        ):
            _, (_, size) = self._data.popitem(last=False)
            self._bytes -= size
            self._counters.add("evictions")

    def delete(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            old = self._data.pop(key, None)
            if old is None:
                return False
            self._bytes -= old[1]
            return True

    def __contains__(self, key: object) -> bool:
        check_key(key)
        with self._lock:
            return key in self._data

    def keys(self, prefix: str = "") -> Iterator[str]:
        with self._lock:
            found = [k for k in self._data if k.startswith(prefix)]
        return iter(found)

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "backend": "memory",
                "entries": len(self._data),
                "bytes": self._bytes,
                "max_bytes": self.max_bytes,
                "max_entries": self.max_entries,
                **self._counters.snapshot(),
            }

    def close(self) -> None:
        """Nothing to release; the data stays readable until the object is dropped."""

    def __repr__(self) -> str:
        return f"MemoryBackend(entries={len(self._data)}, bytes={self._bytes})"


def from_uri(url: SplitResult, opts: Options) -> MemoryBackend:
    """``memory://?max_bytes=2GiB&max_entries=1000``."""
    if url.netloc or url.path not in ("", "/"):
        raise ValueError(f"memory:// takes no host or path, got {url.geturl()!r}")
    max_bytes = opts.size("max_bytes", None)
    max_entries = opts.int("max_entries", None)
    opts.done()
    return MemoryBackend(max_bytes=max_bytes, max_entries=max_entries)
