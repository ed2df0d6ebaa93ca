"""MLX prompt caches <-> Record, byte-exact, with our own versioned encoding.

A prompt cache (a list of mlx-vlm / mlx-lm cache objects, or any nesting of lists, tuples,
str-keyed dicts, arrays, None and plain scalars) becomes a :class:`Record`: every array is a
tensor named by its path (``"3/keys"``) and ``meta["prompt_cache"]`` describes the tree. Caches
are sliced to what they really hold (no trimmed tokens, no buffer padding) and copied, so the
record never aliases the live cache. Classes come back only through a fixed allowlist
(:mod:`mlxcache.serializers.adapters`); nothing is pickled or imported by name from a record.
See ``docs/format.md``.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx

from mlxcache.errors import FormatError, UnsupportedVersionError
from mlxcache.records import meta as meta_codec
from mlxcache.records.record import Record
from mlxcache.serializers import adapters
from mlxcache.serializers.adapters import StateError

STRUCTURE_VERSION = 1
META_KEY = "prompt_cache"  # our tree description inside Record.meta
USER_KEY = "user"  # the caller's metadata inside Record.meta
MAX_DEPTH = 64

_SCALARS = (bool, int, float, str, bytes)


def dump_prompt_cache(prompt_cache: Any, meta: dict[str, Any] | None = None) -> Record:
    """Snapshot a prompt cache (or any supported structure) into a new Record.

    The record's arrays are new, evaluated array objects (slices of larger buffers compacted):
    trimming or updating the cache later does not change the record. ``meta`` (msgpack-able,
    str keys) is stored alongside and comes back from
    ``load_prompt_cache(record, return_metadata=True)``. Raises TypeError naming the first
    object it cannot store, before anything is copied.
    """
    if meta is not None and not isinstance(meta, dict):
        raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
    user = dict(meta or {})
    meta_codec.pack(user)  # TypeError naming what msgpack cannot encode
    views: dict[str, mx.array] = {}
    root = _encode(prompt_cache, [], views, 0)
    # New array objects: a slice of a larger buffer is compacted (copied), a whole buffer is
    # shared. Either way the cache's later in-place updates cannot reach the record.
    arrays = {name: mx.contiguous(a) for name, a in views.items()}
    mx.eval(list(arrays.values()))
    info = {"version": STRUCTURE_VERSION, "root": root}
    return Record(arrays=arrays, meta={META_KEY: info, USER_KEY: user})


def load_prompt_cache(record: Record, return_metadata: bool = False) -> list | Any:
    """Rebuild what :func:`dump_prompt_cache` stored; with ``return_metadata`` -> (cache, meta).

    Caches are new objects (restored through their constructors) whose arrays are new array
    objects, so using them never changes the record. A malformed description or an unknown
    class raises FormatError; a newer structure version raises UnsupportedVersionError (callers
    treat both as a cache miss).
    """
    if not isinstance(record, Record):
        raise TypeError(f"expected a Record, got {type(record).__name__}")
    info = record.meta.get(META_KEY)
    if not isinstance(info, dict) or "root" not in info:
        raise FormatError("record holds no prompt cache description")
    version = info.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise FormatError(f"bad prompt cache structure version {version!r}")
    if not 1 <= version <= STRUCTURE_VERSION:
        raise UnsupportedVersionError(
            f"prompt cache structure version {version}; this mlxcache reads up to "
            f"{STRUCTURE_VERSION}"
        )
    user = record.meta.get(USER_KEY, {})
    if not isinstance(user, dict):
        raise FormatError("record user metadata is not a map")
    try:
        cache = _decode(info["root"], record.arrays, 0)
    except FormatError:
        raise
    except (StateError, KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise FormatError(f"malformed prompt cache description: {exc}") from exc
    return (cache, user) if return_metadata else cache


def cache_nbytes(prompt_cache: Any) -> int:
    """True bytes of the live state: what :func:`dump_prompt_cache` would store.

    Sliced to each cache's offset (no trimmed tokens, no 256-token buffer padding, no
    quantized padding), not the allocation. Nothing is copied or evaluated.
    """
    views: dict[str, mx.array] = {}
    _encode(prompt_cache, [], views, 0)
    return sum(a.nbytes for a in views.values())


def is_trimmable_prefix(cache: Any) -> bool:
    """Whether a cache (or every cache in a list) can be cut back to any prefix of its tokens.

    True for KVCache, QuantizedKVCache, ConcatenateKVCache, SimpleKVCache, StaticPrefixKVCache,
    and for RotatingKVCache / BufferedRotatingKVCache / ChunkedKVCache only while they have not
    dropped a token (offset <= max_size, start_position == 0); a CacheList when all its children
    are. False for recurrent state (ArraysCache), PoolingCache and the batched caches.
    Raises TypeError for an unsupported object.
    """
    if type(cache) in (list, tuple):
        return all([is_trimmable_prefix(c) for c in cache])  # list: check every one
    key, adapter = adapters.adapter_for(cache)
    if key[1] == "CacheList":
        return all(is_trimmable_prefix(c) for c in cache.caches)
    if adapter.cut is None:
        return False
    try:
        adapter.cut(adapter.dump(cache), 0)
    except ValueError:
        return False
    return True


def truncate_prompt_cache(prompt_cache: Any, num_tokens: int) -> list:
    """New cache objects holding exactly the first ``num_tokens`` tokens of each cache.

    The input is not changed and nothing aliases it (arrays are new objects, slices compacted).
    Accepts a list of caches or a single cache (returned as a one-element list). Raises
    ValueError when a cache holds fewer tokens or cannot be cut there (see
    :func:`is_trimmable_prefix`), TypeError for an unsupported object.
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
    caches = list(prompt_cache) if type(prompt_cache) in (list, tuple) else [prompt_cache]
    out = [_truncate(c, num_tokens) for c in caches]
    mx.eval([a for c in out for a in _arrays_of(c)])
    return out


# ---------------------------------------------------------------- encoding


def _encode(obj: Any, path: list[str], views: dict[str, mx.array], depth: int) -> dict:
    if depth > MAX_DEPTH:
        raise ValueError(f"prompt cache nested deeper than {MAX_DEPTH} levels (a cycle?)")
    if obj is None:
        return {"kind": "none"}
    if isinstance(obj, mx.array):
        name = "/".join(path) or "root"
        views[name] = obj
        return {"kind": "array", "name": name}
    if type(obj) in _SCALARS:
        return {"kind": "value", "value": obj}
    if type(obj) in (list, tuple):
        items = [_encode(x, [*path, str(i)], views, depth + 1) for i, x in enumerate(obj)]
        return {"kind": type(obj).__name__, "items": items}
    if type(obj) is dict:
        for k in obj:
            if not isinstance(k, str):
                raise TypeError(f"dict keys in a prompt cache must be str, got {k!r}")
        items = [_encode(v, [*path, str(i)], views, depth + 1) for i, v in enumerate(obj.values())]
        return {"kind": "dict", "keys": list(obj), "items": items}
    if adapters.is_cache_object(obj):
        (lib, name), adapter = adapters.adapter_for(obj)
        state = {k: _encode(v, [*path, k], views, depth + 1) for k, v in adapter.dump(obj).items()}
        return {"kind": "cache", "library": lib, "class": name, "state": state}
    cls = type(obj)
    raise TypeError(f"cannot serialize object of type {cls.__module__}.{cls.__qualname__}")


def _decode(node: Any, arrays: Any, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise FormatError(f"prompt cache description nested deeper than {MAX_DEPTH} levels")
    if not isinstance(node, dict):
        raise FormatError(f"description node is not a map: {node!r:.80}")
    kind = node.get("kind")
    if kind == "none":
        return None
    if kind == "value":
        value = node["value"]
        if type(value) not in _SCALARS:
            raise FormatError(f"bad scalar {value!r:.80}")
        return value
    if kind == "array":
        name = node["name"]
        if not isinstance(name, str) or name not in arrays:
            raise FormatError(f"record has no tensor {name!r:.80}")
        return copy.copy(arrays[name])  # a new array object over the same buffer
    if kind in ("list", "tuple"):
        items = _list(node, "items")
        out = [_decode(x, arrays, depth + 1) for x in items]
        return out if kind == "list" else tuple(out)
    if kind == "dict":
        keys, items = _list(node, "keys"), _list(node, "items")
        if len(keys) != len(items) or not all(isinstance(k, str) for k in keys):
            raise FormatError("bad dict node")
        return {k: _decode(v, arrays, depth + 1) for k, v in zip(keys, items, strict=True)}
    if kind == "cache":
        lib, name, state = node["library"], node["class"], node["state"]
        if not isinstance(lib, str) or not isinstance(name, str) or not isinstance(state, dict):
            raise FormatError("bad cache node")
        cls, adapter = adapters.class_for(lib, name)
        return adapter.load(cls, {k: _decode(v, arrays, depth + 1) for k, v in state.items()})
    raise FormatError(f"unknown description node kind {kind!r:.80}")


def _list(node: dict, key: str) -> list:
    value = node[key]
    if not isinstance(value, list):
        raise FormatError(f"{key!r} is not a list")
    return value


# ---------------------------------------------------------------- cutting


def _truncate(cache: Any, n: int) -> Any:
    (lib, name), adapter = adapters.adapter_for(cache)
    if name == "CacheList":
        return type(cache)(*(_truncate(c, n) for c in cache.caches))
    if adapter.cut is None:
        raise ValueError(f"{lib}.{name} cannot be cut at a token boundary")
    state = adapter.dump(cache)
    if n > state["offset"]:
        raise ValueError(f"{lib}.{name} holds {state['offset']} tokens, cannot keep {n}")
    state = {k: _copy(v) for k, v in adapter.cut(state, n).items()}
    cls, _ = adapters.class_for(lib, name)
    return adapter.load(cls, state)


def _copy(value: Any) -> Any:
    if isinstance(value, mx.array):
        return mx.contiguous(value)  # a new object; slices compacted
    if isinstance(value, (tuple, list)):
        return type(value)(_copy(v) for v in value)
    return value


def _arrays_of(cache: Any) -> list[mx.array]:
    views: dict[str, mx.array] = {}
    _encode(cache, [], views, 0)
    return list(views.values())


__all__ = [
    "STRUCTURE_VERSION",
    "cache_nbytes",
    "dump_prompt_cache",
    "is_trimmable_prefix",
    "load_prompt_cache",
    "truncate_prompt_cache",
]
