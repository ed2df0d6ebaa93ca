"""The CacheBackend protocol, and BackendBase: the policy every backend shares.

A backend stores Records under string keys and knows nothing of models, tokens or images.
:class:`BackendBase` owns what the protocol promises (argument checks, refusal of records over
the budget, counters, store failures read as misses, a reconnect backoff); a backend implements
only its raw operations (``_get_many``, ``_put``, ...), as diskcache's ``Cache`` keeps policy
apart from its ``Disk``. See docs/backends.md.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from mlxcache.backends.breaker import Breaker
from mlxcache.backends.chains import (  # noqa: F401 - re-exported: the capability's names
    MAX_MEMBERS,
    ChainFound,
    ChainWalk,
    add_sibling,
    walk_chain,
    walks_chains,
)
from mlxcache.backends.checks import check_budget, check_key, check_record  # noqa: F401
from mlxcache.backends.counters import Counters, Latency, RateLimitedLog
from mlxcache.backends.fleet import FleetCounters, flush_at_exit
from mlxcache.protocol import CacheBackend
from mlxcache.records import format as fmt
from mlxcache.records.record import Record

log = logging.getLogger("mlxcache")

T = TypeVar("T")


def is_persistent(backend: CacheBackend) -> bool:
    """Whether a backend keeps only serialized bytes (it cannot hold live Python objects).

    Backends declare it with a ``persistent`` attribute; one that does not is taken to be
    persistent, the safe assumption.
    """
    return bool(getattr(backend, "persistent", True))


def put_all(backend: CacheBackend, items: list[tuple[str, Record]]) -> None:
    """``backend.put_many(items)`` where it has one (BackendBase does), else ``put`` each."""
    put_many = getattr(backend, "put_many", None)
    if put_many is not None:
        put_many(items)
        return
    for key, record in items:
        backend.put(key, record)


class BackendBase:
    """The protocol's policy over a backend's raw operations.

    Subclasses set ``scheme`` (and ``persistent = False`` if they keep live objects), call
    ``super().__init__`` and implement ``_prepare``, ``_put``, ``_get_many``,
    ``_contains_many``, ``_delete``, ``_keys``, ``_count``, ``_clear``, ``_stats`` and
    ``_trim``; ``_header``, ``_close`` and ``_put_many`` are optional. A raw operation may
    raise anything: the base counts it in ``stats()["errors"]``, logs it (rate-limited), keeps
    its text in ``last_error`` and returns the call's miss value. Errors of a type in
    ``_unreachable`` mean the store is gone: calls are then skipped for a backoff that doubles
    from ``backoff`` up to ``max_backoff`` seconds, and tried again after it.
    """

    scheme = "backend"
    persistent = True
    _unreachable: tuple[type[BaseException], ...] = ()

    def __init__(
        self,
        *,
        max_bytes: int | None = None,
        backoff: float = 0.1,
        max_backoff: float = 5.0,
    ) -> None:
        self.max_bytes = check_budget("max_bytes", max_bytes)
        self.breaker = Breaker(backoff, max_backoff)  # ValueError on a bad pair
        self.backoff, self.max_backoff = backoff, max_backoff
        self.last_error: str | None = None
        self._counters = Counters()
        self.latency = Latency()  # get/put durations, for metrics
        self._rlog = RateLimitedLog()
        self._fleet: FleetCounters | None = None
        if type(self)._fleet_add is not BackendBase._fleet_add:  # the store keeps fleet totals
            self._fleet = FleetCounters(self._counters.snapshot, self._fleet_add_within)
            flush_at_exit(self)

    # ------------------------------------------------------------ raw operations

    def _prepare(self, key: str, record: Record) -> tuple[Any, int]:
        """What ``_put`` stores and its size in bytes; raises on a record it cannot store."""
        return record, record.nbytes

    def _put(self, key: str, payload: Any, size: int) -> int:
        """Store ``payload`` under ``key``; returns how many entries were evicted for it."""
        raise NotImplementedError

    _put_many: Callable[[list[tuple[str, Any, int]]], tuple[int, list[Any]]] | None = None
    """Optional: store prepared ``(key, payload, size)`` entries as one batch; returns
    (entries evicted, each entry's exception or None). Without it ``put_many`` loops ``put``."""

    def _get_many(self, keys: list[str]) -> list[Record | None]:
        raise NotImplementedError

    def _contains_many(self, keys: list[str]) -> list[bool]:
        raise NotImplementedError

    def _delete(self, key: str) -> bool:
        raise NotImplementedError

    def _keys(self, prefix: str) -> Iterable[str]:
        raise NotImplementedError

    def _count(self) -> int:
        raise NotImplementedError

    def _clear(self) -> None:
        raise NotImplementedError

    def _stats(self) -> dict[str, Any]:
        """``entries`` and ``bytes`` as the store counts them now."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """What this backend is (location, options) for ``stats()``; read without the store."""
        return {}

    def _trim(self, max_bytes: int) -> int:
        """Evict least recently used entries until the store holds at most ``max_bytes``."""
        raise NotImplementedError

    def _header(self, key: str) -> fmt.Header | None:
        """A record's header; backends that can read it without the tensor data override this."""
        found = self._get_many([key])[0]
        return None if found is None else fmt.header_of(found)

    def _close(self) -> None:
        """Release connections or files; the default has nothing to release."""

    def _fleet_add(self, deltas: dict[str, int]) -> None:
        """Add counter deltas to the store's fleet totals (stores shared by processes)."""
        raise NotImplementedError

    def _fleet_read(self) -> dict[str, int]:
        """The store's fleet totals, every process's counts summed."""
        raise NotImplementedError

    def _touch_many(self, keys: list[str]) -> None:
        """Mark keys as just used in the LRU order without reading them; default: nothing."""

    def _within(self) -> contextlib.AbstractContextManager[Any]:  # the deadline of one call
        return contextlib.nullcontext()  # (Redis: ``timeout`` in all); default: none

    def _fleet_add_within(self, deltas: dict[str, int]) -> None:
        """A fleet flush under one deadline; an unreachable store starts the backoff."""
        start = time.monotonic()
        try:
            with self._within():
                self._fleet_add(deltas)
        except self._unreachable:
            self.breaker.failed(time.monotonic() - start)
            raise

    # ------------------------------------------------------------ policy

    def _skipping(self) -> bool:
        return self.breaker.skipping()

    def _maybe_flush(self) -> None:
        """Flush the fleet counters when their interval is up, never while the store is in
        backoff (a failed call's flush would wait a second deadline on a hung server)."""
        if self._fleet is not None and not self._skipping():
            self._fleet.maybe_flush()

    def error(self, op: str, exc: BaseException | str, n: int = 1, logged: bool = False,
              spent: float = 0.0) -> None:  # fmt: skip
        """Count a failure of ``op``, keep it in ``last_error`` and log it (rate-limited).

        An unreachable store starts the backoff (:mod:`mlxcache.backends.breaker`; ``spent``:
        how long the call waited). ``logged=True``: the caller logs its own line.
        """
        self._counters.add("errors", n)
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        where = f"{self.scheme} cache {self.where()}".rstrip()
        if isinstance(exc, self._unreachable):
            self.breaker.failed(spent)
            self.last_error = f"{where} unreachable during {op} ({exc})"
            topic = "down"
        else:
            self.last_error = f"{where}: {op} failed: {text}"
            topic = op
        if not logged:
            self._rlog.warning(topic, "%s", self.last_error)

    def _guard(self, op: str, miss: T, fn: Callable[..., T], *args: Any, n: int = 1) -> T:
        """Run a raw operation under one deadline (``_within``); a failure (or a store in
        backoff) is ``miss``, counted."""
        probe = self.breaker.admit()
        if probe is None:
            self._counters.add("errors", n)
            return miss
        start = time.monotonic()
        try:
            with self._within():
                result = fn(*args)
        except Exception as exc:
            self.error(op, exc, n, spent=time.monotonic() - start)
            return miss
        finally:
            self.breaker.release(probe)
        self.breaker.ok()
        return result

    def where(self) -> str:
        """Where the store is, for messages (never with a password)."""
        return ""

    # ------------------------------------------------------------ the protocol

    def get(self, key: str) -> Record | None:
        return self.get_many([check_key(key)])[0]

    def get_many(self, keys: Iterable[str]) -> list[Record | None]:
        """Records of ``keys`` in order, None for each miss (one batch where the store can)."""
        keys = [check_key(k) for k in keys]
        if not keys:
            return []
        n = len(keys)
        with self.latency.timer("get"):
            misses: list[Record | None] = [None] * n
            out = self._guard("get", misses, self._get_many, keys, n=n)
        found = [r for r in out if r is not None]
        self._counters.add("hits", len(found))
        self._counters.add("misses", n - len(found))
        self._counters.add("bytes_read", sum(r.nbytes for r in found))
        self._maybe_flush()
        return out

    def put(self, key: str, record: Record) -> None:
        """Store ``record`` under ``key``; refused when over ``max_bytes``, a no-op on failure."""
        check_key(key)
        check_record(record)
        if self.max_bytes == 0 or self._refuses_all():
            return
        if self._skipping():
            self._counters.add("errors")
            return
        payload, size = self._prepare(key, record)  # a record it cannot store raises here
        if self.max_bytes is not None and size > self.max_bytes:
            log.warning(
                "%s cache: refusing %r (%d bytes) larger than max_bytes=%d",
                self.scheme, key, size, self.max_bytes,
            )  # fmt: skip
            return
        with self.latency.timer("put"):
            evicted = self._guard("put", None, self._put, key, payload, size)
        if evicted is None:
            return  # failed: counted as an error
        self._counters.add("bytes_written", record.nbytes)  # tensor bytes, as bytes_read
        if evicted:
            self._counters.add("evictions", evicted)
        self._maybe_flush()

    def put_many(self, items: Iterable[tuple[str, Record]]) -> None:
        """``put`` each ``(key, record)`` with the same policy, as one batch where the store can
        (``file://``: one sync and one transaction); an oversize record is refused alone."""
        items = [(check_key(k), check_record(r)) for k, r in items]
        if self._put_many is None or type(self).put is not BackendBase.put:
            for key, record in items:  # no batch operation, or a subclass that wraps put
                self.put(key, record)
            return
        if not items or self.max_bytes == 0 or self._refuses_all():
            return
        if self._skipping():
            self._counters.add("errors", len(items))
            return
        batch: list[tuple[str, Any, int]] = []
        nbytes: list[int] = []
        for key, record in items:
            payload, size = self._prepare(key, record)  # raises before anything is written
            if self.max_bytes is not None and size > self.max_bytes:
                log.warning(
                    "%s cache: refusing %r (%d bytes) larger than max_bytes=%d",
                    self.scheme, key, size, self.max_bytes,
                )  # fmt: skip
                continue
            batch.append((key, payload, size))
            nbytes.append(record.nbytes)
        if not batch:
            return
        with self.latency.timer("put"):
            done = self._guard("put", None, self._put_many, batch, n=len(batch))
        if done is None:
            return  # failed: counted as errors
        evicted, failed = done
        for exc in failed:
            if exc is not None:
                self.error("put", exc)
        kept = sum(b for b, e in zip(nbytes, failed, strict=True) if e is None)
        self._counters.add("bytes_written", kept)
        if evicted:
            self._counters.add("evictions", evicted)
        self._maybe_flush()

    def _refuses_all(self) -> bool:
        """True when another budget of the backend is zero (e.g. ``max_entries=0``)."""
        return False

    def delete(self, key: str) -> bool:
        return self._guard("delete", False, self._delete, check_key(key))

    def __contains__(self, key: object) -> bool:
        return self.contains_many([check_key(key)])[0]

    def contains_many(self, keys: Iterable[str]) -> list[bool]:
        """Whether each key is stored, in one batch where the store can."""
        keys = [check_key(k) for k in keys]
        if not keys:
            return []
        return self._guard("contains", [False] * len(keys), self._contains_many, keys)

    def keys(self, prefix: str = "") -> Iterator[str]:
        """Keys starting with ``prefix`` (empty on failure)."""
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        return iter(self._guard("keys", list[str](), lambda: list(self._keys(prefix))))

    def __len__(self) -> int:
        return self._guard("len", 0, self._count)

    def clear(self) -> None:
        """Delete every entry of this store (for a shared store: of every process)."""
        self._guard("clear", None, self._clear)

    def trim(self, max_bytes: int) -> int:
        """Evict least recently used entries down to ``max_bytes``; returns how many went."""
        check_budget("max_bytes", max_bytes)
        if max_bytes is None:
            raise ValueError("trim needs a byte budget, got None")
        evicted = self._guard("trim", 0, self._trim, max_bytes)
        if evicted:
            self._counters.add("evictions", evicted)
        return evicted

    def touch_many(self, keys: Iterable[str]) -> None:
        """Refresh the LRU recency of stored keys without reading them (``tiered://`` tells its
        lower tier about upper-tier hits); missing keys are ignored, failures are counted."""
        keys = [check_key(k) for k in keys]
        if keys:
            self._guard("touch", None, self._touch_many, keys)

    def header(self, key: str) -> fmt.Header | None:
        """Metadata and tensor table of ``key`` (no tensor data where the backend can)."""
        return self._guard("header", None, self._header, check_key(key))

    def counters(self) -> dict[str, int]:
        """This process's counters alone (hits, misses, errors...): no call to the store."""
        return self._counters.snapshot()

    def flush_counters(self) -> None:
        """Add this process's unflushed counts to the store's fleet totals (if it keeps any)."""
        if self._fleet is not None and not self._skipping():
            self._fleet.flush()

    def stats(self) -> dict[str, Any]:
        """Entries and bytes of the store, this process's counters, and ``available``.

        A store shared by processes (file, redis) adds ``fleet``: the counters of every
        process that used it, summed in the store (monotonic across ``clear()``).
        """
        found = self._guard("stats", None, self._stats)
        out = {
            "backend": self.scheme,
            **self.describe(),
            **(found if found is not None else {"entries": 0, "bytes": 0}),
            "max_bytes": self.max_bytes,
            "available": found is not None,
            **self._counters.snapshot(),
        }
        if self._fleet is not None and found is not None:
            self.flush_counters()
            try:
                with self._within():
                    out["fleet"] = self._fleet_read()
            except Exception as exc:
                self.error("stats", exc)
        return out

    def close(self) -> None:
        """Flush the fleet counters, release connections and files (a later call may reopen)."""
        self.flush_counters()
        self._guard("close", None, self._close)

    # ------------------------------------------------------------ chain walks (optional)

    def _walk_chain(self, walk: ChainWalk) -> ChainFound | None:
        """One round trip for a whole ``ChainWalk``; None: not here (the default)."""
        return None

    def _can_walk(self) -> bool:
        """Whether ``_walk_chain`` answers here (a backend may depend on its configuration)."""
        return type(self)._walk_chain is not BackendBase._walk_chain

    def _add_sibling(self, index: str, label: bytes, members: list[str]) -> None:
        """Keep a sibling index entry for ``_walk_chain``; the default keeps none."""

    @property
    def walks_chains(self) -> bool:
        """Whether ``walk_chain`` answers here (else it returns None at once)."""
        return self._can_walk()

    def walk_chain(self, walk: ChainWalk) -> ChainFound | None:
        """Answer ``walk`` in one round trip, or None where the backend cannot (then use
        ``contains_many``/``get_many``). A failing store is an empty find, counted."""
        for k in (*walk.chain, *walk.marks, *walk.siblings, *walk.extras):
            check_key(k)
        if not self._can_walk():
            return None
        with self.latency.timer("get"):
            empty: ChainFound | None = ChainFound()
            found = self._guard("get", empty, self._walk_chain, walk)
        if found is None:
            return None
        hits = [r for r in found.records if r is not None]
        self._counters.add("hits", len(hits))
        self._counters.add("misses", len(found.records) - len(hits))
        self._counters.add("bytes_read", sum(r.nbytes for r in hits))
        self._maybe_flush()
        return found

    def add_sibling(self, index: str, label: bytes, members: list[str]) -> None:
        """Register ``members`` (first: the one whose presence counts) under ``label`` in the
        sibling index ``index``; failures are counted, never raised."""
        for k in (index, *members):
            if "\n" in check_key(k):
                raise ValueError(f"sibling index names and members take no newline: {k!r}")
        if not isinstance(label, bytes) or not label or not 0 < len(members) <= MAX_MEMBERS:
            raise ValueError(f"add_sibling needs a bytes label and 1..{MAX_MEMBERS} members")
        self._guard("put", None, self._add_sibling, index, label, list(members))

    # ------------------------------------------------------------ pins (see docs/backends.md)

    pinnable = False  # backends that keep pinned entries out of LRU eviction set True

    def _pin(self, key: str, on: bool) -> bool:
        raise NotImplementedError

    def pin(self, key: str) -> bool:
        """Keep ``key`` out of LRU eviction and expiry (within ``pin_max_bytes``).

        False if the key is not stored or the pin budget is full (logged); a backend that
        cannot pin raises NotImplementedError.
        """
        return self._pinning(key, True)

    def unpin(self, key: str) -> bool:
        """Make a pinned ``key`` an ordinary LRU entry again; False if it was not pinned."""
        return self._pinning(key, False)

    def _pinning(self, key: str, on: bool) -> bool:
        check_key(key)
        if not self.pinnable:
            raise NotImplementedError(f"{self.scheme}:// backends cannot pin entries")
        return bool(self._guard("pin" if on else "unpin", False, self._pin, key, on))

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
