"""msgpack encoding of record metadata: plain data only, never code."""

from __future__ import annotations

from typing import Any

import msgpack


def pack(obj: Any) -> bytes:
    """Encode plain data (str, bytes, int, float, bool, None, list, tuple, str-keyed dict)."""
    try:
        return msgpack.packb(obj, use_bin_type=True, strict_types=False, default=_refuse)
    except (TypeError, OverflowError, ValueError) as exc:
        raise TypeError(f"metadata is not msgpack-encodable: {exc}") from exc


def unpack(data: bytes) -> Any:
    """Decode what :func:`pack` wrote; lists come back as lists (tuples are not kept)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=True)


def _refuse(obj: Any) -> Any:
    raise TypeError(f"cannot encode object of type {type(obj).__name__}: {obj!r:.80}")
