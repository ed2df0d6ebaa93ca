"""Per-class adapters between MLX cache objects and a plain ``state`` dict.

mlx-vlm 0.7 and mlx-lm 0.32 disagree on ``state``/``meta_state``/``from_state`` and both have
rebuild bugs (design.md), so we read and write the attributes ourselves. ``dump`` returns the
live state sliced to what the cache really holds (views, not copies: the caller copies);
``load`` builds a new object through the class constructor and sets the same attributes. A
state is a flat dict of ints, bools, ``mx.array``, ``None``, tuples of arrays (quantized) and,
for ``CacheList``, a list of child caches.

Classes are looked up by exact type in a fixed table keyed by ``(library, class name)``; a
record can never name a module or class outside it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

LIBRARIES = {"mlx_vlm": "mlx_vlm.models.cache", "mlx_lm": "mlx_lm.models.cache"}


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


# ---------------------------------------------------------------- helpers


def _seq(x: Any, n: int) -> Any:
    """First ``n`` entries along the sequence axis (-2) of an array or a quantized tuple."""
    if x is None:
        return None
    if isinstance(x, (tuple, list)):  # quantized: (packed, scales, biases), a list from mx.quantize
        return type(x)(_seq(p, n) for p in x)
    return x[..., :n, :]


def _seq_len(x: Any) -> int:
    return int((x[0] if isinstance(x, (tuple, list)) else x).shape[-2])


def _int(s: dict[str, Any], name: str) -> int:
    v = s[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise StateError(f"field {name!r} must be an int, got {type(v).__name__}")
    return v


def _arr(s: dict[str, Any], name: str, optional: bool = True) -> Any:
    v = s[name]
    if v is None and optional:
        return None
    if not isinstance(v, mx.array):
        raise StateError(f"field {name!r} must be an array, got {type(v).__name__}")
    return v


def _kv(s: dict[str, Any], quantized: bool = False) -> tuple[Any, Any]:
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


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise StateError(msg)


def _no_speculation(c: Any) -> None:
    if getattr(c, "_speculation", None) is not None:
        raise ValueError(f"{type(c).__name__} is inside a speculative block; commit or abort first")


# ---------------------------------------------------------------- KVCache & friends


def _dump_kv(c: Any) -> dict[str, Any]:
    n = int(c.offset)
    return {"keys": _seq(c.keys, n), "values": _seq(c.values, n), "offset": n}


def _load_kv(cls: type, s: dict[str, Any]) -> Any:
    c = cls()
    c.keys, c.values = _kv(s)
    c.offset = _int(s, "offset")
    _check(c.keys is None or _seq_len(c.keys) == c.offset, "offset does not match keys")
    return c


def _cut_kv(s: dict[str, Any], n: int) -> dict[str, Any]:
    return {**s, "keys": _seq(s["keys"], n), "values": _seq(s["values"], n), "offset": n}


_KV = Adapter(_dump_kv, _load_kv, _cut_kv, per_block=True)


def _load_concat(cls: type, s: dict[str, Any]) -> Any:
    c = cls()
    c.keys, c.values = _kv(s)
    c.offset = 0 if c.keys is None else _seq_len(c.keys)
    _check(c.offset == _int(s, "offset"), "offset does not match keys")
    return c


_CONCAT = Adapter(_dump_kv, _load_concat, _cut_kv, per_block=True)


def _dump_simple(c: Any) -> dict[str, Any]:
    n = int(c.cache_length)
    return {"keys": _seq(c.keys, n), "values": _seq(c.values, n), "offset": n}


def _load_simple(cls: type, s: dict[str, Any]) -> Any:
    c = cls()
    c.keys, c.values = _kv(s)
    c.cache_length = _int(s, "offset")
    return c


_SIMPLE = Adapter(_dump_simple, _load_simple, _cut_kv, per_block=True)


def _dump_quant(c: Any) -> dict[str, Any]:
    s = _dump_kv(c)
    s.update(group_size=int(c.group_size), bits=int(c.bits))
    return s


def _load_quant(cls: type, s: dict[str, Any]) -> Any:
    c = cls(group_size=_int(s, "group_size"), bits=_int(s, "bits"))
    c.keys, c.values = _kv(s, quantized=True)
    c.offset = _int(s, "offset")
    _check(c.keys is None or _seq_len(c.keys) == c.offset, "offset does not match keys")
    return c


_QUANT = Adapter(_dump_quant, _load_quant, _cut_kv, per_block=True)


def _dump_static(c: Any) -> dict[str, Any]:
    s = _dump_kv(c)
    s.update(max_size=int(c.max_size), step=int(c.step), read_only=bool(c.read_only))
    return s


def _load_static(cls: type, s: dict[str, Any]) -> Any:
    c = cls(_int(s, "max_size"), step=_int(s, "step"), read_only=bool(s["read_only"]))
    keys, values = _kv(s)
    c.offset = _int(s, "offset")
    if keys is not None:
        # decoders attend over the fixed allocation: rebuild it, zero past the offset
        cap = max(c.max_size, c.offset)
        c.keys = mx.zeros((*keys.shape[:-2], cap, keys.shape[-1]), keys.dtype)
        c.values = mx.zeros((*values.shape[:-2], cap, values.shape[-1]), values.dtype)
        c.keys[..., : c.offset, :] = keys
        c.values[..., : c.offset, :] = values
    return c


_STATIC = Adapter(_dump_static, _load_static, _cut_kv)


# ---------------------------------------------------------------- windows and chunks


def _rot_len(c: Any) -> int:
    # live tokens: everything up to offset; a rotated buffer is full and kept in its layout
    return min(int(c.offset), _seq_len(c.keys)) if c.keys is not None else 0


def _dump_rotating(c: Any) -> dict[str, Any]:
    n = _rot_len(c)
    return {
        "keys": _seq(c.keys, n),
        "values": _seq(c.values, n),
        "offset": int(c.offset),
        "idx": int(c._idx),
        "keep": int(c.keep),
        "max_size": int(c.max_size),
    }


def _load_rotating(cls: type, s: dict[str, Any]) -> Any:
    c = cls(max_size=_int(s, "max_size"), keep=_int(s, "keep"))
    c.keys, c.values = _kv(s)
    c.offset, c._idx = _int(s, "offset"), _int(s, "idx")
    return c


def _cut_rotating(s: dict[str, Any], n: int) -> dict[str, Any]:
    # only while nothing was dropped and the buffer is in temporal order
    if s["keys"] is not None and not (s["offset"] <= s["max_size"] and s["idx"] == s["offset"]):
        raise ValueError("RotatingKVCache has dropped or rotated tokens (offset > max_size)")
    return {**_cut_kv(s, n), "idx": n}


_ROTATING = Adapter(_dump_rotating, _load_rotating, _cut_rotating)


def _dump_buffered(c: Any) -> dict[str, Any]:
    s = _dump_rotating(c)
    if not c.keep and c.keys is not None:  # keep=0 uses a linear buffer of _idx tokens
        s["keys"], s["values"] = _seq(c.keys, int(c._idx)), _seq(c.values, int(c._idx))
    s.update(start_position=int(c.start_position), buffer_size=int(c.buffer_size))
    return s


def _load_buffered(cls: type, s: dict[str, Any]) -> Any:
    c = cls(_int(s, "max_size"), keep=_int(s, "keep"), buffer_size=_int(s, "buffer_size"))
    c.keys, c.values = _kv(s)
    c.offset, c._idx = _int(s, "offset"), _int(s, "idx")
    c.start_position = _int(s, "start_position")
    return c


def _cut_buffered(s: dict[str, Any], n: int) -> dict[str, Any]:
    if s["keys"] is not None and s["keep"] == 0:  # linear buffer: fine until a token drops
        if s["start_position"] != 0 or s["idx"] != s["offset"]:
            raise ValueError("BufferedRotatingKVCache has dropped its first tokens")
        return {**_cut_kv(s, n), "idx": n}
    return _cut_rotating(s, n)


_BUFFERED = Adapter(_dump_buffered, _load_buffered, _cut_buffered)


def _dump_chunked(c: Any) -> dict[str, Any]:
    n = int(c.offset) - int(c.start_position)
    return {
        "keys": _seq(c.keys, n),
        "values": _seq(c.values, n),
        "offset": int(c.offset),
        "chunk_size": int(c.chunk_size),
        "start_position": int(c.start_position),
    }


def _load_chunked(cls: type, s: dict[str, Any]) -> Any:
    c = cls(_int(s, "chunk_size"))
    c.keys, c.values = _kv(s)
    c.offset, c.start_position = _int(s, "offset"), _int(s, "start_position")
    return c


def _cut_chunked(s: dict[str, Any], n: int) -> dict[str, Any]:
    start = s["start_position"]
    if n < start:
        raise ValueError(f"ChunkedKVCache already dropped its first {start} tokens")
    k, v = _seq(s["keys"], n - start), _seq(s["values"], n - start)
    return {**s, "keys": k, "values": v, "offset": n}


_CHUNKED = Adapter(_dump_chunked, _load_chunked, _cut_chunked)


# ---------------------------------------------------------------- state caches


def _dump_arrays(c: Any) -> dict[str, Any]:
    _no_speculation(c)
    return {"cache": list(c.cache), "left_padding": c.left_padding, "lengths": c.lengths}


def _load_arrays(cls: type, s: dict[str, Any]) -> Any:
    cache = s["cache"]
    _check(isinstance(cache, list), "ArraysCache.cache must be a list")
    _check(all(x is None or isinstance(x, mx.array) for x in cache), "bad ArraysCache entry")
    c = cls(len(cache))
    c.cache = list(cache)
    c.left_padding = _arr(s, "left_padding")
    c.lengths = _arr(s, "lengths")
    return c


_ARRAYS = Adapter(_dump_arrays, _load_arrays)


def _dump_pooling(c: Any) -> dict[str, Any]:
    _no_speculation(c)
    r = int(c.remainder)
    buf_kv = None if c.buf_kv is None else c.buf_kv[:, :r]
    buf_gate = None if c.buf_gate is None else c.buf_gate[:, :r]
    return {
        "ratio": int(c.ratio),
        "remainder": r,
        "buf_kv": buf_kv,
        "buf_gate": buf_gate,
        "pooled": c.pooled,
    }


def _load_pooling(cls: type, s: dict[str, Any]) -> Any:
    c = cls(_int(s, "ratio"))
    c.remainder = r = _int(s, "remainder")
    for name in ("buf_kv", "buf_gate"):
        part = _arr(s, name)
        if part is not None:  # the window buffer is always `ratio` wide
            _check(part.ndim == 3 and part.shape[1] == r, f"{name} does not match remainder")
            buf = mx.zeros((part.shape[0], c.ratio, part.shape[2]), part.dtype)
            buf[:, :r] = part
            setattr(c, name, buf)
    c.pooled = _arr(s, "pooled")
    return c


_POOLING = Adapter(_dump_pooling, _load_pooling)


def _dump_cache_list(c: Any) -> dict[str, Any]:
    return {"caches": list(c.caches)}


def _load_cache_list(cls: type, s: dict[str, Any]) -> Any:
    _check(isinstance(s["caches"], list), "CacheList.caches must be a list")
    return cls(*s["caches"])


# a CacheList is cut child by child (prompt_cache.truncate_prompt_cache)
_CACHE_LIST = Adapter(_dump_cache_list, _load_cache_list)


# ---------------------------------------------------------------- batched caches


def _dump_batch_kv(c: Any) -> dict[str, Any]:
    n = int(c._idx)
    return {
        "keys": _seq(c.keys, n),
        "values": _seq(c.values, n),
        "idx": n,
        "offset": c.offset,
        "left_padding": c.left_padding,
        "right_padding": getattr(c, "_right_padding", None),
    }


def _set_batch(c: Any, s: dict[str, Any], quantized: bool = False) -> Any:
    c.keys, c.values = _kv(s, quantized)
    c._idx = _int(s, "idx")
    c.offset = _arr(s, "offset", optional=False)
    c.left_padding = _arr(s, "left_padding", optional=False)
    c._right_padding = _arr(s, "right_padding")
    return c


_BATCH_KV = Adapter(_dump_batch_kv, lambda cls, s: _set_batch(cls([]), s))


def _dump_batch_quant(c: Any) -> dict[str, Any]:
    s = _dump_batch_kv(c)
    s.update(group_size=int(c.group_size), bits=int(c.bits))
    return s


def _load_batch_quant(cls: type, s: dict[str, Any]) -> Any:
    c = cls([], group_size=_int(s, "group_size"), bits=_int(s, "bits"))
    return _set_batch(c, s, quantized=True)


_BATCH_QUANT = Adapter(_dump_batch_quant, _load_batch_quant)


def _dump_batch_rotating(c: Any) -> dict[str, Any]:
    n = min(int(c._offset), _seq_len(c.keys)) if c.keys is not None else 0
    return {
        "keys": _seq(c.keys, n),
        "values": _seq(c.values, n),
        "offset": c.offset,
        "left_padding": c.left_padding,
        "lengths": c._lengths,
        "max_size": int(c.max_size),
        "token_offset": int(c._offset),
        "idx": int(c._idx),
        "rotated": bool(c.rotated),
    }


def _load_batch_rotating(cls: type, s: dict[str, Any]) -> Any:
    c = cls(_int(s, "max_size"), [])
    c.keys, c.values = _kv(s)
    c.offset = _arr(s, "offset", optional=False)
    c.left_padding = _arr(s, "left_padding", optional=False)
    c._lengths = _arr(s, "lengths")
    c._offset, c._idx = _int(s, "token_offset"), _int(s, "idx")
    _check(isinstance(s["rotated"], bool), "rotated must be a bool")
    c.rotated = s["rotated"]
    return c


_BATCH_ROTATING = Adapter(_dump_batch_rotating, _load_batch_rotating)

_POOL_LISTS = ("left_padding", "remainder", "_pool_lengths", "_lengths", "_processed")


def _dump_batch_pooling(c: Any) -> dict[str, Any]:
    _no_speculation(c)
    s = {"ratio": int(c.ratio), "buf_kv": c.buf_kv, "buf_gate": c.buf_gate, "pooled": c.pooled}
    s.update({name.lstrip("_"): [int(x) for x in getattr(c, name)] for name in _POOL_LISTS})
    return s


def _load_batch_pooling(cls: type, s: dict[str, Any]) -> Any:
    c = cls(_int(s, "ratio"), [])
    for name in _POOL_LISTS:
        v = s[name.lstrip("_")]
        _check(isinstance(v, list) and all(isinstance(x, int) for x in v), f"bad {name}")
        setattr(c, name, list(v))
    c.buf_kv, c.buf_gate, c.pooled = (_arr(s, n) for n in ("buf_kv", "buf_gate", "pooled"))
    return c


_BATCH_POOLING = Adapter(_dump_batch_pooling, _load_batch_pooling)


# ---------------------------------------------------------------- the allowlist

_COMMON = {
    "KVCache": _KV,
    "ConcatenateKVCache": _CONCAT,
    "QuantizedKVCache": _QUANT,
    "RotatingKVCache": _ROTATING,
    "ChunkedKVCache": _CHUNKED,
    "ArraysCache": _ARRAYS,
    "CacheList": _CACHE_LIST,
    "BatchKVCache": _BATCH_KV,
    "BatchRotatingKVCache": _BATCH_ROTATING,
}
ADAPTERS: dict[tuple[str, str], Adapter] = {
    **{("mlx_lm", name): a for name, a in _COMMON.items()},
    **{("mlx_vlm", name): a for name, a in _COMMON.items()},
    ("mlx_vlm", "SimpleKVCache"): _SIMPLE,
    ("mlx_vlm", "StaticPrefixKVCache"): _STATIC,
    ("mlx_vlm", "BufferedRotatingKVCache"): _BUFFERED,
    ("mlx_vlm", "PoolingCache"): _POOLING,
    ("mlx_vlm", "BatchQuantizedKVCache"): _BATCH_QUANT,
    ("mlx_vlm", "BatchPoolingCache"): _BATCH_POOLING,
}


def supported_classes() -> list[str]:
    """``library.ClassName`` of every cache class we can store."""
    return sorted(f"{lib}.{name}" for lib, name in ADAPTERS)


def is_cache_object(obj: Any) -> bool:
    """True for an instance of a class in a known cache module (supported or not)."""
    return type(obj).__module__ in LIBRARIES.values()


def find(obj: Any) -> tuple[tuple[str, str], Adapter] | None:
    """The table key and adapter of a cache object by exact class, or None (not supported)."""
    cls = type(obj)
    for lib, module in LIBRARIES.items():
        if cls.__module__ == module and getattr(sys.modules[module], cls.__name__, None) is cls:
            key = (lib, cls.__name__)
            if key in ADAPTERS:
                return key, ADAPTERS[key]
    return None


def adapter_for(obj: Any) -> tuple[tuple[str, str], Adapter]:
    """The table key and adapter of a cache object, by exact class (subclasses are refused)."""
    found = find(obj)
    if found is not None:
        return found
    cls = type(obj)
    raise TypeError(
        f"cannot serialize a {cls.__module__}.{cls.__qualname__}: not a supported cache class "
        f"(supported: {', '.join(supported_classes())})"
    )


def class_for(lib: str, name: str) -> tuple[type, Adapter]:
    """The class and adapter a record names; only pairs in the fixed table resolve."""
    key = (lib, name)
    if key not in ADAPTERS:
        raise StateError(f"unknown cache class {lib}.{name}")
    try:
        module = importlib.import_module(LIBRARIES[lib])
    except ImportError as exc:
        raise StateError(f"record needs {lib}, which is not installed") from exc
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise StateError(f"{lib} {getattr(module, '__version__', '')} has no {name}")
    return cls, ADAPTERS[key]


# ---------------------------------------------------------------- per-block caches


def block_state(cache: Any) -> tuple[Any, Any, int, dict[str, Any]]:
    """Keys, values (arrays, or tuples of arrays when quantized), offset and the constant
    params of a per-block cache (``Adapter.per_block``), sliced to what it holds."""
    (lib, name), adapter = adapter_for(cache)
    if not adapter.per_block:
        raise TypeError(f"{lib}.{name} is not stored per block")
    state = adapter.dump(cache)
    params = {k: v for k, v in state.items() if k not in ("keys", "values", "offset")}
    return state["keys"], state["values"], state["offset"], params


def from_block_state(
    lib: str, name: str, keys: Any, values: Any, offset: int, params: dict[str, Any]
) -> Any:
    """Rebuild a per-block cache from joined blocks (the inverse of :func:`block_state`)."""
    cls, adapter = class_for(lib, name)
    if not adapter.per_block:
        raise StateError(f"{lib}.{name} is not stored per block")
    return adapter.load(cls, {**params, "keys": keys, "values": values, "offset": offset})
