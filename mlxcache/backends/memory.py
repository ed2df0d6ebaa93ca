"""In-process backend: an OrderedDict LRU with a byte budget. Nothing survives the process."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any
from urllib.parse import SplitResult

import mlx.core as mx

from mlxcache.backends import clock
from mlxcache.backends.base import BackendBase, check_budget, log
from mlxcache.backends.clock import check_lifetime, lifetime_options
from mlxcache.options import Options, redact_uri
from mlxcache.records import meta as meta_codec
from mlxcache.records import signing
from mlxcache.records.record import Record


def detached(record: Record) -> Record:
    """A Record of new array objects over the same data, with its own copy of ``meta``.

    MLX arrays are immutable values, but a cache's slice assignment rewrites the *object* it
    holds; a new object per array (O(1), no data copy) keeps such writes on either side from
    reaching the other.
    """
    arrays = {name: a[...] for name, a in record.arrays.items()}
    return Record(arrays=arrays, meta=meta_codec.unpack(meta_codec.pack(dict(record.meta))))


class _Entry:
    __slots__ = ("record", "size", "born", "used", "pinned")

    def __init__(self, record: Record, size: int, now: float) -> None:
        self.record, self.size, self.born, self.used, self.pinned = record, size, now, now, False


class MemoryBackend(BackendBase):
    """LRU over ``max_bytes`` (tensor bytes, once per key) and ``max_entries``; thread-safe.

    Not persistent: it keeps records (new array objects over the same data) in this process.
    ``ttl`` / ``idle_ttl`` (seconds after the put / since the last read) make entries expire
    on :mod:`mlxcache.backends.clock`; expired entries are misses and are dropped lazily.
    Pinned entries (:meth:`pin`) are never evicted nor expire; they count against
    ``pin_max_bytes`` (default: ``max_bytes``), not ``max_bytes``.
    """

    scheme = "memory"
    persistent = False
    pinnable = True

    def __init__(
        self,
        max_bytes: int | None = None,
        max_entries: int | None = None,
        *,
        ttl: float | None = None,
        idle_ttl: float | None = None,
        pin_max_bytes: int | None = None,
    ) -> None:
        super().__init__(max_bytes=max_bytes)
        self.max_entries = check_budget("max_entries", max_entries)
        self.ttl = check_lifetime("ttl", ttl)
        self.idle_ttl = check_lifetime("idle_ttl", idle_ttl)
        pin_max = check_budget("pin_max_bytes", pin_max_bytes)
        self.pin_max_bytes = max_bytes if pin_max is None else pin_max
        self._data: OrderedDict[str, _Entry] = OrderedDict()  # unpinned, least recent first
        self._pins: dict[str, _Entry] = {}
        self._bytes = 0  # of unpinned entries
        self._pin_bytes = 0
        self._lock = threading.RLock()

    def _refuses_all(self) -> bool:
        return self.max_entries == 0

    def _expired(self, e: _Entry, now: float) -> bool:
        return not e.pinned and (
            (self.ttl is not None and now - e.born >= self.ttl)
            or (self.idle_ttl is not None and now - e.used >= self.idle_ttl)
        )

    def _sweep(self) -> int:
        """Drop expired entries (lock held); returns how many."""
        if self.ttl is None and self.idle_ttl is None:
            return 0
        now = clock.now()
        gone = [k for k, e in self._data.items() if self._expired(e, now)]
        for k in gone:
            self._bytes -= self._data.pop(k).size
        return len(gone)

    def _live(self, key: str, now: float) -> _Entry | None:
        e = self._pins.get(key) or self._data.get(key)
        if e is not None and self._expired(e, now):
            self._bytes -= self._data.pop(key).size
            return None
        return e

    def _prepare(self, key: str, record: Record) -> tuple[Record, int]:
        stored = detached(record)
        mx.eval(list(stored.arrays.values()))
        return stored, record.nbytes

    def _put(self, key: str, payload: Record, size: int) -> int:
        with self._lock:
            self._sweep()
            entry = _Entry(payload, size, clock.now())
            old = self._pins.get(key)
            if old is not None:  # a pinned key stays pinned if its new size fits
                if self.pin_max_bytes is None or self._pin_bytes - old.size + size <= (
                    self.pin_max_bytes
                ):
                    entry.pinned = True
                    self._pins[key] = entry
                    self._pin_bytes += size - old.size
                    return 0
                del self._pins[key]
                self._pin_bytes -= old.size
                log.warning("memory cache: unpinned %r: its new size exceeds pin_max_bytes", key)
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= old.size
            self._data[key] = entry
            self._bytes += size
            return self._evict(self.max_bytes, self.max_entries)

    def _evict(self, max_bytes: int | None, max_entries: int | None) -> int:
        evicted = 0
        while self._data and (
            (max_bytes is not None and self._bytes > max_bytes)
            or (max_entries is not None and len(self._data) > max_entries)
        ):
            _, e = self._data.popitem(last=False)
            self._bytes -= e.size
            evicted += 1
        return evicted

    def _trim(self, max_bytes: int) -> int:
        with self._lock:
            self._sweep()
            return self._evict(max_bytes, None)

    def _use(self, keys: list[str]) -> list:
        """The live entries of ``keys`` (None where missing), marked as just used."""
        now = clock.now()
        found = []
        for key in keys:
            e = self._live(key, now)
            if e is not None:
                e.used = now
                if not e.pinned:
                    self._data.move_to_end(key)
            found.append(e)
        return found

    def _get_many(self, keys: list[str]) -> list[Record | None]:
        with self._lock:
            return [None if e is None else detached(e.record) for e in self._use(keys)]

    def _touch_many(self, keys: list[str]) -> None:
        with self._lock:
            self._use(keys)

    def _pin(self, key: str, on: bool) -> bool:
        with self._lock:
            e = self._live(key, clock.now())
            if e is None or e.pinned == on:
                return e is not None and on
            if on:
                if self.pin_max_bytes is not None and self._pin_bytes + e.size > self.pin_max_bytes:
                    log.warning(
                        "memory cache: not pinning %r (%d bytes): pins hold %d of "
                        "pin_max_bytes=%d", key, e.size, self._pin_bytes, self.pin_max_bytes,
                    )  # fmt: skip
                    return False
                del self._data[key]
                self._bytes -= e.size
                self._pins[key] = e
                self._pin_bytes += e.size
            else:
                del self._pins[key]
                self._pin_bytes -= e.size
                e.used = e.born = clock.now()  # lifetimes restart at an unpin
                self._data[key] = e
                self._bytes += e.size
                self._counters.add("evictions", self._evict(self.max_bytes, self.max_entries))
            e.pinned = on
            return True

    def _delete(self, key: str) -> bool:
        with self._lock:
            e = self._pins.pop(key, None)
            if e is not None:
                self._pin_bytes -= e.size
                return True
            e = self._data.pop(key, None)
            if e is None:
                return False
            self._bytes -= e.size
            return not self._expired(e, clock.now())

    def _contains_many(self, keys: list[str]) -> list[bool]:
        with self._lock:
            now = clock.now()
            return [self._live(k, now) is not None for k in keys]

    def _keys(self, prefix: str) -> list[str]:
        with self._lock:
            self._sweep()
            return [k for k in (*self._pins, *self._data) if k.startswith(prefix)]

    def _count(self) -> int:
        with self._lock:
            self._sweep()
            return len(self._data) + len(self._pins)

    def _clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._pins.clear()
            self._bytes = self._pin_bytes = 0

    def _stats(self) -> dict[str, Any]:
        with self._lock:
            self._sweep()
            return {
                "entries": len(self._data) + len(self._pins),
                "bytes": self._bytes + self._pin_bytes,
                "pinned_entries": len(self._pins),
                "pinned_bytes": self._pin_bytes,
            }

    def describe(self) -> dict[str, Any]:
        return {
            "max_entries": self.max_entries,
            "ttl": self.ttl,
            "idle_ttl": self.idle_ttl,
            "pin_max_bytes": self.pin_max_bytes,
        }

    def __repr__(self) -> str:
        return f"MemoryBackend(entries={len(self._data) + len(self._pins)}, bytes={self._bytes})"


def from_uri(url: SplitResult, opts: Options) -> MemoryBackend:
    """``memory://?max_bytes=2GiB&max_entries=1000&ttl=3600&idle_ttl=600&pin_max_bytes=1GiB``.

    ``secret_env=NAME`` is accepted (and must name a set variable) so one URI template serves
    every scheme; records never leave this process, so there is nothing to sign or verify.
    """
    if url.netloc or url.path not in ("", "/"):
        raise ValueError(f"memory:// takes no host or path, got {redact_uri(url.geturl())!r}")
    max_bytes = opts.size("max_bytes", None)
    max_entries = opts.int("max_entries", None)
    lifetimes = lifetime_options(opts)
    secret_env = opts.str("secret_env", None)
    if secret_env is not None:
        signing.resolve(secret_env)
    opts.done()
    return MemoryBackend(max_bytes=max_bytes, max_entries=max_entries, **lifetimes)
