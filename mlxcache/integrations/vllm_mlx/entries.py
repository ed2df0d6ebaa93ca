"""What both vllm-mlx compatible managers share: a backend they may own, live objects kept
beside its records, LRU slots with a byte total, and puts confirmed by the backend."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from mlxcache.backends.base import CacheBackend, is_persistent
from mlxcache.errors import RecordTooLargeError
from mlxcache.integrations.vllm_mlx.payloads import Missing, Packer, true_nbytes
from mlxcache.options import redact_uri
from mlxcache.records.record import Record
from mlxcache.uri import open_backend

T = TypeVar("T")


def resolve_backend(backend: CacheBackend | str | None) -> tuple[CacheBackend, bool]:
    """The backend to use and whether we opened it (and so close it); None is ``memory://``."""
    if backend is None:
        backend = "memory://"
    if isinstance(backend, str):
        return open_backend(backend), True
    if not isinstance(backend, CacheBackend):
        raise TypeError(
            f"backend must be a URI str or a CacheBackend, got {type(backend).__name__}"
        )
    return backend, False


@dataclass
class Slot:
    """What a manager knows of one stored entry: its bytes, recency and group."""

    nbytes: int
    seq: int = 0
    group: str = ""
    hit_count: int = 0


class LRU:
    """Entry keys in least-recently-used order with a running byte total."""

    def __init__(self) -> None:
        self.items: OrderedDict[str, Slot] = OrderedDict()
        self.nbytes = 0

    def put(self, key: str, slot: Slot) -> None:
        """Insert or replace (a replaced key's old bytes stop counting) as most recent."""
        self.pop(key)
        self.items[key] = slot
        self.nbytes += slot.nbytes

    def touch(self, key: str, seq: int) -> None:
        slot = self.items.get(key)
        if slot is not None:
            slot.seq = seq
            self.items.move_to_end(key)

    def pop(self, key: str) -> Slot | None:
        slot = self.items.pop(key, None)
        if slot is not None:
            self.nbytes -= slot.nbytes
        return slot

    def oldest(self) -> tuple[str, Slot] | None:
        return next(iter(self.items.items()), None)

    def get(self, key: str) -> Slot | None:
        return self.items.get(key)

    def clear(self) -> None:
        self.items.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, key: object) -> bool:
        return key in self.items


class EntryStore:
    """A manager's entries on one backend: records there, live objects (memory only) here.

    ``what`` names the manager in log lines. The backend is opened from a URI (and then
    closed by :meth:`close`) or given (and then left open).
    """

    def __init__(self, backend: CacheBackend | str | None, what: str, log: logging.Logger):
        self.backend, self._owned = resolve_backend(backend)
        self.persistent = is_persistent(self.backend)
        self.where = (
            repr(redact_uri(backend)) if isinstance(backend, str) else type(backend).__name__
        )
        self.what, self.log = what, log
        self.live: dict[str, dict[str, Any]] = {}  # key -> payloads kept as Python objects
        self._seq = 0

    def next_seq(self) -> int:
        """A number that grows with every use: the recency of an LRU slot."""
        self._seq += 1
        return self._seq

    def packer(self) -> Packer:
        return Packer(self.persistent, self.where)

    def read(
        self, key: str, accept: Callable[[Record], bool], build: Callable[[Record, Any], T]
    ) -> tuple[T, Record] | None:
        """``(build(record, live), record)`` for the record under ``key``, or None.

        None when the record is gone, not ``accept``-ed, points to live objects this process
        does not have, or does not rebuild (a damaged or foreign record: logged).
        """
        rec = self.backend.get(key)
        if rec is None or not accept(rec):
            return None
        try:
            return build(rec, self.live.get(key)), rec
        except Missing:
            return None
        except Exception as exc:
            self.log.warning("%s: unreadable entry %s: %s", self.what, key[:40], exc)
            return None

    def write(self, key: str, record: Record, live: dict[str, Any]) -> bool:
        """Put and confirm: False (and nothing kept) when the backend did not keep it."""
        try:
            self.backend.put(key, record)
        except RecordTooLargeError as exc:  # e.g. a prompt of millions of tokens: not cached
            self.log.warning("%s: not storing %s: %s", self.what, key[:40], exc)
            self.live.pop(key, None)
            return False
        if key not in self.backend:  # unreachable, or over the backend's own max_bytes
            self.log.warning("%s: the backend did not keep %s", self.what, key[:40])
            self.live.pop(key, None)
            return False
        if live:
            self.live[key] = live
        else:
            self.live.pop(key, None)
        return True

    def nbytes(self, key: str, record: Record) -> int:
        """Bytes of an entry: its record's tensors plus its live objects."""
        return record.nbytes + sum(true_nbytes(v) for v in self.live.get(key, {}).values())

    def gone(self, keys: Iterable[str]) -> list[str]:
        """The keys the backend no longer has (one ``contains_many``); their live objects go.

        Another process, or the backend's own budget, may have removed them: counting them
        would evict live entries for bytes that are not there.
        """
        keys = list(keys)
        lost = [
            k for k, there in zip(keys, self.backend.contains_many(keys), strict=True) if not there
        ]
        for key in lost:
            self.live.pop(key, None)
        return lost

    def forget(self, key: str) -> None:
        self.live.pop(key, None)

    def drop(self, key: str) -> None:
        """Delete an entry from the backend and forget its live objects."""
        self.live.pop(key, None)
        self.backend.delete(key)

    def clear(self, prefixes: Iterable[str]) -> None:
        """Delete every key under ``prefixes`` (all processes' entries) and all live objects."""
        for prefix in prefixes:
            for key in list(self.backend.keys(prefix)):
                self.backend.delete(key)
        self.live.clear()

    def close(self) -> None:
        """Close the backend if it was opened here from a URI."""
        if self._owned:
            self.backend.close()
