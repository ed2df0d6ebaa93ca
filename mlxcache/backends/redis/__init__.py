"""``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://`` and ``redis+sentinel://``.

``backend`` (RedisBackend: one record per value, a shared LRU index), ``reads`` and ``stream``
(the read path, large values streamed into their arrays), ``chunks`` (values over ``chunk_size``),
``keys`` (key layout and hash tags), ``scripts`` (Lua: the index, updated with each write),
``lookup`` (chain walks in one EVALSHA), ``routes`` (one server, Sentinel or Cluster) and
``cluster`` (the many-server URIs). It may import the backend base, records, options and errors.
"""

from mlxcache.backends.redis.backend import RedisBackend, from_uri
from mlxcache.backends.redis.routes import ClusterRouter, SentinelRouter, SingleRouter

__all__ = ["ClusterRouter", "RedisBackend", "SentinelRouter", "SingleRouter", "from_uri"]
