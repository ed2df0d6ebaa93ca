"""Storage backends: memory, disk (safetensors files + SQLite index), Redis (one server,
Sentinel, Cluster) and tiers of them."""

from mlxcache.backends.base import CacheBackend

__all__ = ["CacheBackend"]
