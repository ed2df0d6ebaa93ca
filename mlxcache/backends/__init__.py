"""Storage backends: memory, disk (safetensors files + SQLite index) and Redis."""

from mlxcache.backends.base import CacheBackend

__all__ = ["CacheBackend"]
