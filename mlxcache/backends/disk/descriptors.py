"""A bounded cache of open record files, so a restore does not open every block file again.

Data files are created once under a unique name and never rewritten (only unlinked), so a
descriptor kept for a name reads exactly what opening that name would. What keeps a deleted
or quarantined block from being served is the index: a restore reads only the files the
index names for its keys at that moment. This process drops a name's descriptor when it
deletes, evicts or quarantines that file (:meth:`Descriptors.forget`); a file another process
deleted stays open (its space held) until it leaves the LRU, which is bounded.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator

KEEP = 256  # descriptors kept open (a 32k-token restore of 256-token blocks reads 128 files)


class Descriptors:
    """Open read-only descriptors of data files by file name: LRU, at most ``keep`` idle ones.

    A descriptor in use by a reader is never closed under it: a forgotten or evicted one is
    closed when its last user returns it.
    """

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._open: OrderedDict[str, list[int]] = OrderedDict()  # name -> [fd, users]
        self._doomed: dict[int, int] = {}  # fd -> users, forgotten while in use
        self._lock = threading.Lock()
        self._pid = os.getpid()
        # a backend dropped without close(): its descriptors are closed with it
        weakref.finalize(self, _close_all, self._open, self._pid)

    @contextlib.contextmanager
    def borrow(self, name: str, path: os.PathLike | str) -> Iterator[int]:
        """An open descriptor of data file ``name`` at ``path`` (OSError if it cannot be
        opened), kept for the next restore after use."""
        fd = self._take(name)
        if fd is None:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            fd = self._add(name, fd)
        try:
            yield fd
        finally:
            self._give_back(name, fd)

    def forget(self, names: Iterable[str | None]) -> None:
        """Close the descriptors of these files (deleted, evicted or quarantined here)."""
        with self._lock:
            for name in names:
                if name is not None:
                    self._drop(name)

    def clear(self) -> None:
        """Close every descriptor (the backend closes or clears)."""
        with self._lock:
            for name in list(self._open):
                self._drop(name)

    def __len__(self) -> int:
        return len(self._open)

    # ------------------------------------------------------------ under the lock

    def _take(self, name: str) -> int | None:
        with self._lock:
            self._after_fork()
            got = self._open.get(name)
            if got is None:
                return None
            got[1] += 1
            self._open.move_to_end(name)
            return got[0]

    def _add(self, name: str, fd: int) -> int:
        with self._lock:
            self._after_fork()
            got = self._open.get(name)
            if got is not None:  # another reader opened it meanwhile: use one descriptor
                os.close(fd)
                got[1] += 1
                return got[0]
            self._open[name] = [fd, 1]
            self._trim()
            return fd

    def _give_back(self, name: str, fd: int) -> None:
        with self._lock:
            got = self._open.get(name)
            if got is not None and got[0] == fd:
                got[1] -= 1
                self._trim()
            elif fd in self._doomed:
                self._doomed[fd] -= 1
                if not self._doomed[fd]:
                    del self._doomed[fd]
                    os.close(fd)

    def _drop(self, name: str) -> None:
        got = self._open.pop(name, None)
        if got is None:
            return
        fd, users = got
        if users:
            self._doomed[fd] = users
        else:
            os.close(fd)

    def _trim(self) -> None:
        over = len(self._open) - self.keep
        for name in list(self._open):  # oldest first; ones in use stay
            if over <= 0:
                break
            if not self._open[name][1]:
                self._drop(name)
                over -= 1

    def _after_fork(self) -> None:
        if self._pid != os.getpid():  # a forked child: its copies are its own to close
            for fd, _ in self._open.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._open.clear()
            self._doomed.clear()
            self._pid = os.getpid()


def _close_all(kept: OrderedDict[str, list[int]], pid: int) -> None:
    if os.getpid() != pid:
        return
    for fd, _ in kept.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    kept.clear()
