"""mlxcache: persistent, shareable prefix caches for MLX vision-language inference."""

from mlxcache.backends.base import CacheBackend
from mlxcache.errors import FormatError, UnsupportedVersionError
from mlxcache.record import Record
from mlxcache.uri import DEFAULT_URL, open_backend, register_scheme

__all__ = [
    "DEFAULT_URL",
    "CacheBackend",
    "FormatError",
    "Record",
    "UnsupportedVersionError",
    "open_backend",
    "register_scheme",
]
__version__ = "0.1.0"
