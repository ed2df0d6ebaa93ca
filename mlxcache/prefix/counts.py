"""What a PrefixCache counts for ``stats()`` (``NAMES``, in a ``Counters``) and how long its
calls take: ``timed(op)`` wraps a public method so every call of it (a failed one too) lands in
the object's ``latency`` histogram, read by ``mlxcache.metrics`` as
``mlxcache_prefix_{op}_seconds``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

NAMES = ("lookups", "hits", "misses", "tokens_requested", "tokens_reused", "vision_hits",
         "stores", "tokens_written", "records_written", "rejected", "records_pinned",
         "pins_refused", "records_healed", "blocks_completed")  # fmt: skip

F = TypeVar("F", bound=Callable[..., Any])


def timed(op: str) -> Callable[[F], F]:
    """Time every call of the decorated method in ``self.latency`` under ``op``."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def timed_call(self: Any, *args: Any, **kwargs: Any) -> Any:
            with self.latency.timer(op):
                return method(self, *args, **kwargs)

        return cast(F, timed_call)

    return wrap
