"""Per-class adapters between MLX cache objects and a plain ``state`` dict.

mlx-vlm 0.7 and mlx-lm 0.32 disagree on ``state``/``meta_state``/``from_state`` and both have
rebuild bugs (design.md), so we read and write the attributes ourselves. ``dump`` returns the
live state sliced to what the cache really holds (views, not copies: the caller copies);
``load`` builds a new object through the class constructor and sets the same attributes. A
state is a flat dict of ints, bools, ``mx.array``, ``None``, tuples of arrays (quantized) and,
for ``CacheList``, a list of child caches.

The families live in ``kv_caches``, ``state_caches`` and ``batch_caches`` (their shared field
checks in ``states``); this module is the table and the lookup. Classes are looked up by exact
type in a fixed table keyed by ``(library, class name)``; a record can never name a module or
class outside it.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from mlxcache.serializers.batch_caches import (
    BATCH_KV,
    BATCH_POOLING,
    BATCH_QUANT,
    BATCH_ROTATING,
)
from mlxcache.serializers.kv_caches import (
    BUFFERED,
    CHUNKED,
    CONCAT,
    KV,
    QUANT,
    ROTATING,
    SIMPLE,
    STATIC,
)
from mlxcache.serializers.state_caches import ARRAYS, CACHE_LIST, POOLING
from mlxcache.serializers.states import Adapter, StateError
from mlxcache.serializers.windows import Held

__all__ = [
    "ADAPTERS",
    "LIBRARIES",
    "Adapter",
    "StateError",
    "adapter_for",
    "block_state",
    "class_for",
    "find",
    "from_block_state",
    "from_window",
    "is_cache_object",
    "supported_classes",
    "unsafe",
    "window_held",
    "window_need",
]

LIBRARIES = {"mlx_vlm": "mlx_vlm.models.cache", "mlx_lm": "mlx_lm.models.cache"}


_COMMON = {
    "KVCache": KV,
    "ConcatenateKVCache": CONCAT,
    "QuantizedKVCache": QUANT,
    "RotatingKVCache": ROTATING,
    "ChunkedKVCache": CHUNKED,
    "ArraysCache": ARRAYS,
    "CacheList": CACHE_LIST,
    "BatchKVCache": BATCH_KV,
    "BatchRotatingKVCache": BATCH_ROTATING,
}
ADAPTERS: dict[tuple[str, str], Adapter] = {
    **{("mlx_lm", name): a for name, a in _COMMON.items()},
    **{("mlx_vlm", name): a for name, a in _COMMON.items()},
    ("mlx_vlm", "SimpleKVCache"): SIMPLE,
    ("mlx_vlm", "StaticPrefixKVCache"): STATIC,
    ("mlx_vlm", "BufferedRotatingKVCache"): BUFFERED,
    ("mlx_vlm", "PoolingCache"): POOLING,
    ("mlx_vlm", "BatchQuantizedKVCache"): BATCH_QUANT,
    ("mlx_vlm", "BatchPoolingCache"): BATCH_POOLING,
}


def supported_classes() -> list[str]:
    """``library.ClassName`` of every cache class we can store."""
    return sorted(f"{lib}.{name}" for lib, name in ADAPTERS)


def is_cache_object(obj: Any) -> bool:
    """True for an instance of a class in a known cache module (supported or not)."""
    return type(obj).__module__ in LIBRARIES.values()


def find(obj: Any) -> tuple[tuple[str, str], Adapter] | None:
    """The table key and adapter of a cache object by exact class, or None (not supported, or
    a class of this library version that a restored object would not behave like: ``unsafe``)."""
    cls = type(obj)
    for lib, module in LIBRARIES.items():
        if cls.__module__ == module and getattr(sys.modules[module], cls.__name__, None) is cls:
            key = (lib, cls.__name__)
            if key in ADAPTERS and unsafe(cls) is None:
                return key, ADAPTERS[key]
    return None


_UNSAFE: dict[type, str | None] = {}


def unsafe(cls: type) -> str | None:
    """Why objects of a tabled class cannot be restored faithfully in this library version, or
    None. mlx-lm before 0.32 trims a ``ChunkedKVCache`` on its buffer's padded width, so the
    engine's own cache keeps other tokens than a restored one of the same length would."""
    if cls.__name__ != "ChunkedKVCache":
        return None
    if cls not in _UNSAFE:
        import mlx.core as mx

        probe = cls(4)
        x = mx.zeros((1, 1, 3, 2))
        probe.update_and_fetch(x, x)  # 3 tokens, a buffer padded to the class's step
        probe.maybe_trim_front()
        _UNSAFE[cls] = (
            None
            if probe.start_position == 0
            else f"{cls.__module__}.ChunkedKVCache trims on its buffer's padded width "
            "(mlx-lm before 0.32): a restored cache would keep other tokens than the engine's"
        )
    return _UNSAFE[cls]


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


# ---------------------------------------------------------------- window caches


def window_held(cache: Any) -> Held:
    """The positions a window cache (``Adapter.window``) still holds, in temporal order."""
    (lib, name), adapter = adapter_for(cache)
    if adapter.window is None:
        raise TypeError(f"{lib}.{name} is not a window cache")
    held: Held = adapter.window.held(cache)
    return held


def _window_of(lib: str, name: str) -> tuple[type, Any]:
    cls, adapter = class_for(lib, name)
    if adapter.window is None:
        raise StateError(f"{lib}.{name} is not a window cache")
    return cls, adapter.window


def window_need(lib: str, name: str, params: dict[str, Any], n: int) -> list[tuple[int, int]]:
    """The position ranges a window cache of ``n`` tokens is rebuilt from."""
    need: list[tuple[int, int]] = _window_of(lib, name)[1].need(params, n)
    return need


def from_window(lib: str, name: str, params: dict[str, Any], keys: Any, values: Any, n: int) -> Any:
    """A window cache of ``n`` tokens from the keys/values of its ``window_need`` positions."""
    cls, window = _window_of(lib, name)
    return window.build(cls, params, keys, values, n)
