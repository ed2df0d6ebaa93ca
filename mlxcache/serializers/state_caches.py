"""Adapters of the caches that hold state rather than keys and values: ``ArraysCache`` (SSM
layers), ``PoolingCache`` and ``CacheList``."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxcache.serializers.states import Adapter, array_field, check, int_field, no_speculation


def _dump_arrays(c: Any) -> dict[str, Any]:
    no_speculation(c)
    return {"cache": list(c.cache), "left_padding": c.left_padding, "lengths": c.lengths}


def _load_arrays(cls: type, s: dict[str, Any]) -> Any:
    cache = s["cache"]
    check(isinstance(cache, list), "ArraysCache.cache must be a list")
    check(all(x is None or isinstance(x, mx.array) for x in cache), "bad ArraysCache entry")
    c = cls(len(cache))
    c.cache = list(cache)
    c.left_padding = array_field(s, "left_padding")
    c.lengths = array_field(s, "lengths")
    return c


ARRAYS = Adapter(_dump_arrays, _load_arrays)


def _dump_pooling(c: Any) -> dict[str, Any]:
    no_speculation(c)
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
    c = cls(int_field(s, "ratio"))
    c.remainder = r = int_field(s, "remainder")
    for name in ("buf_kv", "buf_gate"):
        part = array_field(s, name)
        if part is not None:  # the window buffer is always `ratio` wide
            check(part.ndim == 3 and part.shape[1] == r, f"{name} does not match remainder")
            buf = mx.zeros((part.shape[0], c.ratio, part.shape[2]), part.dtype)
            buf[:, :r] = part
            setattr(c, name, buf)
    c.pooled = array_field(s, "pooled")
    return c


POOLING = Adapter(_dump_pooling, _load_pooling)


def _dump_cache_list(c: Any) -> dict[str, Any]:
    return {"caches": list(c.caches)}


def _load_cache_list(cls: type, s: dict[str, Any]) -> Any:
    check(isinstance(s["caches"], list), "CacheList.caches must be a list")
    return cls(*s["caches"])


# a CacheList is cut child by child (prompt_cache.truncate_prompt_cache)
CACHE_LIST = Adapter(_dump_cache_list, _load_cache_list)
