"""The MLLM manager's per-images index: one record per image group listing its entries, in order,
with a prefix sketch of each entry's tokens (lookups read it instead of every entry)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from mlxcache.backends.base import CacheBackend
from mlxcache.errors import RecordTooLargeError
from mlxcache.integrations.vllm_mlx import sketch
from mlxcache.records.record import Record

logger = logging.getLogger("mlxcache.mllm_cache")

ENTRY_PREFIX = "mllm.e."  # + images digest + "." + prompt digest: one entry
INDEX_PREFIX = "mllm.i."  # + images digest: the entries stored with these images, in order
VERSION = 1


def valid_item(item: Any, key_prefix: str) -> bool:
    """Whether an index line has the fields lookups read, with the right types."""
    return (
        isinstance(item, dict)
        and isinstance(item.get("key"), str)
        and item["key"].startswith(key_prefix)
        and item_sketch(item) is not None
        and isinstance(item.get("bytes", 0), int)
        and isinstance(item.get("time", 0.0), int | float)
    )


def item_sketch(item: dict[str, Any]) -> sketch.Sketch | None:
    """The prefix sketch of an index line; lines written before sketches hold every token id."""
    legacy = item.get("tokens")
    if isinstance(legacy, bytes):
        return (
            sketch.sketch(np.frombuffer(legacy, dtype=np.int64)) if len(legacy) % 8 == 0 else None
        )
    return sketch.from_fields(item)


def read_index(backend: CacheBackend, group: str) -> list[dict[str, Any]]:
    """The index lines of one image group; damaged or foreign lines are left out."""
    rec = backend.get(INDEX_PREFIX + group)
    if rec is None or rec.meta.get("v") != VERSION:
        return []
    items = rec.meta.get("entries")
    if not isinstance(items, list):
        return []
    return [i for i in items if valid_item(i, f"{ENTRY_PREFIX}{group}.")]


def write_index(backend: CacheBackend, group: str, items: list[dict[str, Any]]) -> None:
    if items:
        record = Record(meta={"v": VERSION, "entries": items})
        try:
            backend.put(INDEX_PREFIX + group, record)
        except RecordTooLargeError as exc:  # only with a huge number of entries per images
            logger.warning("MLLM cache: index of %s not stored: %s", group[:16], exc)
    else:
        backend.delete(INDEX_PREFIX + group)


def index_add(backend: CacheBackend, group: str, item: dict[str, Any]) -> None:
    items = [i for i in read_index(backend, group) if i["key"] != item["key"]]
    write_index(backend, group, [*items, item])


def index_remove(backend: CacheBackend, group: str, *keys: str) -> None:
    items = read_index(backend, group)
    kept = [i for i in items if i["key"] not in keys]
    if len(kept) != len(items):
        write_index(backend, group, kept)
