"""Payloads of the vllm-mlx compatible managers as Records.

A payload (a KV cache, vision embeddings, a pixel tensor, a kwargs value) becomes either arrays
in the Record plus a small descriptor in its metadata, or, on the memory backend only, a live
Python object kept beside the store. Persistent backends refuse what cannot be serialized.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcache.records import meta as meta_codec
from mlxcache.records.record import Record
from mlxcache.serializers import cache_nbytes, dump_prompt_cache, load_prompt_cache
from mlxcache.serializers.adapters import is_cache_object


def is_mlx(obj: Any) -> bool:
    """MLX arrays, cache objects, and lists/tuples/str-keyed dicts made only of those."""
    if isinstance(obj, mx.array) or is_cache_object(obj):
        return True
    if isinstance(obj, list | tuple):
        return all(is_mlx(x) for x in obj)
    if isinstance(obj, dict):
        return all(isinstance(k, str) and is_mlx(v) for k, v in obj.items())
    return False


def true_nbytes(obj: Any) -> int:
    """Bytes really held: MLX caches through the serializers, arrays by ``nbytes``, else 0."""
    if obj is None:
        return 0
    if isinstance(obj, mx.array | np.ndarray):
        return int(obj.nbytes)
    if is_cache_object(obj):
        return int(cache_nbytes([obj]))
    if isinstance(obj, list | tuple):
        return sum(true_nbytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(true_nbytes(x) for x in obj.values())
    return 0


def _enc(v: Any) -> Any:
    """Plain data to msgpack-able form, keeping tuples apart from lists."""
    if isinstance(v, tuple):
        return {"__tuple__": [_enc(x) for x in v]}
    if isinstance(v, list):
        return [_enc(x) for x in v]
    if isinstance(v, dict):
        return {k: _enc(x) for k, x in v.items()}
    return v


def _dec(v: Any) -> Any:
    if isinstance(v, list):
        return [_dec(x) for x in v]
    if isinstance(v, dict):
        if set(v) == {"__tuple__"}:
            return tuple(_dec(x) for x in v["__tuple__"])
        return {k: _dec(x) for k, x in v.items()}
    return v


def _plain(v: Any) -> bool:
    try:
        meta_codec.pack(_enc(v))
    except (TypeError, ValueError):
        return False
    return True


def _copied(value: Any) -> Any:
    try:
        return copy.deepcopy(value)
    except Exception:  # an object that cannot be copied is kept as it is
        return value


class Packer:
    """Collects one Record's arrays and the live objects of the payloads packed into it."""

    def __init__(self, persistent: bool, where: str) -> None:
        self.persistent = persistent
        self.where = where
        self.arrays: dict[str, mx.array] = {}
        self.live: dict[str, Any] = {}

    def pack(self, name: str, value: Any, *, what: str, plain: bool = False) -> dict[str, Any]:
        """Store ``value`` under ``name``; return its descriptor for the record metadata.

        ``plain=True`` lets msgpack-able data (ints, strings, lists, ...) go into the metadata;
        otherwise only MLX arrays and caches are serialized.
        """
        if value is None:
            return {"k": "none"}
        if isinstance(value, mx.array):
            self.arrays[name] = value
            return {"k": "array"}
        if is_mlx(value):
            rec = dump_prompt_cache(value)
            for sub, arr in rec.arrays.items():
                self.arrays[f"{name}/{sub}"] = arr
            return {"k": "mlx", "m": dict(rec.meta)}
        if plain and _plain(value):
            return {"k": "plain", "v": _enc(value)}
        if self.persistent:
            raise TypeError(
                f"{what} of type {type(value).__name__} is not an MLX array or cache, so it "
                f"cannot be stored in {self.where}; only the memory:// backend keeps "
                "arbitrary Python objects"
            )
        self.live[name] = _copied(value) if plain else value
        return {"k": "live"}

    def record(self, meta: dict[str, Any]) -> Record:
        return Record(arrays=dict(self.arrays), meta=meta)

    def live_nbytes(self) -> int:
        return sum(true_nbytes(v) for v in self.live.values())


class Missing(LookupError):
    """A live object the record points to is gone (another manager's memory)."""


def unpack(
    name: str,
    desc: dict[str, Any],
    record: Record,
    live: dict[str, Any] | None,
    *,
    copy_live: bool = False,
) -> Any:
    """Rebuild a payload from its descriptor; fresh objects, live ones too with ``copy_live``."""
    kind = desc["k"]
    if kind == "none":
        return None
    if kind == "array":
        return record.arrays[name][...]  # a new array object over the same data
    if kind == "mlx":
        cut = len(name) + 1
        arrays = {k[cut:]: v for k, v in record.arrays.items() if k.startswith(name + "/")}
        return load_prompt_cache(Record(arrays=arrays, meta=desc["m"]))
    if kind == "plain":
        return _dec(desc["v"])
    if kind == "live":
        if live is None or name not in live:
            raise Missing(name)
        return _copied(live[name]) if copy_live else live[name]
    raise ValueError(f"unknown payload kind {kind!r}")
