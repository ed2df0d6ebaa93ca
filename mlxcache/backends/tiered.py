"""``tiered://``: a fast upper tier over a larger lower one (memory over disk, disk over Redis).

Reads try L1, then L2, and copy an L2 hit into L1 (``fill``). Writes go to L1 and either to L2
at once (``write=through``) or to L2 from a bounded background queue (``write=behind``):
flushed by ``flush()``, ``close()`` and at interpreter exit; a full queue waits at most
``max_wait`` seconds (``full=wait``) or not at all (``full=drop``), and drops are counted.
Queued records are evaluated and detached on the caller's thread, and are read back from the
queue until written.

L2 is the store of record: ``max_bytes`` is its budget, ``keys()``, ``len()`` and ``stats()``
describe it, and L1 hits are passed on to its LRU order (``touch_many``, batched before the next
write to L2), so what is hot in L1 is not what L2 evicts first. See docs/backends.md.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, cast
from urllib.parse import SplitResult, quote

import mlx.core as mx

from mlxcache.backends.base import BackendBase, CacheBackend, is_persistent, put_all
from mlxcache.backends.memory import detached
from mlxcache.backends.writer import (
    DEFAULT_MAX_WAIT,
    DEFAULT_QUEUE,
    DEFAULT_QUEUE_BYTES,
    FULL_POLICIES,
    BackgroundWriter,
)
from mlxcache.options import Options
from mlxcache.protocol import PinnableBackend, TrimmableBackend, can_pin
from mlxcache.records import format as fmt
from mlxcache.records.record import Record
from mlxcache.uri import open_backend

WRITE_POLICIES = ("through", "behind")
MAX_TOUCHED = 10_000  # L1 hits remembered for L2's LRU between two writes
SETTLE_TIMEOUT = 60.0  # how long keys()/len()/stats()/trim() wait for queued writes


class TieredBackend(BackendBase):
    """``l1`` over ``l2`` (backends or URIs). ``write`` is ``"through"`` or ``"behind"``;
    ``queue``, ``queue_bytes``, ``full`` and ``max_wait`` bound the write-behind queue (see
    :class:`~mlxcache.backends.writer.BackgroundWriter`); ``fill`` copies L2 hits into L1.
    ``max_bytes`` is passed to L2 when it is given as a URI (an L2 object keeps its own).
    """

    scheme = "tiered"

    def __init__(
        self,
        l1: CacheBackend | str,
        l2: CacheBackend | str,
        *,
        write: str = "through",
        fill: bool = True,
        queue: int = DEFAULT_QUEUE,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
        full: str = "wait",
        max_wait: float = DEFAULT_MAX_WAIT,
        max_bytes: int | None = None,
    ) -> None:
        if write not in WRITE_POLICIES:
            raise ValueError(f"write must be one of {', '.join(WRITE_POLICIES)}, got {write!r}")
        if max_bytes is not None and not isinstance(l2, str):
            raise ValueError("max_bytes is the budget of l2: give it to the l2 backend itself")
        super().__init__(max_bytes=max_bytes)
        self.l1 = open_backend(l1) if isinstance(l1, str) else l1
        if isinstance(l2, str):
            self.l2 = (
                open_backend(l2) if max_bytes is None else open_backend(l2, max_bytes=max_bytes)
            )
        else:
            self.l2 = l2
        self.max_bytes = getattr(self.l2, "max_bytes", None)  # refusal as L2 would refuse
        for name, tier in (("l1", self.l1), ("l2", self.l2)):
            if not isinstance(tier, CacheBackend):
                raise TypeError(f"{name} must be a CacheBackend or a URI, got {type(tier)}")
        # a tier that keeps only bytes cannot hold live objects: neither can the whole
        self.persistent = is_persistent(self.l1) or is_persistent(self.l2)
        self.write, self.fill = write, fill
        self.writer = (
            BackgroundWriter(
                queue=queue,
                queue_bytes=queue_bytes,
                full=full,
                max_wait=max_wait,
                name="mlxcache-tiered-writer",
            )  # fmt: skip
            if write == "behind"
            else None
        )
        self._pending: dict[str, tuple[int, Record]] = {}  # key -> (generation, record)
        self._gen = 0
        self._lock = threading.Lock()  # guards _pending and _gen
        self._writing = threading.Lock()  # held while a queued write lands in L2
        self._touched: dict[str, None] = {}  # L1 hits not yet passed on to L2's LRU
        self._tier_hits = {"l1_hits": 0, "l2_hits": 0, "queue_hits": 0}
        self.pinnable = bool(getattr(self.l2, "pinnable", False))  # L2 is the store of record

    def _pin(self, key: str, on: bool) -> bool:
        """Pin in L2 (after queued writes land); in L1 too where it holds the key."""
        self._settle()
        l2 = cast(PinnableBackend, self.l2)  # _pinning runs this only if pinnable (L2's)
        done = l2.pin(key) if on else l2.unpin(key)
        if can_pin(self.l1):
            self.l1.pin(key) if on else self.l1.unpin(key)
        return done

    def where(self) -> str:
        return f"{_where(self.l1)} over {_where(self.l2)}"

    # ------------------------------------------------------------ writing

    def _prepare(self, key: str, record: Record) -> tuple[Record, int]:
        if self.writer is None:
            return record, record.nbytes
        # kept in the queue and written by another thread: a detached, evaluated copy
        stored = detached(record)
        mx.eval(list(stored.arrays.values()))
        return stored, record.nbytes

    def _put(self, key: str, record: Record, size: int) -> int:
        self.l1.put(key, record)
        if self.writer is None:
            self._pass_touches()
            self.l2.put(key, record)
            return 0
        with self._lock:
            self._gen += 1
            gen = self._gen
            self._pending[key] = (gen, record)
            # L1 hits so far happened after the writes queued before this one: they travel
            # with this write, so L2 sees them in that order
            touched, self._touched = list(self._touched), {}
        job = lambda: self._write_behind(key, gen, record, touched)  # noqa: E731
        if not self.writer.submit(job, size):
            self._forget(key, gen)  # dropped (counted by the writer): L1 still has it
            with self._lock:
                self._touched = dict.fromkeys([*touched, *self._touched])
        return 0

    def _put_many(self, entries: list[tuple[str, Record, int]]) -> tuple[int, list[None]]:
        """Write-through: one ``put_many`` per tier (``file://``: one sync for the batch)."""
        if self.writer is not None:
            for key, record, size in entries:
                self._put(key, record, size)
            return 0, [None] * len(entries)
        items = [(key, record) for key, record, _ in entries]
        put_all(self.l1, items)
        self._pass_touches()
        put_all(self.l2, items)
        return 0, [None] * len(entries)

    def _write_behind(self, key: str, gen: int, record: Record, touched: list[str]) -> None:
        with self._writing:
            touch = getattr(self.l2, "touch_many", None)
            if touched and touch is not None:
                touch(touched)
            with self._lock:
                current = self._pending.get(key)
            if current is not None and current[0] == gen:  # not replaced, deleted or cleared
                self.l2.put(key, record)
        self._forget(key, gen)

    def _forget(self, key: str, gen: int) -> None:
        with self._lock:
            current = self._pending.get(key)
            if current is not None and current[0] == gen:
                del self._pending[key]

    def _pass_touches(self) -> None:
        """Tell L2 about the L1 hits since the last write, so its LRU order sees them (with
        write-behind: only once the queue is empty, see ``_settle``)."""
        with self._lock:
            keys, self._touched = list(self._touched), {}
        touch = getattr(self.l2, "touch_many", None)
        if keys and touch is not None:
            touch(keys)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write reached L2 (or was dropped); False on timeout."""
        return True if self.writer is None else self.writer.flush(timeout)

    # ------------------------------------------------------------ reading

    def _queued(self, key: str) -> Record | None:
        with self._lock:
            found = self._pending.get(key)
        return None if found is None else detached(found[1])

    def _get_many(self, keys: list[str]) -> list[Record | None]:
        out = self.l1.get_many(keys)
        missing = [i for i, r in enumerate(out) if r is None]
        hits = {"l1_hits": len(keys) - len(missing), "l2_hits": 0, "queue_hits": 0}
        if hits["l1_hits"]:
            with self._lock:
                for k, r in zip(keys, out, strict=True):
                    if r is not None:
                        self._touched.pop(k, None)
                        self._touched[k] = None
                while len(self._touched) > MAX_TOUCHED:  # forget the oldest
                    del self._touched[next(iter(self._touched))]
        rest = []
        for i in missing:
            out[i] = self._queued(keys[i])
            if out[i] is not None:
                hits["queue_hits"] += 1
            else:
                rest.append(i)
        if rest:
            for i, rec in zip(rest, self.l2.get_many([keys[i] for i in rest]), strict=True):
                if rec is not None:
                    out[i] = rec
                    hits["l2_hits"] += 1
                    if self.fill:
                        self.l1.put(keys[i], rec)
        with self._lock:
            for name, n in hits.items():
                self._tier_hits[name] += n
        return out

    def _contains_many(self, keys: list[str]) -> list[bool]:
        found = self.l1.contains_many(keys)
        with self._lock:
            for i, k in enumerate(keys):
                found[i] = found[i] or k in self._pending
        rest = [i for i, f in enumerate(found) if not f]
        if rest:
            for i, f in zip(rest, self.l2.contains_many([keys[i] for i in rest]), strict=True):
                found[i] = f
        return found

    def _header(self, key: str) -> fmt.Header | None:
        found = self.l1.header(key) if hasattr(self.l1, "header") else None
        if found is None:
            queued = self._queued(key)
            if queued is not None:
                return fmt.header_of(queued)
        if found is None and hasattr(self.l2, "header"):
            found = self.l2.header(key)
        return found

    # ------------------------------------------------------------ the rest

    def _drop_pending(self, key: str | None) -> bool:
        """Forget queued writes of ``key`` (all when None); True if one was queued."""
        with self._lock:
            if key is None:
                had = bool(self._pending)
                self._pending.clear()
            else:
                had = self._pending.pop(key, None) is not None
            self._gen += 1
        return had

    def _delete(self, key: str) -> bool:
        with self._writing:  # a queued write of this key cannot land after the delete
            queued = self._drop_pending(key)
            d1 = self.l1.delete(key)
            d2 = self.l2.delete(key)
        return queued or d1 or d2

    def _settle(self) -> None:
        """Before describing or trimming L2: queued writes land, L1 hits reach its LRU."""
        if self.writer is not None and not self.writer.flush(SETTLE_TIMEOUT):
            return  # still writing: L1 hits travel with the next queued write
        self._pass_touches()

    def _keys(self, prefix: str) -> Iterator[str]:
        self._settle()
        with self._lock:
            queued = [k for k in self._pending if k.startswith(prefix)]  # only if flush timed out
        seen: set[str] = set()
        for k in [*self.l2.keys(prefix), *queued]:
            if k not in seen:
                seen.add(k)
                yield k

    def _count(self) -> int:
        return self._stats()["entries"]

    def _clear(self) -> None:
        with self._writing:
            self._drop_pending(None)
            with self._lock:
                self._touched = {}
            self.l1.clear()
            self.l2.clear()

    def _trim(self, max_bytes: int) -> int:
        """Trim both tiers; the count is L2's (an L1 eviction leaves the record in the store)."""
        self._settle()
        # every tier is taken to trim (BackendBase does); _guard counts one that cannot
        cast(TrimmableBackend, self.l1).trim(max_bytes)
        return cast(TrimmableBackend, self.l2).trim(max_bytes)

    def _stats(self) -> dict[str, Any]:
        self._settle()
        s1, s2 = self.l1.stats(), self.l2.stats()
        with self._lock:
            queued = list(self._pending)
            tier_hits = dict(self._tier_hits)
        extra = sum(1 for there in self.l2.contains_many(queued) if not there) if queued else 0
        return {
            "entries": s2.get("entries", 0) + extra,
            "bytes": s2.get("bytes", 0),
            **{k: s2[k] for k in ("pinned_entries", "pinned_bytes") if k in s2},
            **tier_hits,
            "l1": s1,
            "l2": s2,
            **({"writer": self.writer.stats()} if self.writer is not None else {}),
        }

    def stats(self) -> dict[str, Any]:
        """The lower tier's entries, bytes and evictions, both tiers' stats, L1/L2 hits and the
        writer's counts; ``errors`` includes both tiers' errors. Waits for queued writes."""
        out = super().stats()
        out["errors"] += sum(out.get(t, {}).get("errors", 0) for t in ("l1", "l2"))
        out["evictions"] = out.get("l2", {}).get("evictions", out["evictions"])
        out["available"] = out["available"] and out.get("l2", {}).get("available", True)
        return out

    def describe(self) -> dict[str, Any]:
        return {"write": self.write, "fill": self.fill}

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.l1.close()
        self.l2.close()

    def __repr__(self) -> str:
        return f"TieredBackend({self.l1!r}, {self.l2!r}, write={self.write!r})"


def _where(backend: Any) -> str:
    where = getattr(backend, "where", None)
    text = where() if callable(where) else ""
    return f"{getattr(backend, 'scheme', type(backend).__name__)}://{text}".rstrip("/")


def tiered_uri(l1: str, l2: str, **options: Any) -> str:
    """A ``tiered://`` URI with ``l1`` and ``l2`` url-encoded (so their own ``?...&...``
    options stay theirs), e.g. ``tiered_uri("memory://?max_bytes=1GiB", "file:///srv/c",
    write="behind")``."""
    parts = [f"l1={quote(l1, safe='')}", f"l2={quote(l2, safe='')}"]
    parts += [f"{k}={quote(str(v), safe='')}" for k, v in options.items()]
    return "tiered://?" + "&".join(parts)


def from_uri(url: SplitResult, opts: Options) -> TieredBackend:
    """``tiered://?l1=URI&l2=URI`` with the nested URIs url-encoded (see :func:`tiered_uri`).

    Options: write (through | behind, default through), fill (default true), max_bytes (the
    budget of L2, overriding the one in its URI), and for
    write-behind: queue (jobs, default 64), queue_bytes (default 1GiB), full (wait | drop,
    default wait), max_wait (seconds, default 0.05).
    """
    if url.netloc or url.path not in ("", "/"):
        raise ValueError("tiered:// takes no host or path: tiered://?l1=URI&l2=URI")
    l1, l2 = opts.str("l1", None), opts.str("l2", None)
    if not l1 or not l2:
        raise ValueError("tiered:// needs both l1= and l2= (url-encoded backend URIs)")
    write = opts.str("write", "through")
    full = opts.str("full", "wait")
    if write not in WRITE_POLICIES:
        raise ValueError(f"tiered:// option write={write!r} is invalid: use through or behind")
    if full not in FULL_POLICIES:
        raise ValueError(f"tiered:// option full={full!r} is invalid: use wait or drop")
    kwargs: dict[str, Any] = {  # each checked by Options or above
        "write": write,
        "full": full,
        "fill": opts.bool("fill", True),
        "queue": opts.int("queue", DEFAULT_QUEUE, minimum=1),
        "queue_bytes": opts.size("queue_bytes", DEFAULT_QUEUE_BYTES),
        "max_wait": opts.float("max_wait", DEFAULT_MAX_WAIT),
        "max_bytes": opts.size("max_bytes", None),
    }
    if opts.values:
        unknown = ", ".join(sorted(opts.values))
        raise ValueError(
            f"unknown option(s) for tiered://: {unknown}; valid options: "
            f"{', '.join(sorted(opts.known))} (url-encode the nested URIs: an '&' inside l1= "
            "or l2= ends it; mlxcache.backends.tiered.tiered_uri builds one)"
        )
    return TieredBackend(l1, l2, **kwargs)
