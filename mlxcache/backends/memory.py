"""In-process backend: an OrderedDict LRU with a byte budget. Nothing survives the process."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any
from urllib.parse import SplitResult

import mlx.core as mx

from mlxcache import meta as meta_codec
from mlxcache import signing
from mlxcache.backends.base import BackendBase, check_budget
from mlxcache.options import Options, redact_uri
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
    """LRU over ``max_bytes`` (tensor bytes, once per key) and ``max_entries``; thread-safe.

    Not persistent: it keeps records (new array objects over the same data) in this process.
    """

    scheme = "memory"
    persistent = False

    def __init__(self, max_bytes: int | None = None, max_entries: int | None = None) -> None:
        super().__init__(max_bytes=max_bytes)
        self.max_entries = check_budget("max_entries", max_entries)
        self._data: OrderedDict[str, tuple[Record, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.RLock()

    def _refuses_all(self) -> bool:
        return self.max_entries == 0

    def _prepare(self, key: str, record: Record) -> tuple[Record, int]:
        stored = detached(record)
        mx.eval(list(stored.arrays.values()))
        return stored, record.nbytes

    def _put(self, key: str, payload: Record, size: int) -> int:
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._data[key] = (payload, size)
            self._bytes += size
            return self._evict(self.max_bytes, self.max_entries)

    def _evict(self, max_bytes: int | None, max_entries: int | None) -> int:
        evicted = 0
        while self._data and (
            (max_bytes is not None and self._bytes > max_bytes)
            or (max_entries is not None and len(self._data) > max_entries)
        ):
            _, (_, size) = self._data.popitem(last=False)
            self._bytes -= size
            evicted += 1
        return evicted

    def _trim(self, max_bytes: int) -> int:
        with self._lock:
            return self._evict(max_bytes, None)

    def _get_many(self, keys: list[str]) -> list[Record | None]:
        out: list[Record | None] = []
        with self._lock:
            for key in keys:
                item = self._data.get(key)
                if item is not None:
                    self._data.move_to_end(key)
                out.append(None if item is None else detached(item[0]))
        return out

    def _touch_many(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                if key in self._data:
                    self._data.move_to_end(key)

    def _delete(self, key: str) -> bool:
        with self._lock:
            old = self._data.pop(key, None)
            if old is None:
                return False
            self._bytes -= old[1]
            return True

    def _contains_many(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [k in self._data for k in keys]

    def _keys(self, prefix: str) -> list[str]:
        with self._lock:
            return [k for k in self._data if k.startswith(prefix)]

    def _count(self) -> int:
        return len(self._data)

    def _clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0

    def _stats(self) -> dict[str, Any]:
        with self._lock:
            return {"entries": len(self._data), "bytes": self._bytes}

    def describe(self) -> dict[str, Any]:
        return {"max_entries": self.max_entries}

    def __repr__(self) -> str:
        return f"MemoryBackend(entries={len(self._data)}, bytes={self._bytes})"


def from_uri(url: SplitResult, opts: Options) -> MemoryBackend:
    """``memory://?max_bytes=2GiB&max_entries=1000``.

    ``secret_env=NAME`` is accepted (and must name a set variable) so one URI template serves
    every scheme; records never leave this process, so there is nothing to sign or verify.
    """
    if url.netloc or url.path not in ("", "/"):
        raise ValueError(f"memory:// takes no host or path, got {redact_uri(url.geturl())!r}")
    max_bytes = opts.size("max_bytes", None)
    max_entries = opts.int("max_entries", None)
    secret_env = opts.str("secret_env", None)
    if secret_env is not None:
        signing.resolve(secret_env)
    opts.done()
    return MemoryBackend(max_bytes=max_bytes, max_entries=max_entries)
