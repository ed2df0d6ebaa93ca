"""The Redis key layout shared by ``redis://`` and ``redis+cluster://``: groups and hash tags.

Keys are split into ``groups`` by a stable hash of the user key. Every key of one group carries
the group's hash tag, so a record's value, its chunks and its group's LRU index live in one hash
slot: one Lua script or MULTI updates them atomically, also on a Redis Cluster. Each group has
its own index and a ``1/groups`` share of the byte budget; group tags are chosen so the groups
spread evenly over the slot space (and so over the primaries of a cluster)::

    {prefix}{{tag}}v:{key}          the record: a safetensors blob, or a chunk manifest
    {prefix}{{tag}}c:{gen}:{i}      chunk i of a large record; gen is random per write
    {prefix}{{tag}}i:lru            ZSET  key -> logical access clock (least recent first)
    {prefix}{{tag}}i:size           HASH  key -> stored bytes
    {prefix}{{tag}}i:exp            ZSET  key -> expiry time in server ms (only with ttl)
    {prefix}{{tag}}i:atime          ZSET  key -> last use in server ms (for idle_ttl)
    {prefix}{{tag}}i:pins           HASH  pinned key -> bytes (pinned keys leave lru/exp/atime)
    {prefix}{{tag}}i:chunks         HASH  key -> "gen:n" for chunked records
    {prefix}{{tag}}i:total          bytes of all indexed records of the group
    {prefix}{{tag}}i:clock          counter that orders accesses in the group
    {prefix}{{tag}}i:s:{name}       HASH  label -> member keys: a sibling index (walk_chain)
    {prefix}{{tag}}i:sibof          HASH  first member -> "name\nlabel" (a drop removes the entry)

``redis://`` uses one group (one exact LRU over everything); ``redis+cluster://`` 16 by default.
"""

from __future__ import annotations

import re

import xxhash
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

MAX_GROUPS = 256
INDEX_NAMES = ("lru", "size", "exp", "chunks", "total", "clock", "atime", "pins")


def glob_escape(text: str) -> str:
    """Escape Redis MATCH wildcards so ``text`` matches only itself."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


def _spread_tag(g: int, groups: int) -> str:
    """The first tag ``g``, ``g.1``, ``g.2``... whose slot falls in the g-th of ``groups``
    equal slot ranges (deterministic: every client computes the same tags)."""
    lo = g * REDIS_CLUSTER_HASH_SLOTS // groups
    hi = (g + 1) * REDIS_CLUSTER_HASH_SLOTS // groups
    tag, j = str(g), 0
    while not lo <= key_slot(tag.encode()) < hi:
        j += 1
        tag = f"{g}.{j}"
    return tag


class KeyLayout:
    """Names of every Redis key of one prefix, split into ``groups`` hash-tagged groups."""

    def __init__(self, prefix: str, groups: int = 1) -> None:
        if not isinstance(prefix, str) or not prefix:
            raise ValueError("prefix must be a non-empty str (clear() deletes what it covers)")
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"prefix must not contain '{{' or '}}' (hash tags): {prefix!r}")
        if isinstance(groups, bool) or not isinstance(groups, int):
            raise TypeError(f"groups must be an int, got {type(groups).__name__}")
        if not 1 <= groups <= MAX_GROUPS:
            raise ValueError(f"groups must be in 1..{MAX_GROUPS}, got {groups}")
        self.prefix = prefix
        self.groups = groups
        # the per-group key prefix ("P" in the Lua scripts), hash tag included
        self.heads = [f"{prefix}{{{_spread_tag(g, groups)}}}" for g in range(groups)]
        self.slots = [key_slot(h.encode()) for h in self.heads]
        self.index = [[h + "i:" + n for n in INDEX_NAMES] for h in self.heads]

    def group(self, key: str) -> int:
        """The group of a user key: a stable hash (the same in every process and version)."""
        if self.groups == 1:
            return 0
        return xxhash.xxh3_64_intdigest(key.encode()) % self.groups

    def vkey(self, key: str, g: int | None = None) -> str:
        return self.heads[self.group(key) if g is None else g] + "v:" + key

    def ckey(self, g: int, gen: str, i: int) -> str:
        return f"{self.heads[g]}c:{gen}:{i}"

    def value_pattern(self, user_prefix: str) -> str:
        """SCAN MATCH pattern of the value keys whose user key starts with ``user_prefix``."""
        return glob_escape(self.prefix) + "{*}v:" + glob_escape(user_prefix) + "*"

    def all_patterns(self) -> list[str]:
        """SCAN MATCH patterns of every key we own, including the pre-group layout's."""
        p = glob_escape(self.prefix)
        return [p + "{*}[vci]:*", p + "[vci]:*"]

    def user_key(self, raw: bytes) -> str | None:
        """The user key of a value key found by SCAN (None if it is not one of ours)."""
        text = raw.decode("utf-8", "replace")
        if not text.startswith(self.prefix + "{"):
            return None
        end = text.find("}v:", len(self.prefix))
        return None if end < 0 else text[end + 3 :]
