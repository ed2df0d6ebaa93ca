"""The SQLite side of the file:// backend: the index's schema, connections and queries.

``IndexMixin`` is the half of :class:`mlxcache.backends.disk.DiskBackend` that talks to
``index.sqlite`` (WAL mode, one connection per thread and process, totals kept by triggers);
the backend module keeps the files and the protocol. It expects the backend's ``root``,
``_index``, ``_quarantine``, ``_file_mode``, ``timeout``, ``readonly``, ``max_bytes`` and
lifetime attributes.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mlxcache.backends import clock
from mlxcache.backends.base import log
from mlxcache.backends.disk import durable
from mlxcache.backends.disk.files import DATA_NAME, ensure_file

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


class IndexMixin:
    """Connections, transactions, schema and queries of the index (see the module doc)."""

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
            for pragma in durable.CURRENT.pragmas:  # macOS: fullfsync, the drive's cache too
                conn.execute(pragma)
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
                _add_pin_column(db)
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
        total = (total if type(total) is int else 0) - self._pinned(db)[1]  # pins: own budget
        while total > limit:
            rows = db.execute(
                "SELECT key, file, size FROM entries WHERE key != ? AND pinned = 0 "
                "ORDER BY access_time LIMIT ?",
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

    def _live(self) -> tuple[str, tuple[float, float]]:
        """A WHERE clause (and its parameters) true of rows not expired on the clock."""
        now = clock.now()
        born = -1.0 if self.ttl is None else now - self.ttl
        used = -1.0 if self.idle_ttl is None else now - self.idle_ttl
        return f"({self._pinned_col} = 1 OR (store_time > ? AND access_time > ?))", (born, used)

    def _expire(self, db: sqlite3.Connection) -> list[str]:
        """Unindex expired rows (inside a transaction); returns their files to remove."""
        if self.ttl is None and self.idle_ttl is None:
            return []
        live, params = self._live()
        rows = db.execute(
            f"SELECT key, CAST(file AS BLOB) FROM entries WHERE NOT {live}", params
        ).fetchall()
        files = []
        for key, raw in rows:
            db.execute("DELETE FROM entries WHERE key = ?", (key,))
            if isinstance(key, str) and (file := self._file_of(key, raw)):
                files.append(file)
        return files

    def _pinned(self, db: sqlite3.Connection) -> tuple[int, int]:
        """(entries, bytes) of pinned rows."""
        n, size = db.execute(
            f"SELECT COUNT(*), TOTAL(size) FROM entries WHERE {self._pinned_col} = 1"
        ).fetchone()
        return int(n), int(size)

    def _lookup(self, keys: list[str]) -> dict[str, str]:
        """key -> file of the indexed keys; a malformed row is unindexed (one key, not a batch)."""
        db = self._db()
        found: dict[str, str] = {}
        bad: list[tuple[str, Any]] = []
        live, params = self._live()
        for i in range(0, len(keys), _CHUNK):
            chunk = keys[i : i + _CHUNK]
            marks = ",".join("?" * len(chunk))
            rows = db.execute(
                f"SELECT key, CAST(file AS BLOB) FROM entries WHERE key IN ({marks}) AND {live}",
                (*chunk, *params),
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

    def _settings(self) -> dict[str, int]:
        """count, size and schema; a value that is not an int (a damaged row) reads as 0."""
        rows = self._db().execute("SELECT key, value FROM settings")
        out = {"count": 0, "size": 0}
        out.update((k, v if type(v) is int else 0) for k, v in rows if isinstance(k, str))
        return out

    def _close(self) -> None:
        """Close this process's index connections and kept record files; a later call opens
        them again."""
        fds = getattr(self, "_fds", None)
        if fds is not None:
            fds.clear()
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


def _add_pin_column(db: sqlite3.Connection) -> None:
    """Give an index made before pins its ``pinned`` column (0: not pinned)."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(entries)")}
    if "pinned" not in columns:
        db.execute("BEGIN IMMEDIATE")
        try:
            columns = {row[1] for row in db.execute("PRAGMA table_info(entries)")}
            if "pinned" not in columns:  # another process may have just added it
                db.execute("ALTER TABLE entries ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0")
                db.execute(  # pinned bytes are summed at every put: keep that cheap
                    "CREATE INDEX IF NOT EXISTS entries_pinned ON entries(pinned) WHERE pinned = 1"
                )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
