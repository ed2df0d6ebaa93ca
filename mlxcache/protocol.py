"""The CacheBackend protocol: what every backend promises, below every module that uses one.

Its policy (argument checks, budgets, failures read as misses) is implemented once in
:class:`mlxcache.backends.base.BackendBase`; see docs/backends.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol, TypeGuard, runtime_checkable

from mlxcache.records.record import Record


@runtime_checkable
class CacheBackend(Protocol):
    """Stores Records under string keys. Knows nothing of models, tokens or images.

    Failures of the store itself (a dead server, a corrupt file, a full disk) never raise:
    ``get`` answers ``None`` and ``put`` does nothing, both counted in ``stats()["errors"]``.
    Wrong arguments (a key that is not a str, a record that is not a Record) raise at once.
    """

    def get(self, key: str) -> Record | None: ...
    def put(self, key: str, record: Record) -> None: ...
    def delete(self, key: str) -> bool: ...
    def __contains__(self, key: object) -> bool: ...
    def keys(self, prefix: str = "") -> Iterator[str]: ...
    def __len__(self) -> int: ...
    def clear(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...
    def get_many(self, keys: Iterable[str]) -> list[Record | None]: ...
    def contains_many(self, keys: Iterable[str]) -> list[bool]: ...
    def __enter__(self) -> CacheBackend: ...
    def __exit__(self, *exc: object) -> None: ...


class PinnableBackend(CacheBackend, Protocol):
    """A backend with pins (optional: BackendBase has them, ``pinnable`` says if they work)."""

    pinnable: bool

    def pin(self, key: str) -> bool: ...
    def unpin(self, key: str) -> bool: ...


class TrimmableBackend(CacheBackend, Protocol):
    """A backend with ``trim`` (optional: BackendBase has it)."""

    def trim(self, max_bytes: int) -> int: ...


def can_pin(backend: object) -> TypeGuard[PinnableBackend]:
    """Whether ``backend`` keeps pinned entries: its ``pinnable`` attribute, False if none."""
    return bool(getattr(backend, "pinnable", False))
