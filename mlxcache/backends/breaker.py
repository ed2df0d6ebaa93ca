"""The reconnect backoff of a backend: skip a store that is not there, try it again later.

A call that finds the store unreachable (refused, reset, timed out) opens the breaker: calls
are skipped (a miss, counted) for a delay that doubles from ``backoff`` to ``max_backoff``
seconds, or for as long as the failed call waited if that was longer (a hung server makes
every call wait its whole timeout: this keeps such waits to at most half of the time). Then
one call tries the store again while the others are still skipped, so a hung store costs one
waiting call at a time, never one per thread.
"""

from __future__ import annotations

import threading
import time


class Breaker:
    """When calls to one store are skipped (see the module doc); thread-safe."""

    def __init__(self, backoff: float, max_backoff: float) -> None:
        if not 0 < backoff <= max_backoff:
            raise ValueError(f"need 0 < backoff <= max_backoff, got {backoff}, {max_backoff}")
        self.backoff, self.max_backoff = backoff, max_backoff
        self._lock = threading.Lock()
        self.down_until = 0.0
        self.delay = backoff
        self.down = False  # the last call found the store unreachable
        self.probing = False  # one call is trying it again

    def skipping(self) -> bool:
        """Whether a call is skipped now: in the backoff, or while one call tries again."""
        return self.probing or time.monotonic() < self.down_until

    def admit(self) -> bool | None:
        """None: skip this call; True: it tries the store again (``release`` it after);
        False: an ordinary call."""
        if not self.down:
            return False
        with self._lock:
            if self.probing or time.monotonic() < self.down_until:
                return None
            self.probing = True
            return True

    def release(self, probe: bool | None) -> None:
        if probe:
            self.probing = False

    def failed(self, spent: float = 0.0) -> None:
        """The store was unreachable (after ``spent`` seconds of waiting): skip calls a while."""
        with self._lock:
            delay = self.delay
            self.down_until = time.monotonic() + max(delay, min(spent, self.max_backoff))
            self.delay = min(delay * 2, self.max_backoff)
            self.down = True

    def ok(self) -> None:
        """The store answered: the next failure starts the backoff from ``backoff`` again."""
        if self.delay != self.backoff or self.down:
            with self._lock:
                self.delay = self.backoff
                self.down = False
