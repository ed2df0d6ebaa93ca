"""A bounded background queue of store writes, so a caller's next token does not wait on I/O.

One daemon thread runs the submitted jobs in order. The queue is bounded by a job count and a
byte total; when it is full, ``submit`` either drops the job at once (``full="drop"``) or waits
at most ``max_wait`` seconds for room and then drops it (``full="wait"``): inference is never
blocked longer than that, and every dropped job is counted. ``flush()`` waits until everything
queued so far ran; ``close()`` flushes and stops the thread; writers still open at interpreter
exit are flushed then. A job that raises is logged and counted, never re-raised.

MLX rule: a lazy array cannot be evaluated on another thread. Callers ``mx.eval`` what a job
will touch before submitting it (``submit_put`` does it for a Record).
"""

from __future__ import annotations

import atexit
import collections
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlxcache.backends.base import RateLimitedLog
from mlxcache.records.record import Record

FULL_POLICIES = ("wait", "drop")
DEFAULT_QUEUE = 64
DEFAULT_QUEUE_BYTES = 1024**3
DEFAULT_MAX_WAIT = 0.05

_open: weakref.WeakSet[BackgroundWriter] = weakref.WeakSet()
_log = RateLimitedLog()


class BackgroundWriter:
    """Runs jobs on one daemon thread from a queue of at most ``queue`` jobs and
    ``queue_bytes`` bytes (a single job larger than that is still taken when the queue is
    empty). ``full`` is ``"wait"`` (wait up to ``max_wait`` s for room, then drop) or
    ``"drop"`` (drop at once)."""

    def __init__(
        self,
        *,
        queue: int = DEFAULT_QUEUE,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
        full: str = "wait",
        max_wait: float = DEFAULT_MAX_WAIT,
        name: str = "mlxcache-writer",
    ) -> None:
        if isinstance(queue, bool) or not isinstance(queue, int) or queue < 1:
            raise ValueError(f"queue must be an int >= 1, got {queue!r}")
        if isinstance(queue_bytes, bool) or not isinstance(queue_bytes, int) or queue_bytes < 1:
            raise ValueError(f"queue_bytes must be an int >= 1, got {queue_bytes!r}")
        if full not in FULL_POLICIES:
            raise ValueError(f"full must be one of {', '.join(FULL_POLICIES)}, got {full!r}")
        if not 0 <= max_wait < float("inf"):
            raise ValueError(f"max_wait must be a finite number of seconds >= 0, got {max_wait!r}")
        self.queue, self.queue_bytes = queue, queue_bytes
        self.full, self.max_wait, self.name = full, max_wait, name
        self._cond = threading.Condition()
        self._jobs: collections.deque[tuple[Callable[[], Any], int]] = collections.deque()
        self._bytes = 0
        self._running = False  # a job is being run right now
        self._closed = False
        self._thread: threading.Thread | None = None
        self.counts = {"queued": 0, "written": 0, "dropped": 0, "failed": 0, "waited_s": 0.0}
        _open.add(self)

    # ------------------------------------------------------------ submitting

    def submit(self, job: Callable[[], Any], nbytes: int = 0) -> bool:
        """Queue ``job`` (bounded wait); False if it was dropped (queue full or closed)."""
        with self._cond:
            if self._closed:
                self.counts["dropped"] += 1
                return False
            if not self._room(nbytes) and self.full == "wait" and self.max_wait > 0:
                t0 = time.monotonic()
                deadline = t0 + self.max_wait
                while not self._room(nbytes) and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                self.counts["waited_s"] += time.monotonic() - t0
            if self._closed or not self._room(nbytes):
                self.counts["dropped"] += 1
                _log.warning(
                    "dropped", "%s: queue full (%d jobs, %d bytes): dropped a write",
                    self.name, len(self._jobs), self._bytes,
                )  # fmt: skip
                return False
            self._jobs.append((job, nbytes))
            self._bytes += nbytes
            self.counts["queued"] += 1
            self._start()
            self._cond.notify_all()
            return True

    def submit_put(self, backend: Any, key: str, record: Record) -> bool:
        """Queue ``backend.put(key, record)``; the record's arrays are evaluated here first."""
        mx.eval(list(record.arrays.values()))
        return self.submit(lambda: backend.put(key, record), record.nbytes)

    def _room(self, nbytes: int) -> bool:
        if not self._jobs:
            return True
        return len(self._jobs) < self.queue and self._bytes + nbytes <= self.queue_bytes

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    # ------------------------------------------------------------ the thread

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return  # closed and drained
                job, nbytes = self._jobs[0]
                self._running = True
            try:
                job()
                ok = True
            except Exception as exc:  # a job's failure must not kill the writer
                ok = False
                _log.warning("failed", "%s: a background write failed: %r", self.name, exc)
            with self._cond:
                self._jobs.popleft()
                self._bytes -= nbytes
                self._running = False
                self.counts["written" if ok else "failed"] += 1
                self._cond.notify_all()

    # ------------------------------------------------------------ waiting

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        with self._cond:
            return len(self._jobs)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job queued so far ran; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self.counts["queued"]
            while self.counts["written"] + self.counts["failed"] < target and self._jobs:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if self._thread is None or not self._thread.is_alive():
                    self._start()
                self._cond.wait(left)
            return True

    def close(self, timeout: float | None = None) -> None:
        """Flush, then stop the thread; later submits are dropped (and counted)."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        _open.discard(self)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            out: dict[str, Any] = dict(self.counts)
            out["pending"] = len(self._jobs)
            out["pending_bytes"] = self._bytes
        out["waited_s"] = round(out["waited_s"], 6)
        return out


@atexit.register
def _flush_all_at_exit() -> None:
    """Writes queued when the interpreter exits are written (daemon threads die after this)."""
    for w in list(_open):
        try:
            w.close()
        except Exception as exc:  # exit must go on
            _log.warning("exit", "%s: flush at exit failed: %r", w.name, exc)
