"""The write path of the file:// backend: stage files, make them durable per ``sync``, publish.

``sync`` (the ``?sync=`` URI option) says when written files reach the disk:

- ``always``: each file is fsynced (``F_FULLFSYNC`` on macOS), renamed into ``data/`` and its
  folder fsynced before its row.
- ``batch``: a ``put_many`` writes and renames every file, then syncs once (``syncfs`` of the
  cache's filesystem on Linux; elsewhere each file and each folder once), then publishes every
  row in one transaction. A batch of one is synced as ``always`` syncs it.
- ``never``: no fsync; the OS writes the files back when it likes.

Every mode publishes a file's row only after the file is complete in the page cache, so a
process crash loses nothing; what a power loss can leave (a row naming a torn or missing file)
is read as a checksum failure: a miss and a log line. See docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path
from typing import Any

from mlxcache.backends import clock
from mlxcache.backends.disk import durable
from mlxcache.backends.disk.files import ensure_dir, fsync_dir, unlink, write_file
from mlxcache.backends.disk.index import _UPSERT, SUFFIX

SYNC_MODES = ("always", "batch", "never")
DEFAULT_SYNC = "batch"


def check_sync(value: object) -> str:
    """``value`` if it is one of :data:`SYNC_MODES`, else ValueError."""
    if value not in SYNC_MODES:
        raise ValueError(f"sync must be one of {', '.join(SYNC_MODES)}, got {value!r}")
    return str(value)


def sync_all(root: Path, files: list[Path], folders: set[Path]) -> None:
    """Make ``files`` and their names in ``folders`` durable with as few syncs as we can.

    Linux: one ``syncfs`` of ``root``'s filesystem (it also flushes other dirty files there).
    macOS: one fsync per file and folder, then one ``F_FULLFSYNC`` (the drive's cache).
    Elsewhere: one fsync per file, then one per folder. Raises OSError if a sync fails.
    See :mod:`mlxcache.backends.disk.durable`.
    """
    durable.CURRENT.sync_batch(root, files, folders)


class WriteMixin:
    """``_put`` and ``_put_many`` of :class:`mlxcache.backends.disk.DiskBackend`.

    Expects the backend's ``root``, ``_data``, ``_tmp``, ``_dir_mode``, ``_file_mode``,
    ``sync``, ``max_bytes`` and its index methods (``_transaction``, ``_expire``, ``_evict``,
    ``_file_of``, ``_remove_files``, ``_writable``).
    """

    sync: str = DEFAULT_SYNC

    def _put(self, key: str, payload: Any, size: int) -> int:
        evicted, failed = self._put_many([(key, payload, size)])
        if failed[0] is not None:
            raise failed[0]
        return evicted

    def _put_many(
        self, entries: list[tuple[str, Any, int]]
    ) -> tuple[int, list[BaseException | None]]:
        """Write, sync and publish ``entries``; returns (evicted, the failure of each entry).

        One entry's failure (a full disk) leaves the others to be published; a failure of the
        sync or the transaction raises and publishes none (their files are removed).
        """
        self._writable()
        each = self.sync == "always" or (self.sync == "batch" and len(entries) == 1)
        failed: list[BaseException | None] = [None] * len(entries)
        staged: list[tuple[str, str, int, Path, Path]] = []  # key, name, size, tmp, final
        try:
            for i, (key, (head, views), size) in enumerate(entries):
                try:
                    name, tmp, final = self._stage(key, head, views, each)
                except Exception as exc:  # one entry's failure (a full disk), counted by the base
                    failed[i] = exc
                    continue
                staged.append((key, name, size, tmp, final))
            if staged and self.sync == "batch" and not each:
                finals = [final for *_, final in staged]
                sync_all(self.root, finals, {self._data, *(f.parent for f in finals)})
            olds, expired, evicted = self._publish(staged)
        except BaseException:  # nothing was published: leave no file behind
            for *_, tmp, final in staged:
                unlink(tmp)
                unlink(final)
            raise
        self._remove_files([*olds, *expired, *evicted])
        return len(evicted), failed

    def _stage(self, key: str, head: bytes, views: list, each: bool) -> tuple[str, Path, Path]:
        """Write one file under ``tmp/`` and rename it into ``data/``: (name, tmp, final)."""
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
        token = secrets.token_hex(6)
        pid = os.getpid()
        name = f"{digest[:2]}/{digest}-{pid}-{token}{SUFFIX}"
        tmp = self._tmp / f"{pid}-{token}.tmp"
        final = self._data / name
        try:
            write_file(str(tmp), head, views, self._file_mode, fsync=each)
            for attempt in (1, 2):  # clear() may remove an empty shard folder meanwhile
                if not final.parent.is_dir():
                    ensure_dir(final.parent, self._dir_mode)
                    if each:
                        fsync_dir(self._data)
                try:
                    os.replace(tmp, final)
                    break
                except FileNotFoundError:
                    if attempt == 2 or not tmp.exists():
                        raise
            if each:
                fsync_dir(final.parent)
        except BaseException:
            unlink(tmp)
            unlink(final)
            raise
        return name, tmp, final

    def _publish(
        self, staged: list[tuple[str, str, int, Path, Path]]
    ) -> tuple[list[str | None], list[str], list[str]]:
        """One transaction: upsert every row, expire, evict; returns (replaced, expired,
        evicted) files to remove after the commit. Later entries count as more recent."""
        if not staged:
            return [], [], []
        now = clock.now()
        olds: list[str | None] = []
        with self._transaction() as db:
            for i, (key, name, size, _, _) in enumerate(staged):
                row = db.execute(
                    "SELECT CAST(file AS BLOB) FROM entries WHERE key = ?", (key,)
                ).fetchone()
                olds.append(self._file_of(key, row[0]) if row else None)
                t = now + i * 1e-6  # keeps the batch's order in the LRU, as single puts would
                db.execute(_UPSERT, (key, name, size, t, t))
            expired = self._expire(db)
            last = staged[-1][0]
            evicted = [] if self.max_bytes is None else self._evict(db, self.max_bytes, last)
        return olds, expired, evicted
