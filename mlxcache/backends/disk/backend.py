"""file:// backend: one safetensors file per record and a SQLite index shared by processes.

Layout of the root folder::

    index.sqlite     key -> file, size, last access (WAL mode); totals kept by triggers
    data/<2 hex>/<sha256(key)>-<pid>-<token>.safetensors    one file per stored version
    tmp/<pid>-<token>.tmp                                   files being written
    quarantine/      unreadable files moved aside for inspection (removed after a week)

A put writes the file under ``tmp/``, renames it into ``data/`` under a name never used before
and syncs it as ``?sync=`` says (see :mod:`mlxcache.backends.disk.writes`); then one
``BEGIN IMMEDIATE`` transaction publishes it (a ``put_many``: all of them) and evicts least
recently used entries until the total shared by all processes fits ``max_bytes``. Replaced and
evicted files are unlinked after the commit. Files are only created and deleted, never
rewritten, so a reader that opened one keeps a consistent view, and an index row always names a
complete file (fsynced first unless ``sync=never``; a torn one would fail its checksum). Names
carry the writer's pid, so at open the debris of a dead writer (temp files, files renamed but
never published) can be told from a live writer's work.
"""

from __future__ import annotations

import errno
import functools
import os
import sqlite3
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import SplitResult, unquote

from mlxcache.backends import clock
from mlxcache.backends.base import BackendBase, check_budget, log
from mlxcache.backends.clock import check_lifetime, lifetime_options
from mlxcache.backends.disk.descriptors import Descriptors
from mlxcache.backends.disk.files import (
    GROUP_MODES,
    PRIVATE_MODES,
    ensure_dir,
    ensure_file,
    sweep_debris,
    unlink,
)
from mlxcache.backends.disk.index import IndexMixin
from mlxcache.backends.disk.joined import JoinMixin
from mlxcache.backends.disk.writes import DEFAULT_SYNC, WriteMixin, check_sync
from mlxcache.backends.fleet import FLEET
from mlxcache.errors import FormatError, UntrustedRecordError
from mlxcache.options import Options, redact_uri
from mlxcache.records import format as st
from mlxcache.records import reader as format_read
from mlxcache.records import signing
from mlxcache.records.record import Record


class DiskBackend(JoinMixin, WriteMixin, IndexMixin, BackendBase):
    """Records as safetensors files under ``path``, LRU over ``max_bytes`` of file bytes.

    Many threads and processes may share one folder: ``max_bytes`` caps their common total.
    ``max_bytes=None`` is unbounded; opening with a smaller budget evicts down to it at once.
    ``timeout`` is how long (seconds) to wait for the index lock before giving up (a miss).
    A folder that cannot be created or whose index cannot be opened raises ``OSError`` here;
    once open, every store failure is a miss or a no-op. With a ``signer`` (default: from
    ``$MLXCACHE_SECRET``, or the variable ``secret_env`` names) every record is signed and
    only records signed for their key are read; others are rejected and quarantined.
    """

    scheme = "file"
    pinnable = True
    if TYPE_CHECKING:  # the mixin's method fills BackendBase's optional slot
        _put_many = WriteMixin._put_many

    def __init__(
        self,
        path: str | os.PathLike,
        max_bytes: int | None = None,
        timeout: float = 10.0,
        *,
        signer: signing.Signer | None = None,
        secret_env: str | None = None,
        shared_group: bool = False,
        readonly: bool = False,
        ttl: float | None = None,
        idle_ttl: float | None = None,
        pin_max_bytes: int | None = None,
        sync: str = DEFAULT_SYNC,
    ) -> None:
        super().__init__(max_bytes=max_bytes)
        self.sync = check_sync(sync)
        self.readonly = bool(readonly)
        self.ttl = check_lifetime("ttl", ttl)
        self.idle_ttl = check_lifetime("idle_ttl", idle_ttl)
        pin_max = check_budget("pin_max_bytes", pin_max_bytes)
        self.pin_max_bytes = max_bytes if pin_max is None else pin_max
        self.shared_group = bool(shared_group)
        self._dir_mode, self._file_mode = GROUP_MODES if shared_group else PRIVATE_MODES
        self.signer = signer if signer is not None else signing.resolve(secret_env)
        self.root = Path(os.path.expanduser(os.fspath(path))).absolute()
        self.timeout = float(timeout)
        self._data = self.root / "data"
        self._tmp = self.root / "tmp"
        self._quarantine = self.root / "quarantine"
        self._index = self.root / "index.sqlite"
        self._conns_lock = threading.Lock()
        self._fds = Descriptors()  # open block files a restore reads again (get_joined)
        self._reset_connections()
        self._pinned_col = "pinned"  # "0" for a read-only index made before pins
        if self.readonly:
            self._open_readonly()
            return
        try:
            if not self.root.is_dir():
                ensure_dir(self.root, self._dir_mode)  # a folder we create is private
            for d in (self._data, self._tmp, self._quarantine):
                ensure_dir(d, self._dir_mode)
            for suffix in ("", "-wal", "-shm"):  # SQLite gives -wal/-shm the index's mode
                path = Path(f"{self._index}{suffix}")
                if not suffix or path.exists():
                    ensure_file(path, self._file_mode)
            self._open_index()
        except (OSError, sqlite3.Error) as exc:
            self.close()
            msg = (
                f"file cache: cannot use {self.root} as a cache folder ({exc}); point "
                "$MLXCACHE_URL at a writable folder (file:///path) or use memory://"
            )
            errno_ = getattr(exc, "errno", None)
            raise (OSError(errno_, msg) if errno_ else OSError(msg)) from exc
        self._sweep()
        if max_bytes is not None:
            self.trim(max_bytes)  # opening with a smaller budget enforces it at once

    def where(self) -> str:
        return str(self.root)

    def _open_readonly(self) -> None:
        """Open an existing cache for reading only: nothing is created, swept or evicted."""
        if not self._index.is_file():
            what = "no such folder" if not self.root.exists() else "no index.sqlite in it"
            raise FileNotFoundError(
                errno.ENOENT, f"file cache: no cache at {self.root} ({what})", str(self.root)
            )
        try:
            self._settings()
            if "pinned" not in {r[1] for r in self._db().execute("PRAGMA table_info(entries)")}:
                self._pinned_col = "0"
        except sqlite3.Error as exc:
            self.close()
            raise OSError(f"file cache: cannot read the index of {self.root}: {exc}") from exc

    def _writable(self) -> None:
        if self.readonly:
            raise PermissionError(f"{self.root} is opened read-only")

    # ------------------------------------------------------------ connections

    # ------------------------------------------------------------ housekeeping

    def _sweep(self) -> None:
        """Remove debris of dead writers (see :func:`disk_files.sweep_debris`)."""
        try:
            sweep_debris(self._tmp, self._data, self._quarantine, self._indexed_files)
        except (OSError, sqlite3.Error) as exc:
            log.warning("file cache: cleanup of %s failed: %s", self.root, exc)

    # ------------------------------------------------------------ lifetimes and pins

    def _pin(self, key: str, on: bool) -> bool:
        self._writable()
        live, params = self._live()
        with self._transaction() as db:
            row = db.execute(
                f"SELECT size, pinned FROM entries WHERE key = ? AND {live}", (key, *params)
            ).fetchone()
            if row is None:
                return False
            size, pinned = row
            if bool(pinned) == on:
                return on  # pinned already: True; unpinning what was not pinned: False
            if on and self.pin_max_bytes is not None:
                held = self._pinned(db)[1]
                if held + size > self.pin_max_bytes:
                    log.warning(
                        "file cache: not pinning %r (%d bytes): pins hold %d of "
                        "pin_max_bytes=%d", key, size, held, self.pin_max_bytes,
                    )  # fmt: skip
                    return False
            db.execute(
                "UPDATE entries SET pinned = ?, access_time = ?, store_time = ? WHERE key = ?",
                (int(on), now := clock.now(), now, key),  # lifetimes restart at an unpin
            )
            evicted = [] if on or self.max_bytes is None else self._evict(db, self.max_bytes)
        self._remove_files(evicted)
        self._counters.add("evictions", len(evicted))
        return True

    def _remove_files(self, files: Iterable[str | None]) -> None:
        """Delete files the index no longer names (after the commit that dropped them), and
        their shard folder once it is empty (a put recreates it, see ``_put``)."""
        files = list(files)
        self._fds.forget(files)
        shards = set()
        for file in files:
            if file:
                unlink(self._data / file)
                shards.add(file.partition("/")[0])
        for shard in shards:
            try:
                os.rmdir(self._data / shard)
            except OSError:
                pass  # not empty, the usual case

    def _trim(self, max_bytes: int) -> int:
        self._writable()
        lifetimes = self.ttl is not None or self.idle_ttl is not None
        if self._settings()["size"] <= max_bytes and not lifetimes:
            return 0
        with self._transaction() as db:
            expired = self._expire(db)
            evicted = self._evict(db, max_bytes)
        self._remove_files([*expired, *evicted])
        return len(evicted)

    def _discard(self, key: str, file: str, exc: BaseException) -> None:
        """Drop an entry whose file cannot be read: unindex it, move the file to quarantine.

        A record without a valid MAC (``UntrustedRecordError``) is counted as ``rejected``.
        """
        if isinstance(exc, UntrustedRecordError):
            self._counters.add("rejected")
            self.last_error = f"{self.scheme} cache: rejected {key!r}: {exc}"
        else:
            self.error("get", f"unreadable entry {key!r}: {exc}", logged=True)
        if self.readonly:  # reported, left where it is
            log.warning("file cache: unreadable entry %r (read-only, kept): %s", key, exc)
            return
        try:
            with self._transaction() as db:
                db.execute("DELETE FROM entries WHERE key = ? AND file = ?", (key, file))
        except sqlite3.Error as sql_exc:
            self.error("discard", sql_exc)
            return
        self._fds.forget([file])
        src = self._data / file
        try:
            os.replace(src, self._quarantine / src.name)
            where = f"moved to {self._quarantine}"
        except FileNotFoundError:
            where = "file missing"
        except OSError:
            unlink(src)
            where = "deleted"
        log.warning("file cache: dropped unreadable entry %r (%s): %s", key, where, exc)

    # ------------------------------------------------------------ reads

    def _load(self, key: str, file: str | None, read=None) -> tuple[Any, str | None]:
        """Read ``key`` from ``file``; follows a concurrent re-put, misses a concurrent delete."""
        read = read or functools.partial(format_read.read_file, key=key, signer=self.signer)
        for _ in range(3):
            if file is None:
                return None, None
            try:
                return read(self._data / file), file
            except MemoryError:
                self.error("get", f"out of memory reading {key!r}")
                return None, None
            except Exception as exc:
                now = self._row_file(key)
                if now != file:
                    file = now  # raced with a put, delete or eviction
                    continue
                path = self._data / file
                if isinstance(exc, FormatError) or not path.exists():
                    self._discard(key, file, exc)  # the index still names it: really unreadable
                else:  # could not open it now (EMFILE, EIO...): a miss, the entry stays
                    self.error("read", exc)
                return None, None
        return None, None

    def _touch(self, pairs: list[tuple[str, str]]) -> None:
        """Mark entries as just used (LRU); a failure here costs ordering, not the hit."""
        if not pairs or self.readonly:
            return
        now = clock.now()
        try:
            with self._transaction() as db:
                db.executemany(
                    "UPDATE entries SET access_time = ? WHERE key = ? AND file = ?",
                    [(now, k, f) for k, f in pairs],
                )
        except sqlite3.Error as exc:
            self.error("touch", exc)

    def _touch_many(self, keys: list[str]) -> None:
        if self.readonly:
            return
        now = clock.now()
        live, params = self._live()  # an expired entry stays expired
        with self._transaction() as db:
            db.executemany(
                f"UPDATE entries SET access_time = ? WHERE key = ? AND {live}",
                [(now, k, *params) for k in keys],
            )

    def _header(self, key: str) -> st.Header | None:
        """Metadata and tensor table of ``key`` without its tensor data (``mlxcache inspect``)."""
        return self._load(key, self._lookup([key]).get(key), format_read.read_header)[0]

    def _get_many(self, keys: list[str]) -> list[Record | None]:
        files = self._lookup(keys)
        out: list[Record | None] = []
        used: list[tuple[str, str]] = []
        for key in keys:
            try:
                record, file = self._load(key, files.get(key))
            except sqlite3.Error as exc:
                self.error("get", exc)
                record, file = None, None
            out.append(record)
            if record is not None and file is not None:
                used.append((key, file))
        self._touch(used)
        return out

    def _contains_many(self, keys: list[str]) -> list[bool]:
        found = self._lookup(keys)
        return [k in found for k in keys]

    def _keys(self, prefix: str) -> list[str]:
        """Keys starting with ``prefix``, in sorted order, from the index alone."""
        found: list[str] = []
        # UTF-8 byte order is code point order, so the matches are one contiguous run
        live, params = self._live()
        cur = self._db().execute(
            f"SELECT CAST(key AS BLOB) FROM entries WHERE key >= ? AND {live} ORDER BY key",
            (prefix, *params),
        )
        while rows := cur.fetchmany(256):
            for (raw,) in rows:
                try:
                    key = raw.decode("utf-8")
                except (AttributeError, UnicodeDecodeError):
                    continue  # a malformed row: not a key anyone can ask for
                if not key.startswith(prefix):
                    return found
                found.append(key)
        return found

    def _count(self) -> int:
        return self._stats()["entries"]

    def _fleet_add(self, deltas: dict[str, int]) -> None:
        """Fleet counters are ``fleet.<name>`` rows of the settings table, summed in SQL."""
        self._writable()
        with self._transaction() as db:
            db.executemany(
                "INSERT INTO settings (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE "
                "SET value = CASE WHEN typeof(value) = 'integer' THEN value ELSE 0 END "
                "+ excluded.value",
                [(f"fleet.{k}", int(v)) for k, v in deltas.items()],
            )

    def _fleet_read(self) -> dict[str, int]:
        settings = self._settings()
        return {k: settings.get(f"fleet.{k}", 0) for k in FLEET}

    def _stats(self) -> dict[str, Any]:
        settings = self._settings()
        db = self._db()
        out = {"entries": settings["count"], "bytes": settings["size"]}
        if self.ttl is not None or self.idle_ttl is not None:  # expired rows not yet removed
            live, params = self._live()
            n, size = db.execute(
                f"SELECT COUNT(*), TOTAL(size) FROM entries WHERE {live}", params
            ).fetchone()
            out = {"entries": int(n), "bytes": int(size)}
        out["pinned_entries"], out["pinned_bytes"] = self._pinned(db)
        return out

    def describe(self) -> dict[str, Any]:
        signed_by = self.signer.key_id if self.signer else None  # a public id, not the secret
        return {
            "path": str(self.root),
            "signed_by": signed_by,
            "ttl": self.ttl,
            "idle_ttl": self.idle_ttl,
            "pin_max_bytes": self.pin_max_bytes,
            "sync": self.sync,
        }

    # ------------------------------------------------------------ writes

    def _prepare(self, key: str, record: Record) -> tuple[Any, int]:
        # bad dtypes raise here, before any file exists
        head, views = st.encode(record, key=key, signer=self.signer)
        return (head, views), len(head) + sum(v.nbytes for v in views)

    def _delete(self, key: str) -> bool:
        self._writable()
        with self._transaction() as db:
            row = db.execute(
                "SELECT CAST(file AS BLOB) FROM entries WHERE key = ?", (key,)
            ).fetchone()
            if row is not None:
                db.execute("DELETE FROM entries WHERE key = ?", (key,))
        if row is None:
            return False
        self._remove_files([self._file_of(key, row[0])])
        return True

    def _clear(self) -> None:
        self._writable()
        with self._transaction() as db:
            rows = db.execute("SELECT key, CAST(file AS BLOB) FROM entries").fetchall()
            db.execute("DELETE FROM entries")
        self._remove_files(self._file_of(k, f) for k, f in rows if isinstance(k, str))

    def __repr__(self) -> str:
        return f"DiskBackend({str(self.root)!r}, max_bytes={self.max_bytes})"


def from_uri(url: SplitResult, opts: Options) -> DiskBackend:
    """``file:///abs/path`` or ``file://~/rel`` (home), ``?max_bytes=20GiB&timeout=10``; also
    ``ttl``, ``idle_ttl`` (seconds), ``pin_max_bytes`` and ``sync`` (always, batch, never)."""
    host, path = url.netloc, unquote(url.path)
    if host.startswith("~"):
        home = os.path.expanduser(host)
        if home == host:
            raise ValueError(
                f"file:// URI {redact_uri(url.geturl())!r}: unknown home folder {host!r}"
            )
        root = os.path.join(home, path.lstrip("/"))
    elif host in ("", "localhost"):
        root = path
    else:
        raise ValueError(
            f"file:// URI {redact_uri(url.geturl())!r} names host {url.hostname!r}: use "
            "file:///absolute/path "
            "or file://~/path (relative to your home)"
        )
    if not root or not os.path.isabs(root):
        raise ValueError(f"file:// URI {redact_uri(url.geturl())!r} needs a folder path")
    max_bytes = opts.size("max_bytes", None)
    timeout = opts.float("timeout", 10.0)
    secret_env = opts.str("secret_env", None)
    shared_group = opts.bool("shared_group", False)
    readonly = opts.bool("readonly", False)
    sync = check_sync(opts.str("sync", DEFAULT_SYNC))
    lifetimes = lifetime_options(opts)
    opts.done()
    return DiskBackend(
        root, max_bytes=max_bytes, timeout=timeout, secret_env=secret_env,
        shared_group=shared_group, readonly=readonly, sync=sync, **lifetimes,
    )  # fmt: skip
