"""The wall clock of entry lifetimes (``ttl``, ``idle_ttl``), replaceable by tests.

Backends read time through :func:`now`, never ``time.time`` directly, so a test sets
``clock.clock`` to a fake it advances by hand: expiry is tested without sleeping. Redis keeps
its own time (``TIME`` in the scripts); it is moved by :func:`offset`, how far this clock is
ahead of the real one (0 unless a test replaced it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

clock: Callable[[], float] = time.time


def now() -> float:
    """Seconds since the epoch, as the lifetime clock says."""
    return clock()


def offset() -> float:
    """Seconds the lifetime clock is ahead of the real clock (0.0 with the default clock)."""
    return 0.0 if clock is time.time else clock() - time.time()


def check_lifetime(name: str, value: object) -> float | None:
    """``value`` if it is None or a number of seconds > 0, else ValueError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be > 0 seconds or None, got {value!r}")
    return float(value)


def lifetime_options(opts: Any) -> dict[str, Any]:
    """``ttl``, ``idle_ttl`` (seconds) and ``pin_max_bytes`` from URI options."""
    return {
        "ttl": opts.float("ttl", None, minimum=0.001),
        "idle_ttl": opts.float("idle_ttl", None, minimum=0.001),
        "pin_max_bytes": opts.size("pin_max_bytes", None),
    }
