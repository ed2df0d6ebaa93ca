"""Adapters of the KV cache classes: plain, concatenating, quantized, static, rotating windows and
chunks (mlx-lm 0.32 and mlx-vlm 0.7 disagree on ``state``, so attributes are read and set here)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxcache.serializers.states import Adapter, check, int_field, kv_fields, seq, seq_len
from mlxcache.serializers.windows import CHUNKED_WINDOW, ROTATING_WINDOW


def _kv_state(c: Any, n: int) -> dict[str, Any]:
    """The first ``n`` positions of a cache's keys and values, and ``n`` as the offset."""
    return {"keys": seq(c.keys, n), "values": seq(c.values, n), "offset": n}


def _with_kv(cls: type, s: dict[str, Any]) -> Any:
    """A new ``cls`` holding the state's keys and values (its length set by the caller)."""
    c = cls()
    c.keys, c.values = kv_fields(s)
    return c


def _dump_kv(c: Any) -> dict[str, Any]:
    return _kv_state(c, int(c.offset))


def _load_kv(cls: type, s: dict[str, Any]) -> Any:
    c = _with_kv(cls, s)
    c.offset = int_field(s, "offset")
    check(c.keys is None or seq_len(c.keys) == c.offset, "offset does not match keys")
    return c


def _cut_kv(s: dict[str, Any], n: int) -> dict[str, Any]:
    return {**s, "keys": seq(s["keys"], n), "values": seq(s["values"], n), "offset": n}


KV = Adapter(_dump_kv, _load_kv, _cut_kv, per_block=True)


def _load_concat(cls: type, s: dict[str, Any]) -> Any:
    c = _with_kv(cls, s)
    c.offset = 0 if c.keys is None else seq_len(c.keys)
    check(c.offset == int_field(s, "offset"), "offset does not match keys")
    return c


CONCAT = Adapter(_dump_kv, _load_concat, _cut_kv, per_block=True)


def _dump_simple(c: Any) -> dict[str, Any]:
    return _kv_state(c, int(c.cache_length))


def _load_simple(cls: type, s: dict[str, Any]) -> Any:
    c = _with_kv(cls, s)
    c.cache_length = int_field(s, "offset")
    return c


SIMPLE = Adapter(_dump_simple, _load_simple, _cut_kv, per_block=True)


def _dump_quant(c: Any) -> dict[str, Any]:
    s = _dump_kv(c)
    s.update(group_size=int(c.group_size), bits=int(c.bits))
    return s


def _load_quant(cls: type, s: dict[str, Any]) -> Any:
    c = cls(group_size=int_field(s, "group_size"), bits=int_field(s, "bits"))
    c.keys, c.values = kv_fields(s, quantized=True)
    c.offset = int_field(s, "offset")
    check(c.keys is None or seq_len(c.keys) == c.offset, "offset does not match keys")
    return c


QUANT = Adapter(_dump_quant, _load_quant, _cut_kv, per_block=True)


def _dump_static(c: Any) -> dict[str, Any]:
    s = _dump_kv(c)
    s.update(max_size=int(c.max_size), step=int(c.step), read_only=bool(c.read_only))
    return s


def _load_static(cls: type, s: dict[str, Any]) -> Any:
    c = cls(int_field(s, "max_size"), step=int_field(s, "step"), read_only=bool(s["read_only"]))
    keys, values = kv_fields(s)
    c.offset = int_field(s, "offset")
    if keys is not None:
        # decoders attend over the fixed allocation: rebuild it, zero past the offset
        cap = max(c.max_size, c.offset)
        c.keys = mx.zeros((*keys.shape[:-2], cap, keys.shape[-1]), keys.dtype)
        c.values = mx.zeros((*values.shape[:-2], cap, values.shape[-1]), values.dtype)
        c.keys[..., : c.offset, :] = keys
        c.values[..., : c.offset, :] = values
    return c


STATIC = Adapter(_dump_static, _load_static, _cut_kv)


# ---------------------------------------------------------------- windows and chunks


def _rot_len(c: Any) -> int:
    # live tokens: everything up to offset; a rotated buffer is full and kept in its layout
    return min(int(c.offset), seq_len(c.keys)) if c.keys is not None else 0


def _dump_rotating(c: Any) -> dict[str, Any]:
    n = _rot_len(c)
    return {
        "keys": seq(c.keys, n),
        "values": seq(c.values, n),
        "offset": int(c.offset),
        "idx": int(c._idx),
        "keep": int(c.keep),
        "max_size": int(c.max_size),
    }


def _load_rotating(cls: type, s: dict[str, Any]) -> Any:
    c = cls(max_size=int_field(s, "max_size"), keep=int_field(s, "keep"))
    c.keys, c.values = kv_fields(s)
    c.offset, c._idx = int_field(s, "offset"), int_field(s, "idx")
    return c


def _cut_rotating(s: dict[str, Any], n: int) -> dict[str, Any]:
    # only while nothing was dropped and the buffer is in temporal order
    if s["keys"] is not None and not (s["offset"] <= s["max_size"] and s["idx"] == s["offset"]):
        raise ValueError("RotatingKVCache has dropped or rotated tokens (offset > max_size)")
    return {**_cut_kv(s, n), "idx": n}


ROTATING = Adapter(_dump_rotating, _load_rotating, _cut_rotating, window=ROTATING_WINDOW)


def _dump_buffered(c: Any) -> dict[str, Any]:
    s = _dump_rotating(c)
    if not c.keep and c.keys is not None:  # keep=0 uses a linear buffer of _idx tokens
        s["keys"], s["values"] = seq(c.keys, int(c._idx)), seq(c.values, int(c._idx))
    s.update(start_position=int(c.start_position), buffer_size=int(c.buffer_size))
    return s


def _load_buffered(cls: type, s: dict[str, Any]) -> Any:
    c = cls(
        int_field(s, "max_size"), keep=int_field(s, "keep"), buffer_size=int_field(s, "buffer_size")
    )
    c.keys, c.values = kv_fields(s)
    c.offset, c._idx = int_field(s, "offset"), int_field(s, "idx")
    c.start_position = int_field(s, "start_position")
    return c


def _cut_buffered(s: dict[str, Any], n: int) -> dict[str, Any]:
    if s["keys"] is not None and s["keep"] == 0:  # linear buffer: fine until a token drops
        if s["start_position"] != 0 or s["idx"] != s["offset"]:
            raise ValueError("BufferedRotatingKVCache has dropped its first tokens")
        return {**_cut_kv(s, n), "idx": n}
    return _cut_rotating(s, n)


BUFFERED = Adapter(_dump_buffered, _load_buffered, _cut_buffered)


def _dump_chunked(c: Any) -> dict[str, Any]:
    n = int(c.offset) - int(c.start_position)
    return {
        "keys": seq(c.keys, n),
        "values": seq(c.values, n),
        "offset": int(c.offset),
        "chunk_size": int(c.chunk_size),
        "start_position": int(c.start_position),
    }


def _load_chunked(cls: type, s: dict[str, Any]) -> Any:
    c = cls(int_field(s, "chunk_size"))
    c.keys, c.values = kv_fields(s)
    c.offset, c.start_position = int_field(s, "offset"), int_field(s, "start_position")
    return c


def _cut_chunked(s: dict[str, Any], n: int) -> dict[str, Any]:
    start = s["start_position"]
    if n < start:
        raise ValueError(f"ChunkedKVCache already dropped its first {start} tokens")
    k, v = seq(s["keys"], n - start), seq(s["values"], n - start)
    return {**s, "keys": k, "values": v, "offset": n}


CHUNKED = Adapter(_dump_chunked, _load_chunked, _cut_chunked, window=CHUNKED_WINDOW)


# ---------------------------------------------------------------- state caches
