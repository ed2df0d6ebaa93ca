"""What every cache adapter shares: the ``Adapter`` record, ``StateError`` and checked field reads.

A state is a flat dict of ints, bools, ``mx.array``, ``None``, tuples of arrays (quantized) and,
for ``CacheList``, a list of child caches. Reads check each field's type, so a hostile record is
a ``StateError`` (a miss), never a half-built cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx


class StateError(ValueError):
    """A stored state does not fit its class (turned into FormatError by the caller)."""


@dataclass(frozen=True)
class Adapter:
    """How one cache family is dumped, rebuilt and cut at a token boundary."""

    dump: Callable[[Any], dict[str, Any]]
    load: Callable[[type, dict[str, Any]], Any]
    # state of the first n tokens (n <= state["offset"]); raises ValueError where it can't cut
    cut: Callable[[dict[str, Any], int], dict[str, Any]] | None = None
    # state is keys/values along axis -2, an offset and constant params, nothing else: a
    # PrefixCache stores such a cache per block; any other cache as a whole-prefix checkpoint
    per_block: bool = False
    # a window layer (serializers.windows.Window): stored per block too, rebuilt at any
    # boundary from the positions it needs there
    window: Any = None


def seq(x: Any, n: int) -> Any:
    """First ``n`` entries along the sequence axis (-2) of an array or a quantized tuple."""
    if x is None:
        return None
    if isinstance(x, (tuple, list)):  # quantized: (packed, scales, biases), a list from mx.quantize
        return type(x)(seq(p, n) for p in x)
    return x[..., :n, :]


def seq_len(x: Any) -> int:
    return int((x[0] if isinstance(x, (tuple, list)) else x).shape[-2])


def int_field(s: dict[str, Any], name: str) -> int:
    v = s[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise StateError(f"field {name!r} must be an int, got {type(v).__name__}")
    return v


def array_field(s: dict[str, Any], name: str, optional: bool = True) -> Any:
    v = s[name]
    if v is None and optional:
        return None
    if not isinstance(v, mx.array):
        raise StateError(f"field {name!r} must be an array, got {type(v).__name__}")
    return v


def kv_fields(s: dict[str, Any], quantized: bool = False) -> tuple[Any, Any]:
    """Keys and values: both None, or both arrays (tuples of arrays when quantized)."""
    k, v = s["keys"], s["values"]
    if (k is None) != (v is None):
        raise StateError("keys and values must both be present or both be None")
    if k is None:
        return None, None
    for x in (k, v):
        parts = x if quantized else (x,)
        if quantized and not isinstance(x, (tuple, list)):
            raise StateError("quantized keys/values must be sequences of arrays")
        if not parts or not all(isinstance(p, mx.array) and p.ndim >= 2 for p in parts):
            raise StateError("keys/values must be arrays with a sequence axis")
    return k, v


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise StateError(msg)


def no_speculation(c: Any) -> None:
    if getattr(c, "_speculation", None) is not None:
        raise ValueError(f"{type(c).__name__} is inside a speculative block; commit or abort first")
