"""The CacheBackend protocol, and the small pieces every backend shares."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

from mlxcache.record import Record

log = logging.getLogger("mlxcache")


@runtime_checkable
class CacheBackend(Protocol):
    """Stores Records under string keys. Knows nothing of models, tokens or images.

    Failures of the store itself (a dead server, a corrupt file, a full disk) never raise:
    ``get`` answers ``None`` and ``put`` does nothing, both counted in ``stats()["errors"]``.
    Wrong arguments (a key that is not a str, a record that is not a Record) raise at once.
    """

    def get(self, key: str) -> Record | None: ...
    def put(self, key: str, record: Record) -> None: ...
    def delete(self, key: str) -> bool: ...
    def __contains__(self, key: object) -> bool: ...
    def keys(self, prefix: str = "") -> Iterator[str]: ...
    def __len__(self) -> int: ...
    def clear(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...
    def get_many(self, keys: Iterable[str]) -> list[Record | None]: ...
    def contains_many(self, keys: Iterable[str]) -> list[bool]: ...
    def __enter__(self) -> CacheBackend: ...
    def __exit__(self, *exc: object) -> None: ...


def check_key(key: object) -> str:
    """Return ``key`` if it is a non-empty, UTF-8-encodable str, else raise TypeError/ValueError."""
    if not isinstance(key, str):
        raise TypeError(f"cache keys must be str, got {type(key).__name__}")
    if not key:
        raise ValueError("cache keys must not be empty")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"cache key {key!r} is not valid unicode (lone surrogate)") from None
    return key


def check_record(record: object) -> Record:
    if not isinstance(record, Record):
        raise TypeError(f"expected an mlxcache.Record, got {type(record).__name__}")
    return record


class Counters:
    """Thread-safe hit/miss/eviction/error counters for ``stats()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values = {"hits": 0, "misses": 0, "evictions": 0, "errors": 0}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.values[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.values)


class RateLimitedLog:
    """Logs a repeated failure once per ``interval`` seconds, so a dead store does not flood."""

    def __init__(self, interval: float = 30.0) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}

    def warning(self, topic: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(topic, -1e9) >= self.interval:
            self._last[topic] = now
            log.warning(msg, *args)


class BackendBase:
    """Context manager and batch defaults; backends override what they can do faster."""

    def get_many(self, keys: Iterable[str]) -> list[Record | None]:
        return [self.get(k) for k in keys]  # type: ignore[attr-defined]

    def contains_many(self, keys: Iterable[str]) -> list[bool]:
        return [k in self for k in keys]  # type: ignore[operator]

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # type: ignore[attr-defined]
