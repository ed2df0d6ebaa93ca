"""Window layers (RotatingKVCache, ChunkedKVCache): the positions a state still holds, the
positions a rebuild at a token boundary needs, and the layer rebuilt from them.

A window layer's key/value at position t depends only on tokens up to t (as a plain KV
layer's), but the layer drops old positions. So a PrefixCache stores it per block, like a
plain layer, slicing each block from what the state still holds, and rebuilds it at any
boundary n from the blocks holding the positions ``need(params, n)``: what the engine's layer
would keep of a prefix of n tokens prefilled in one chunk, as far as any later update reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxcache.serializers.states import StateError, check, int_field

Span = tuple[int, int, int]  # (first position, end position, its index along axis -2)


@dataclass(frozen=True)
class Held:
    """A window layer's keys/values in temporal order, the positions they hold, its params."""

    keys: mx.array | None
    values: mx.array | None
    spans: tuple[Span, ...]
    params: dict[str, int]

    def take(self, start: int, end: int) -> tuple[mx.array, mx.array] | None:
        """Keys and values of positions ``[start, end)``, or None where the state lost some."""
        for first, stop, at in self.spans:
            if first <= start and end <= stop and self.keys is not None:
                assert self.values is not None
                a = at + start - first
                return self.keys[..., a : a + end - start, :], self.values[
                    ..., a : a + end - start, :
                ]
        return None

    def zeros(self, n: int) -> tuple[mx.array, mx.array]:
        """Zero keys and values of ``n`` positions, shaped as this layer's (a stand-in)."""
        if self.keys is None or self.values is None:
            raise ValueError("an empty window layer holds no tokens to store")
        k, v = self.keys, self.values
        return (
            mx.zeros((*k.shape[:-2], n, k.shape[-1]), k.dtype),
            mx.zeros((*v.shape[:-2], n, v.shape[-1]), v.dtype),
        )


@dataclass(frozen=True)
class Window:
    """How one window class is read, what a rebuild needs and how it is rebuilt."""

    held: Callable[[Any], Held]
    # position ranges a layer of n tokens must hold (params are the stored ones: check them)
    need: Callable[[dict[str, Any], int], list[tuple[int, int]]]
    # a new layer of n tokens holding the ``need`` positions, concatenated in order
    build: Callable[[type, dict[str, Any], mx.array, mx.array, int], Any]


# ---------------------------------------------------------------- RotatingKVCache


def _rotating_held(c: Any) -> Held:
    params = {"max_size": int(c.max_size), "keep": int(c.keep)}
    if c.keys is None:
        return Held(None, None, (), params)
    # the class's own temporal order: [first keep] + the rest oldest first (a view if unrotated)
    keys, values = c._temporal_order(c.keys), c._temporal_order(c.values)
    held, n = int(keys.shape[-2]), int(c.offset)
    if held >= n:  # nothing dropped (a growing buffer is cut to its offset)
        return Held(keys[..., :n, :], values[..., :n, :], ((0, n, 0),), params)
    keep = min(params["keep"], held)
    return Held(keys, values, ((0, keep, 0), (n - (held - keep), n, keep)), params)


def _rotating_params(p: dict[str, Any]) -> tuple[int, int]:
    size, keep = int_field(p, "max_size"), int_field(p, "keep")
    check(0 <= keep < size, "RotatingKVCache params out of range")
    return size, keep


def _rotating_need(p: dict[str, Any], n: int) -> list[tuple[int, int]]:
    """All n positions while they fit; else the first ``keep`` and the last ``max_size - keep``:
    the next multi-token update keeps ``keep`` + the last ``max_size - 1 - keep``, a single
    token trims to ``max_size`` and rotates, as from the engine's layer holding all n."""
    size, keep = _rotating_params(p)
    if n <= size:
        return [(0, n)]
    return [r for r in ((0, keep), (n - (size - keep), n)) if r[1] > r[0]]


def _rotating_build(cls: type, p: dict[str, Any], keys: mx.array, values: mx.array, n: int) -> Any:
    size, keep = _rotating_params(p)
    c = cls(max_size=size, keep=keep)
    c.keys, c.values = keys, values
    c.offset, c._idx = n, int(keys.shape[-2])
    return c


ROTATING_WINDOW = Window(_rotating_held, _rotating_need, _rotating_build)


# ---------------------------------------------------------------- ChunkedKVCache


def _chunked_held(c: Any) -> Held:
    params = {"chunk_size": int(c.chunk_size)}
    if c.keys is None:
        return Held(None, None, (), params)
    start, n = int(c.start_position), int(c.offset)
    keys, values = c.keys[..., : n - start, :], c.values[..., : n - start, :]
    return Held(keys, values, ((start, n, 0),), params)


def _chunk_size(p: dict[str, Any]) -> int:
    size = int_field(p, "chunk_size")
    check(size > 0, "ChunkedKVCache chunk_size must be positive")
    return size


def _chunked_need(p: dict[str, Any], n: int) -> list[tuple[int, int]]:
    """The last ``chunk_size`` positions: what ``maybe_trim_front`` keeps before the next call."""
    return [(max(0, n - _chunk_size(p)), n)]


def _chunked_build(cls: type, p: dict[str, Any], keys: mx.array, values: mx.array, n: int) -> Any:
    c = cls(_chunk_size(p))
    c.keys, c.values = keys, values
    c.offset = n
    c.start_position = n - int(keys.shape[-2])
    if c.start_position < 0:
        raise StateError("ChunkedKVCache holds more tokens than its offset")
    return c


CHUNKED_WINDOW = Window(_chunked_held, _chunked_need, _chunked_build)
