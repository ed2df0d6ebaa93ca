"""Argument checks every backend applies: keys, records and byte or entry budgets."""

from __future__ import annotations

from mlxcache.records.record import Record


def check_key(key: object) -> str:
    """Return ``key`` if it is a non-empty, UTF-8-encodable str, else raise TypeError/ValueError."""
    if not isinstance(key, str):
        raise TypeError(f"cache keys must be str, got {type(key).__name__}")
    if not key:
        raise ValueError("cache keys must not be empty")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"cache key {key!r} is not valid unicode (lone surrogate)") from None
    return key


def check_record(record: object) -> Record:
    if not isinstance(record, Record):
        raise TypeError(f"expected an mlxcache.Record, got {type(record).__name__}")
    return record


def check_budget(name: str, value: object) -> int | None:
    """``value`` if it is None or an int >= 0 (a byte or entry budget), else ValueError."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be an int >= 0 or None, got {value!r}")
    return value
