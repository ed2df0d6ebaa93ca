"""file:// backend: one safetensors file per record and a SQLite index shared by processes.

Layout of the root folder::

    index.sqlite     key -> file, size, last access (WAL mode); totals kept by triggers
    data/<2 hex>/<sha256(key)>-<pid>-<token>.safetensors    one file per stored version
    tmp/<pid>-<token>.tmp                                   files being written
    quarantine/      unreadable files moved aside for inspection (removed after a week)

A put writes the file under ``tmp/``, fsyncs it, renames it into ``data/`` under a name never
used before and fsyncs the folder; then one ``BEGIN IMMEDIATE`` transaction publishes it and
evicts least recently used entries until the total shared by all processes fits ``max_bytes``.
Replaced and evicted files are unlinked after the commit. Files are only created and deleted,
never rewritten, so a reader that opened one keeps a consistent view, and an index row always
names a complete, fsynced file. Names carry the writer's pid, so at open the debris of a dead
writer (temp files, files renamed but never published) can be told from a live writer's work.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, unquote

from mlxcache import format as st
from mlxcache import signing
from mlxcache.backends.base import BackendBase, log
from mlxcache.backends.disk_files import (
    DATA_NAME,
    GROUP_MODES,
    PRIVATE_MODES,
    ensure_dir,
    ensure_file,
    fsync_dir,
    sweep_debris,
    unlink,
    write_file,
)
from mlxcache.backends.fleet import FLEET
from mlxcache.errors import FormatError, UntrustedRecordError
from mlxcache.options import Options, redact_uri
from mlxcache.record import Record

SCHEMA_VERSION = 1
SUFFIX = ".safetensors"
_CHUNK = 500  # keys per SQL statement in batch lookups (SQLite's variable limit is >= 999)
_EVICT_BATCH = 64
# Names we create; cleanup never touches anything else (the folder may hold other files).

_SCHEMA = f"""
BEGIN IMMEDIATE;
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY,
    file TEXT NOT NULL,
    size INTEGER NOT NULL,
    access_time REAL NOT NULL,
    store_time REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_access_time ON entries(access_time);
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO settings VALUES ('schema', {SCHEMA_VERSION}), ('count', 0), ('size', 0);
CREATE TRIGGER IF NOT EXISTS entries_insert AFTER INSERT ON entries BEGIN
    UPDATE settings SET value = value + 1 WHERE key = 'count';
    UPDATE settings SET value = value + NEW.size WHERE key = 'size';
END;
CREATE TRIGGER IF NOT EXISTS entries_update AFTER UPDATE OF size ON entries BEGIN
    UPDATE settings SET value = value + NEW.size - OLD.size WHERE key = 'size';
END;
CREATE TRIGGER IF NOT EXISTS entries_delete AFTER DELETE ON entries BEGIN
    UPDATE settings SET value = value - 1 WHERE key = 'count';
    UPDATE settings SET value = value - OLD.size WHERE key = 'size';
END;
COMMIT;
"""

_UPSERT = """
INSERT INTO entries (key, file, size, access_time, store_time) VALUES (?, ?, ?, ?, ?)
ON CONFLICT(key) DO UPDATE SET file = excluded.file, size = excluded.size,
    access_time = excluded.access_time, store_time = excluded.store_time
"""


class DiskBackend(BackendBase):
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
    ) -> None:
        super().__init__(max_bytes=max_bytes)
        self.readonly = bool(readonly)
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
        self._reset_connections()
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
        except sqlite3.Error as exc:
            self.close()
            raise OSError(f"file cache: cannot read the index of {self.root}: {exc}") from exc

    def _writable(self) -> None:
        if self.readonly:
            raise PermissionError(f"{self.root} is opened read-only")

    # ------------------------------------------------------------ connections

    def _reset_connections(self) -> None:
        self._pid = os.getpid()
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []

    def _db(self) -> sqlite3.Connection:
        """This thread's connection; a forked child opens its own, never the parent's."""
        if self._pid != os.getpid():
            self._reset_connections()  # the parent's connections are left alone, not closed
        conn = getattr(self._local, "conn", None)
        if conn is None and self.readonly:
            conn = self._connect_readonly()
        elif conn is None:
            conn = sqlite3.connect(
                self._index, timeout=self.timeout, isolation_level=None, check_same_thread=False
            )
            conn.execute("PRAGMA synchronous=NORMAL")  # files are fsynced before their row
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    def _connect_readonly(self) -> sqlite3.Connection:
        """``mode=ro``; in a folder we cannot write (no -shm to create), ``immutable=1``."""
        uri = self._index.absolute().as_uri()
        for flags in ("mode=ro", "mode=ro&immutable=1"):
            conn = sqlite3.connect(
                f"{uri}?{flags}", uri=True, timeout=self.timeout, isolation_level=None,
                check_same_thread=False,
            )  # fmt: skip
            try:
                conn.execute("SELECT count(*) FROM settings").fetchone()
                return conn
            except sqlite3.OperationalError:
                conn.close()
                if flags.endswith("immutable=1"):
                    raise
        raise AssertionError("unreachable")

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                try:
                    db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            raise

    def _open_index(self) -> None:
        """Create the schema (WAL mode); an index that is not a database is set aside."""
        deadline = time.monotonic() + self.timeout
        attempt = 0
        db: sqlite3.Connection | None = None
        while True:
            try:
                db = self._db()
                if db.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                    db.execute("PRAGMA journal_mode=WAL")
                db.executescript(_SCHEMA)
                row = db.execute("SELECT value FROM settings WHERE key='schema'").fetchone()
                schema = row[0] if row else None
                if type(schema) is not int or schema < 1:
                    raise sqlite3.DatabaseError(f"index schema row is corrupt ({schema!r:.20})")
                break
            except sqlite3.OperationalError as exc:
                if db is not None and db.in_transaction:
                    db.execute("ROLLBACK")
                # another process may be switching the new index to WAL mode right now
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise  # I/O error, read-only folder...: a problem to report at open
                time.sleep(0.05)
            except sqlite3.DatabaseError as exc:
                attempt += 1
                if attempt > 1:
                    raise
                log.warning(
                    "file cache: %s is unreadable (%s); starting a new index", self._index, exc
                )
                self.close()
                stamp = f"{int(time.time())}-{os.getpid()}"
                for suffix in ("", "-wal", "-shm"):
                    src = Path(f"{self._index}{suffix}")
                    try:
                        os.replace(src, self._quarantine / f"index-{stamp}.sqlite{suffix}")
                    except FileNotFoundError:
                        pass
                ensure_file(self._index, self._file_mode)
        if schema > SCHEMA_VERSION:
            raise ValueError(
                f"{self._index} has index schema {schema}; this mlxcache knows {SCHEMA_VERSION}"
            )

    # ------------------------------------------------------------ housekeeping

    def _sweep(self) -> None:
        """Remove debris of dead writers (see :func:`disk_files.sweep_debris`)."""
        try:
            sweep_debris(self._tmp, self._data, self._quarantine, self._indexed_files)
        except (OSError, sqlite3.Error) as exc:
            log.warning("file cache: cleanup of %s failed: %s", self.root, exc)

    def _indexed_files(self) -> set[str]:
        rows = self._db().execute("SELECT CAST(file AS BLOB) FROM entries")
        return {f.decode("utf-8", "replace") for (f,) in rows if isinstance(f, bytes)}

    def _file_of(self, key: str, file: Any) -> str | None:
        """An index row's file name if it is one we write for ``key``, else None.

        Rows are data read from a shared folder: a name outside ``data/``, of another key or
        not text at all is never opened, moved or unlinked.
        """
        if isinstance(file, bytes):
            try:
                file = file.decode("utf-8")
            except UnicodeDecodeError:
                return None
        if not isinstance(file, str):
            return None
        sub, _, name = file.partition("/")
        m = DATA_NAME.fullmatch(name)
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
        if m is None or m[1] != digest or sub != digest[:2]:
            return None
        return file

    def _drop_rows(self, rows: list[tuple[str, Any]]) -> None:
        """Unindex rows that name no file of ours (their files are left alone)."""
        with self._transaction() as db:
            for key, file in rows:
                db.execute(
                    "DELETE FROM entries WHERE key = ? AND CAST(file AS BLOB) = ?", (key, file)
                )
        for key, _ in rows:
            self.error("get", f"dropped a malformed index row for {key!r:.80}", logged=True)
            log.warning("file cache: dropped a malformed index row for %r", key)

    def _evict(self, db: sqlite3.Connection, limit: int, keep: str = "") -> list[str]:
        """Delete least recently used rows (never ``keep``) until the total fits ``limit``."""
        files: list[str] = []
        (total,) = db.execute("SELECT value FROM settings WHERE key='size'").fetchone()
        total = total if type(total) is int else 0
        while total > limit:
            rows = db.execute(
                "SELECT key, file, size FROM entries WHERE key != ? ORDER BY access_time LIMIT ?",
                (keep, _EVICT_BATCH),
            ).fetchall()
            if not rows:
                break
            for key, file, size in rows:
                db.execute("DELETE FROM entries WHERE key = ?", (key,))
                if isinstance(key, str) and self._file_of(key, file):
                    files.append(file)
                total -= size if type(size) is int else 0
                if total <= limit:
                    break
        return files

    def _remove_files(self, files: Iterable[str | None]) -> None:
        """Delete files the index no longer names (after the commit that dropped them), and
        their shard folder once it is empty (a put recreates it, see ``_put``)."""
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
        if self._settings()["size"] <= max_bytes:
            return 0
        with self._transaction() as db:
            evicted = self._evict(db, max_bytes)
        self._remove_files(evicted)
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

    def _lookup(self, keys: list[str]) -> dict[str, str]:
        """key -> file of the indexed keys; a malformed row is unindexed (one key, not a batch)."""
        db = self._db()
        found: dict[str, str] = {}
        bad: list[tuple[str, Any]] = []
        for i in range(0, len(keys), _CHUNK):
            chunk = keys[i : i + _CHUNK]
            marks = ",".join("?" * len(chunk))
            rows = db.execute(
                f"SELECT key, CAST(file AS BLOB) FROM entries WHERE key IN ({marks})", chunk
            )
            for key, raw in rows:
                file = self._file_of(key, raw)
                if file is None:
                    bad.append((key, raw))
                else:
                    found[key] = file
        if bad:
            self._drop_rows(bad)
        return found

    def _row_file(self, key: str) -> str | None:
        row = (
            self._db()
            .execute("SELECT CAST(file AS BLOB) FROM entries WHERE key = ?", (key,))
            .fetchone()
        )
        return None if row is None else self._file_of(key, row[0])

    def _load(self, key: str, file: str | None, read=None) -> tuple[Any, str | None]:
        """Read ``key`` from ``file``; follows a concurrent re-put, misses a concurrent delete."""
        read = read or functools.partial(st.read_file, key=key, signer=self.signer)
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
        now = time.time()
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
        now = time.time()
        with self._transaction() as db:
            db.executemany(
                "UPDATE entries SET access_time = ? WHERE key = ?", [(now, k) for k in keys]
            )

    def _header(self, key: str) -> st.Header | None:
        """Metadata and tensor table of ``key`` without its tensor data (``mlxcache inspect``)."""
        return self._load(key, self._lookup([key]).get(key), st.read_header)[0]

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
        cur = self._db().execute(
            "SELECT CAST(key AS BLOB) FROM entries WHERE key >= ? ORDER BY key", (prefix,)
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

    def _settings(self) -> dict[str, int]:
        """count, size and schema; a value that is not an int (a damaged row) reads as 0."""
        rows = self._db().execute("SELECT key, value FROM settings")
        out = {"count": 0, "size": 0}
        out.update((k, v if type(v) is int else 0) for k, v in rows if isinstance(k, str))
        return out

    def _count(self) -> int:
        return self._settings()["count"]

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
        return {"entries": settings["count"], "bytes": settings["size"]}

    def describe(self) -> dict[str, Any]:
        signed_by = self.signer.key_id if self.signer else None  # a public id, not the secret
        return {"path": str(self.root), "signed_by": signed_by}

    # ------------------------------------------------------------ writes

    def _prepare(self, key: str, record: Record) -> tuple[Any, int]:
        # bad dtypes raise here, before any file exists
        head, views = st.encode(record, key=key, signer=self.signer)
        return (head, views), len(head) + sum(v.nbytes for v in views)

    def _put(self, key: str, payload: Any, size: int) -> int:
        self._writable()
        head, views = payload
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
        token = secrets.token_hex(6)
        pid = os.getpid()
        name = f"{digest[:2]}/{digest}-{pid}-{token}{SUFFIX}"
        tmp = self._tmp / f"{pid}-{token}.tmp"
        final = self._data / name
        try:
            write_file(str(tmp), head, views, self._file_mode)
            for attempt in (1, 2):  # clear() may remove an empty shard folder meanwhile
                if not final.parent.is_dir():
                    ensure_dir(final.parent, self._dir_mode)
                    fsync_dir(self._data)
                try:
                    os.replace(tmp, final)
                    break
                except FileNotFoundError:
                    if attempt == 2 or not tmp.exists():
                        raise
            fsync_dir(final.parent)
            now = time.time()
            with self._transaction() as db:
                row = db.execute(
                    "SELECT CAST(file AS BLOB) FROM entries WHERE key = ?", (key,)
                ).fetchone()
                db.execute(_UPSERT, (key, name, size, now, now))
                evicted = [] if self.max_bytes is None else self._evict(db, self.max_bytes, key)
        except BaseException:  # nothing was published: leave no file behind
            unlink(tmp)
            unlink(final)
            raise
        self._remove_files([self._file_of(key, row[0]) if row else None, *evicted])
        return len(evicted)

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

    def _close(self) -> None:
        """Close this process's index connections; a later call opens them again."""
        with self._conns_lock:
            conns, self._conns = self._conns, []
            self._local = threading.local()
        if self._pid != os.getpid():
            return
        for conn in conns:
            try:
                conn.close()
            except sqlite3.Error:
                pass

    def __repr__(self) -> str:
        return f"DiskBackend({str(self.root)!r}, max_bytes={self.max_bytes})"


def from_uri(url: SplitResult, opts: Options) -> DiskBackend:
    """``file:///abs/path`` or ``file://~/rel`` (home), ``?max_bytes=20GiB&timeout=10``."""
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
    opts.done()
    return DiskBackend(
        root, max_bytes=max_bytes, timeout=timeout, secret_env=secret_env,
        shared_group=shared_group, readonly=readonly,
    )  # fmt: skip
