"""mlxcache: persistent, shareable prefix caches for MLX vision-language inference."""

from mlxcache.backends.base import CacheBackend
from mlxcache.errors import FormatError, UnsupportedVersionError, UntrustedRecordError
from mlxcache.prefix.cache import PrefixCache, PrefixHit
from mlxcache.prefix.model_id import model_identity
from mlxcache.records.record import Record
from mlxcache.serializers.prompt_cache import (
    cache_nbytes,
    dump_prompt_cache,
    is_trimmable_prefix,
    load_prompt_cache,
    truncate_prompt_cache,
)
from mlxcache.uri import DEFAULT_URL, open_backend, register_scheme

__all__ = [
    "DEFAULT_URL",
    "CacheBackend",
    "FormatError",
    "PrefixCache",
    "PrefixHit",
    "Record",
    "UnsupportedVersionError",
    "UntrustedRecordError",
    "model_identity",
    "cache_nbytes",
    "dump_prompt_cache",
    "is_trimmable_prefix",
    "load_prompt_cache",
    "open_backend",
    "register_scheme",
    "truncate_prompt_cache",
]
__version__ = "0.1.0"
