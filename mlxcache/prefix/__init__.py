"""PrefixCache: block-hashed reuse of prompt caches on any backend, across processes.

The parts: ``plan`` (a request's chained block hashes), ``probe`` and ``walk`` (the two lookup
paths), ``records`` (per-block KV records), ``restore`` (verify and rebuild a hit), ``hot`` (the
in-process hot tier), ``heal`` (writing back what the backend lost), ``counts`` (counters and
call durations) and ``cache`` (``PrefixCache``, which orchestrates them). It may import
serializers, records and backends, never an engine integration or the CLI.
"""

from mlxcache.prefix.cache import PrefixCache, PrefixHit

__all__ = ["PrefixCache", "PrefixHit"]
