"""One deadline per backend call on Redis: how long a call may wait on a silent server.

redis-py applies ``socket_timeout`` to each read on its own, so one call that makes several
round trips (a pipeline, a reconnect and its handshake, a WATCH re-read, the slices of a large
value, a cluster's slot-map refresh) could wait that long on each of them: against a hung
server (it accepts connections and never answers) a ``get`` with ``timeout=0.5`` took 2 s.
Here a call opens a :func:`scope` and every socket operation of a connection made by
:func:`arm` waits at most what is left of it. A reply puts the deadline back at ``timeout``
from now, so a large value that keeps arriving is never cut; silence, counted across all the
round trips of the call, is what ends it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, cast

import redis

_MIN_WAIT = 0.001  # a spent deadline still polls the socket once: a reply already there is read

_current: ContextVar[_Deadline | None] = ContextVar("mlxcache_redis_deadline", default=None)


class _Deadline:
    __slots__ = ("timeout", "until")

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.until = time.monotonic() + timeout

    def left(self) -> float:
        return max(self.until - time.monotonic(), _MIN_WAIT)

    def answered(self) -> None:
        self.until = time.monotonic() + self.timeout


@contextlib.contextmanager
def scope(timeout: float) -> Iterator[None]:
    """Run the block under one deadline of ``timeout`` seconds of silence (this thread)."""
    token = _current.set(_Deadline(timeout))
    try:
        yield
    finally:
        _current.reset(token)


class DeadlineConnection:
    """Mixed into a redis-py connection class: each connect, send and read waits at most what
    is left of the current call's deadline (and never more than the configured timeouts)."""

    # the connection class's own, found by the MRO (declared for type checkers)
    _sock: Any
    socket_timeout: float | None
    socket_connect_timeout: float | None
    connect: Any

    def _wait(self, configured: float | None) -> float | None:
        d = _current.get()
        if d is None:
            return configured
        left = d.left()
        return left if configured is None else min(configured, left)

    def _connect(self) -> Any:
        configured = self.socket_connect_timeout
        self.socket_connect_timeout = self._wait(configured)
        try:
            return cast(Any, super())._connect()
        finally:
            self.socket_connect_timeout = configured

    def _arm_socket(self) -> None:
        sock = self._sock
        if sock is not None:
            sock.settimeout(self._wait(self.socket_timeout))

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if self._sock is None:
            self.connect()  # within the deadline, and the send below too
        self._arm_socket()
        cast(Any, super()).send_packed_command(command, check_health)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        self._arm_socket()
        reply = cast(Any, super()).read_response(*args, **kwargs)
        d = _current.get()
        if d is not None:
            d.answered()
        return reply


_CLASSES: dict[type, type] = {}


def arm(pool: redis.ConnectionPool) -> redis.ConnectionPool:
    """Make ``pool``'s new connections keep the call deadline (its class, mixed once)."""
    cls = pool.connection_class
    if not issubclass(cls, DeadlineConnection):
        mixed = _CLASSES.get(cls)
        if mixed is None:
            mixed = _CLASSES[cls] = type(f"Deadline{cls.__name__}", (DeadlineConnection, cls), {})
        pool.connection_class = mixed
    return pool
