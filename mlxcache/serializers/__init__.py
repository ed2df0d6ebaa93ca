"""Serializers: MLX cache objects <-> Record, and Record <-> safetensors bytes or files."""

from __future__ import annotations

from typing import Any

_PROMPT_CACHE_API = (
    "cache_nbytes",
    "dump_prompt_cache",
    "is_trimmable_prefix",
    "load_prompt_cache",
    "truncate_prompt_cache",
)
__all__ = list(_PROMPT_CACHE_API)


def __getattr__(name: str) -> Any:
    # Imported lazily: mlxcache.record imports serializers.meta, and prompt_cache needs Record.
    if name in _PROMPT_CACHE_API:
        from mlxcache.serializers import prompt_cache

        return getattr(prompt_cache, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
