"""Crafting record bytes for tests: rewrite a blob's header as a writer of another kind would."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable

from mlxcache.records import format as st


def split(blob: bytes) -> tuple[dict, bytes]:
    """(header JSON, tensor bytes) of a blob."""
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def join(header: dict, data: bytes) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


def rewrite(blob: bytes, edit: Callable[[dict], None]) -> bytes:
    header, data = split(blob)
    edit(header)
    return join(header, data)


def with_version(blob: bytes, version: int, *, valid_check: bool = True) -> bytes:
    """The blob as a writer of format ``version`` would stamp it (a genuine newer record), or
    with only the version field changed (``valid_check=False``: a corrupted version field)."""

    def edit(h: dict) -> None:
        info = h["__metadata__"]
        info["format_version"] = str(version)
        if valid_check:
            info["vcheck"] = st._vcheck(str(version), info["checksum"], info.get("mac", ""))

    return rewrite(blob, edit)
