"""How a file reaches the disk on this platform: the one place that picks the sync call.

On Linux ``fsync`` flushes a file to stable storage, and ``syncfs`` a whole filesystem. On
macOS ``fsync`` only hands the data to the drive, whose write cache may still lose it on
power loss: ``fcntl(F_FULLFSYNC)`` also flushes that cache (the drive's whole cache, so one
call after the ordinary fsyncs of a batch makes all of them durable). SQLite's ``fullfsync``
pragmas make its index use it too. :func:`for_platform` is the choice, a function of the
platform name so a test on Linux can check what macOS gets. See docs/reliability.md.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

F_FULLFSYNC = getattr(fcntl, "F_FULLFSYNC", 51)  # <sys/fcntl.h> on macOS


def full_fsync(fd: int) -> None:
    """``fcntl(fd, F_FULLFSYNC)``; ``fsync`` where the filesystem refuses it (as SQLite does)."""
    try:
        fcntl.fcntl(fd, F_FULLFSYNC)
    except OSError:
        os.fsync(fd)


def _load_syncfs() -> Callable[[int], int] | None:
    """libc's ``syncfs(fd)`` (Linux: flush one filesystem), or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


@dataclass(frozen=True)
class Durability:
    """The sync calls of one platform: ``file`` makes one file or folder durable (``fsync``
    or ``F_FULLFSYNC``), ``batch`` many at once (``syncfs``: one call per filesystem;
    ``fsync+F_FULLFSYNC``: fsync each, then one full flush; ``fsync``: each), ``pragmas`` are
    what the SQLite index runs on open."""

    platform: str
    file: str
    batch: str
    pragmas: tuple[str, ...] = ()

    def sync_fd(self, fd: int) -> None:
        if self.file == "F_FULLFSYNC":
            full_fsync(fd)
        else:
            os.fsync(fd)

    def sync_path(self, path: Path | str, folder: bool = False) -> None:
        """Sync a file, or a folder (a no-op where folders cannot be opened or synced)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            if folder:
                return
            raise
        try:
            self.sync_fd(fd)
        except OSError:
            if not folder:
                raise
        finally:
            os.close(fd)

    def sync_batch(self, root: Path, files: list[Path], folders: set[Path]) -> None:
        """Make ``files`` and their names in ``folders`` durable; raises OSError on failure."""
        syncfs = _SYNCFS if self.batch == "syncfs" else None
        if syncfs is not None:
            fd = os.open(root, os.O_RDONLY)
            try:
                if syncfs(fd) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"syncfs of {root} failed: {os.strerror(err)}")
            finally:
                os.close(fd)
            return
        plain = Durability(self.platform, "fsync", "fsync")
        for file in files:
            plain.sync_path(file)
        for folder in folders:
            plain.sync_path(folder, folder=True)
        if self.batch == "fsync+F_FULLFSYNC" and files:
            self.sync_path(files[-1])  # flushes the drive's cache: every fsync above with it


def for_platform(platform: str) -> Durability:
    """The sync calls for ``platform`` (a ``sys.platform`` value)."""
    if platform == "darwin":
        pragmas = ("PRAGMA fullfsync=ON", "PRAGMA checkpoint_fullfsync=ON")
        return Durability(platform, "F_FULLFSYNC", "fsync+F_FULLFSYNC", pragmas)
    if platform.startswith("linux"):
        return Durability(platform, "fsync", "syncfs")
    return Durability(platform, "fsync", "fsync")


_SYNCFS = _load_syncfs() if sys.platform.startswith("linux") else None
CURRENT = for_platform(sys.platform)
