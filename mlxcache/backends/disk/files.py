"""File primitives of the disk backend: create-and-fsync, durable renames, writer liveness."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from mlxcache.backends.base import log
from mlxcache.backends.disk import durable

STALE_SECONDS = 3600.0  # debris older than this is removed even if its writer still runs
QUARANTINE_SECONDS = 7 * 86400.0
# The only names the disk backend creates: cleanup never touches anything else.
TMP_NAME = re.compile(r"(\d+)-[0-9a-f]+\.tmp")
DATA_NAME = re.compile(r"([0-9a-f]{64})-(\d+)-[0-9a-f]+\.safetensors")
INDEX_NAME = re.compile(r"index-\d+-\d+\.sqlite(?:-wal|-shm)?")


# (folder mode, file mode): private to the owner by default; ``shared_group=true`` opens the
# cache to the folder's group on purpose (setgid folders, so new files keep that group).
PRIVATE_MODES = (0o700, 0o600)
GROUP_MODES = (0o2770, 0o660)


def ensure_dir(path: Path, mode: int) -> None:
    """Create ``path`` (and missing parents) and give it exactly ``mode``, whatever the umask.

    An existing folder of ours is set to ``mode`` too (caches made by older versions were
    world-readable); one owned by someone else is left as it is.
    """
    path.mkdir(parents=True, exist_ok=True, mode=mode & 0o777)
    _set_mode(path, mode)


def ensure_file(path: Path, mode: int) -> None:
    """Create ``path`` if missing (empty) with exactly ``mode``; tighten an existing one of ours.

    An existing file is never opened: closing any descriptor of a file drops every POSIX lock
    this process holds on it, and SQLite's locks on the index (and its -shm) are such locks.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, mode)
    except FileExistsError:
        pass
    else:
        os.close(fd)
    _set_mode(path, mode)


def _set_mode(path: Path | str, mode: int) -> None:
    try:
        st = os.stat(path)
        if st.st_uid == os.getuid() and (st.st_mode & 0o7777) != mode:
            os.chmod(path, mode)
    except FileNotFoundError:
        pass


def write_file(
    path: str, head: bytes, views: list[memoryview], mode: int = 0o600, *, fsync: bool = True
) -> None:
    """Create ``path`` (it must not exist) with exactly ``mode``, write the blob straight from the
    buffers, fsync unless ``fsync=False`` (the caller syncs later, or never)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have removed bits we want (group modes)
    except BaseException:
        os.close(fd)
        raise
    with open(fd, "wb") as f:
        f.write(head)
        for view in views:
            f.write(view)  # large buffers go to the OS without a copy
        f.flush()
        if fsync:
            durable.CURRENT.sync_fd(f.fileno())  # F_FULLFSYNC on macOS


def fsync_dir(path: Path) -> None:
    """Make a rename or a new name in ``path`` durable (a no-op where folders cannot be synced)."""
    durable.CURRENT.sync_path(path, folder=True)


def unlink(path: Path | str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("file cache: could not remove %s: %s", path, exc)


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, owned by someone else
        return True
    return True


def sweep_debris(
    tmp: Path, data: Path, quarantine: Path, indexed_files: Callable[[], set[str]]
) -> None:
    """Remove debris of dead writers: temp files, and data files never published or unlinked.

    Only names the disk backend creates are considered: anything else in the folder is not
    ours. Order matters: list the files, then check their writers, then read the index
    (``indexed_files``). A writer found dead cannot publish later, so a file it published is
    seen in the index. Raises OSError or sqlite3.Error; the caller logs them.
    """
    now = time.time()
    me = os.getpid()
    alive: dict[int, bool] = {}

    def debris(entry: os.DirEntry, pid: int) -> bool:
        try:
            age = now - entry.stat().st_mtime
        except OSError:
            return False
        if age > STALE_SECONDS:
            return True
        if pid == me:
            return False
        if pid not in alive:
            alive[pid] = pid_alive(pid)
        return not alive[pid]

    for entry in os.scandir(tmp):
        m = TMP_NAME.fullmatch(entry.name)
        if m and entry.is_file() and debris(entry, int(m[1])):
            unlink(entry.path)
    candidates: list[str] = []
    for sub in os.scandir(data):
        if not (len(sub.name) == 2 and sub.is_dir()):
            continue
        for entry in os.scandir(sub.path):
            m = DATA_NAME.fullmatch(entry.name)
            if not m or not m[1].startswith(sub.name) or not entry.is_file():
                continue
            if debris(entry, int(m[2])):
                candidates.append(f"{sub.name}/{entry.name}")
    if candidates:
        indexed = indexed_files()
        for name in candidates:
            if name not in indexed:
                unlink(data / name)
    for entry in os.scandir(quarantine):
        ours = DATA_NAME.fullmatch(entry.name) or INDEX_NAME.fullmatch(entry.name)
        if ours and entry.is_file() and now - entry.stat().st_mtime > QUARANTINE_SECONDS:
            unlink(entry.path)
