"""Blocks written without a window layer's slice: their marks, and the store that completes them.

A block record is content-addressed, so a later store that holds a gapped block's window slices
would skip it as stored. Each block written with ``meta["absent"]`` therefore leaves a mark
``g/<h>`` (an empty record, written before the block). A store asks for the marks of the blocks
it could fill (every window layer holds them) in the same ``contains_many`` as its own keys,
rewrites each marked one whole (one atomic put: a reader sees the gapped record or the whole
one, both valid) and deletes the mark once the rewrite is in. See docs/prefix.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxcache.protocol import CacheBackend
from mlxcache.records.record import Record
from mlxcache.serializers.windows import Held

KIND = "g"  # the key kind of a mark: .../g/<h> beside the block .../b/<h>


def holds(views: dict[int, Held], start: int, end: int) -> bool:
    """Whether every window layer holds positions ``[start, end)`` (a block it can fill)."""
    return bool(views) and all(h.take(start, end) is not None for h in views.values())


def overlaps(spans: Sequence[tuple[int, int]], start: int, end: int) -> bool:
    return any(lo < end and start < hi for lo, hi in spans)


def mark(rec: Record) -> Record | None:
    """The mark of a block record written without some window layer (else None)."""
    absent = rec.meta.get("absent")
    if not absent:
        return None
    return Record(arrays={}, meta={"kind": "gap", "absent": list(absent)})


def errors(backend: CacheBackend) -> int | None:
    """The backend's error count (None when it keeps none)."""
    counters = getattr(backend, "counters", None)
    return counters().get("errors", 0) if counters is not None else None


def clear(backend: CacheBackend, marks: list[str], errors_before: int | None) -> bool:
    """Delete the marks of blocks just rewritten whole (one ``delete`` each, once per gapped
    block ever); none when a rewrite may have failed (the backend counted an error since
    ``errors_before``): the marks stay and a later store that holds the blocks tries again."""
    if not marks or (errors_before is not None and errors(backend) != errors_before):
        return False
    for k in marks:
        backend.delete(k)
    return True


__all__ = ["KIND", "clear", "errors", "holds", "mark", "overlaps"]
