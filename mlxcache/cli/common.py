"""What every ``mlxcache`` subcommand shares: opening a store, telling failure from a miss."""

from __future__ import annotations

import json
import sys
from typing import Any
from urllib.parse import urlsplit

from mlxcache.backends.base import CacheBackend
from mlxcache.options import redact_uri
from mlxcache.uri import open_backend

REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "redis+sentinel")
ONE_SHOT_TIMEOUT = 2.0  # seconds: a command fails fast on a dead or mismatched (TLS) server


class CLIError(Exception):
    """A failure reported as one line on stderr and a non-zero exit code."""


def open_store(uri: str, *, readonly: bool = False, **options: Any) -> CacheBackend:
    """Open ``uri`` for one command; ``readonly`` commands never create or change a cache.

    A ``file://`` folder is then opened read-only (a missing one is an error naming it, a
    read-only one works); a Redis URI without ``timeout=`` gets a short one.
    """
    try:
        parts = urlsplit(uri)
        scheme = parts.scheme.lower()
        if readonly and scheme == "file":
            options.setdefault("readonly", True)
        if scheme in REDIS_SCHEMES and "timeout=" not in parts.query:
            options.setdefault("timeout", ONE_SHOT_TIMEOUT)
        return open_backend(uri, **options)
    except (ValueError, TypeError, OSError) as exc:
        raise CLIError(str(exc)) from None


def errors(backend: CacheBackend, *, rejected: bool = False) -> int:
    """Store failures counted so far by this process (no round trip to the store); with
    ``rejected``, records refused as unsigned or forged count too."""
    counts = getattr(backend, "counters", None)
    found = counts() if callable(counts) else backend.stats()
    return int(found.get("errors", 0)) + (int(found.get("rejected", 0)) if rejected else 0)


def check_reachable(backend: CacheBackend, before: int, uri: str) -> None:
    """The backends turn store failures into misses; a command turns them back into an error."""
    if errors(backend) > before:
        cause = getattr(backend, "last_error", None) or "unreachable or unreadable"
        raise CLIError(f"the cache at {redact_uri(uri)} failed: {cause}")


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=None, sort_keys=True, default=str))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def warn(text: str) -> None:
    print(f"mlxcache: {text}", file=sys.stderr)
