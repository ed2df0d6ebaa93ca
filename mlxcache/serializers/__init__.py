"""Serializers: MLX cache objects <-> Record (Record <-> bytes is ``mlxcache.format``)."""

from mlxcache.serializers.prompt_cache import (
    STRUCTURE_VERSION,
    cache_nbytes,
    dump_prompt_cache,
    is_trimmable_prefix,
    load_prompt_cache,
    truncate_prompt_cache,
)

__all__ = [
    "STRUCTURE_VERSION",
    "cache_nbytes",
    "dump_prompt_cache",
    "is_trimmable_prefix",
    "load_prompt_cache",
    "truncate_prompt_cache",
]
