"""File primitives of the disk backend: create-and-fsync, durable renames, writer liveness."""

from __future__ import annotations

import os
from pathlib import Path

from mlxcache.backends.base import log


def write_file(path: str, head: bytes, views: list[memoryview]) -> None:
    """Create ``path`` (it must not exist), write the blob straight from the buffers, fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    with open(fd, "wb") as f:
        f.write(head)
        for view in views:
            f.write(view)  # large buffers go to the OS without a copy
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename or a new name in ``path`` durable (a no-op where folders cannot be synced)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
