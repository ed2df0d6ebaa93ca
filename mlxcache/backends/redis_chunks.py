"""The chunk manifest of the Redis backend: how a value over ``chunk_size`` is split.

The main key then holds a small manifest (magic line + JSON ``{gen, n, size}``) naming chunk
keys ``{prefix}c:{gen}:{i}``; ``gen`` is new on every write, so a reader never mixes versions.
"""

from __future__ import annotations

import json
from typing import Any

MANIFEST_MAGIC = b"mlxcache-chunks:1\n"  # as a u64 header length this is absurd: never a blob


def make_manifest(gen: str, n: int, size: int) -> bytes:
    return MANIFEST_MAGIC + json.dumps({"gen": gen, "n": n, "size": size}).encode()


def is_manifest(value: bytes) -> bool:
    return value[: len(MANIFEST_MAGIC)] == MANIFEST_MAGIC


def parse_manifest(value: bytes) -> dict[str, Any] | None:
    """``{gen, n, size}`` of a well-formed manifest, else None."""
    try:
        m = json.loads(value[len(MANIFEST_MAGIC) :])
        if isinstance(m["gen"], str) and int(m["n"]) >= 1 and int(m["size"]) >= 0:
            return {"gen": m["gen"], "n": int(m["n"]), "size": int(m["size"])}
    except (ValueError, KeyError, TypeError):
        pass
    return None


def complete_chunks(m: dict[str, Any], chunks: list[bytes | None]) -> list[bytes] | None:
    """The chunks of a manifest if all are there and add up to its size, else None."""
    if any(c is None for c in chunks) or sum(len(c) for c in chunks) != m["size"]:
        return None
    return chunks  # type: ignore[return-value]
