"""msgpack encoding of record metadata: plain data only, never code.

:func:`unpack` is total: any bytes give plain data (None, bool, int, float, str, bytes, lists
and str-keyed dicts) or a :class:`FormatError`, with memory bounded by a small multiple of the
input (containers are counted against a budget of the input size).
"""

from __future__ import annotations

from typing import Any

import msgpack

from mlxcache.errors import FormatError


def pack(obj: Any) -> bytes:
    """Encode plain data (str, bytes, int, float, bool, None, list, tuple, str-keyed dict).

    What :func:`unpack` would refuse (e.g. a non-str key in a nested dict) is refused here, as
    a TypeError, so a writer never stores metadata its readers drop.
    """
    try:
        data = msgpack.packb(obj, use_bin_type=True, strict_types=False, default=_refuse)
    except (TypeError, OverflowError, ValueError) as exc:
        raise TypeError(f"metadata is not msgpack-encodable: {exc}") from exc
    try:
        unpack(data)
    except FormatError as exc:
        raise TypeError(f"metadata is not plain data: {exc}") from None
    return data


def unpack(data: bytes | bytearray | memoryview) -> Any:
    """Decode what :func:`pack` wrote; lists come back as lists (tuples are not kept).

        Anything else (truncated or trailing bytes, extension types, non-str map keys, invalid
        UTF-8, more containers than the input could hold in real metadata) is a FormatError. The
    writer never stores an extension type, so one (a Timestamp too) means the record was not ours.
    """
    budget = [64 + len(data) // 4]  # real metadata has far fewer containers than bytes / 4

    def spend() -> None:
        budget[0] -= 1
        if budget[0] < 0:
            raise FormatError("metadata holds implausibly many containers")

    def pairs(items: list[tuple[Any, Any]]) -> dict[str, Any]:
        spend()
        out = dict(items)
        if len(out) != len(items) or not all(type(k) is str for k in out):
            raise FormatError("metadata map keys must be distinct str")
        _no_timestamps(out.values())
        return out

    def lists(items: list[Any]) -> list[Any]:
        spend()
        _no_timestamps(items)
        return items

    try:
        out = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            object_pairs_hook=pairs,
            list_hook=lists,
            ext_hook=_no_ext,
            timestamp=0,  # a Timestamp object (extension -1, never ext_hook's), refused below
        )
        _no_timestamps([out])
        return out
    except FormatError:
        raise
    except Exception as exc:  # msgpack's ValueError/StackError/ExtraData/UnicodeDecodeError...
        raise FormatError(f"malformed metadata: {type(exc).__name__}: {exc}") from None


def _no_timestamps(values: Any) -> None:
    """msgpack decodes its timestamp extension (-1) itself: refuse it as any extension type."""
    for v in values:
        if type(v) is msgpack.Timestamp:
            raise FormatError("metadata holds a msgpack extension type -1 (a timestamp)")


def _no_ext(code: int, data: bytes) -> Any:
    raise FormatError(f"metadata holds a msgpack extension type {code}")


def _refuse(obj: Any) -> Any:
    raise TypeError(f"cannot encode object of type {type(obj).__name__}: {obj!r:.80}")
