"""The chunk manifest of the Redis backend: how a value over ``chunk_size`` is split.

The main key then holds a small manifest (magic line + JSON ``{gen, n, size}``) naming chunk
keys ``{prefix}c:{gen}:{i}``; ``gen`` is new on every write, so a reader never mixes versions.
:func:`parse_manifest` is total: anything but a well-formed manifest within the bounds below is
None (the caller then reads the value as a record, which fails as a FormatError and is dropped).
"""

from __future__ import annotations

import json
import re
from typing import Any

MANIFEST_MAGIC = b"mlxcache-chunks:1\n"  # as a u64 header length this is absurd: never a blob
MAX_MANIFEST_BYTES = 256  # a real one is about 90 bytes
MAX_CHUNKS = 65536  # a writer refuses a record that would need more
MAX_SIZE = 2**50  # 1 PiB: no record is larger
_GEN = re.compile(r"[0-9a-f]{32}")


def make_manifest(gen: str, n: int, size: int) -> bytes:
    return MANIFEST_MAGIC + json.dumps({"gen": gen, "n": n, "size": size}).encode()


def is_manifest(value: bytes) -> bool:
    return value[: len(MANIFEST_MAGIC)] == MANIFEST_MAGIC


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def parse_manifest(value: bytes) -> dict[str, Any] | None:
    """``{gen, n, size}`` of a well-formed manifest, else None (never raises)."""
    if not isinstance(value, bytes | bytearray) or len(value) > MAX_MANIFEST_BYTES:
        return None
    try:
        m = json.loads(value[len(MANIFEST_MAGIC) :], parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(m, dict) or set(m) != {"gen", "n", "size"}:
        return None
    gen, n, size = m["gen"], m["n"], m["size"]
    if not (isinstance(gen, str) and _GEN.fullmatch(gen)):
        return None
    if type(n) is not int or type(size) is not int:
        return None
    if not (1 <= n <= MAX_CHUNKS and n <= size <= MAX_SIZE):
        return None
    return {"gen": gen, "n": n, "size": size}
