"""Chain walks of the Redis backend: a whole ``ChainWalk`` in one ``EVALSHA`` (the ``walk`` script).

One server (``redis://``, ``redis+sentinel://``) with one key group walks the chain, picks the
candidate from a sibling index (a hash ``{prefix}{tag}i:s:{name}``), refreshes the LRU of what
it reads and returns the first 1 MiB and the size of each value, all in one round trip (a
larger value then streams, :mod:`mlxcache.backends.redis.stream`). A Cluster, or more than
one group, spreads a chain's keys over slots: there ``walk_chain`` answers None and the caller uses
``contains_many``/``get_many``. See docs/backends.md ("Chain walks").
"""

from __future__ import annotations

from typing import Any

from mlxcache.backends.chains import ChainFound, ChainWalk

MAX_SIBLINGS = 1024  # entries of one sibling index before it is emptied and starts again


class WalkMixin:
    """``_walk_chain`` and ``_add_sibling`` of :class:`mlxcache.backends.redis.RedisBackend`."""

    def _can_walk(self) -> bool:
        """One key group on one server: every key of a chain is in one slot of one node."""
        return self.groups == 1 and self.client is not None

    def _walk_chain(self, walk: ChainWalk) -> ChainFound:
        n = len(walk.chain)
        if len(walk.marks) != n or len(walk.siblings) != n:
            raise ValueError("a chain walk needs one mark and one sibling index per chain key")
        if walk.unit <= 0 or walk.label_size % walk.unit or len(walk.labels) < n * walk.label_size:
            raise ValueError("a chain walk needs labels of n * label_size bytes in whole units")
        args: list[Any] = [n, walk.label_size, walk.unit, walk.labels, len(walk.ends)]
        args += [len(walk.extras), *walk.chain, *walk.marks, *walk.siblings]
        for keys in walk.ends:
            args += [len(keys), *keys]
        args += walk.extras
        k, rank, members, aligned, flags, values = self._script("walk", 0, args)
        members = [
            m.decode("utf-8", "replace") if isinstance(m, bytes) else str(m) for m in members
        ]
        k, rank, aligned = int(k), int(rank), int(aligned)
        extras = [bool(int(f)) for f in flags]
        read = list(walk.chain[:k])
        read += members if rank else [walk.marks[aligned - 1]] if aligned else []
        read += [x for x, f in zip(walk.extras, extras, strict=True) if f]
        if len(read) != len(values):
            raise ValueError(f"walk script read {len(values)} values for {len(read)} keys")
        # the script read each value's first bytes and size (see ReadMixin._settle): a small
        # value is whole, a chunked one costs one more round trip, a large one streams
        found = [isinstance(v, list) and len(v) == 2 for v in values]
        heads = [
            v[0] if f and isinstance(v[0], bytes) else b""
            for v, f in zip(values, found, strict=True)
        ]
        sizes = [int(v[1]) if f else 0 for v, f in zip(values, found, strict=True)]
        items = [(key, 0) for key in read]  # one key group: walks need it
        values = self._settle(self.client, items, heads, sizes, found)
        records = []
        for i, key in enumerate(read):
            value, values[i] = values[i], None
            records.append(self._decode(key, value))
        return ChainFound(k, rank, members, aligned, extras, records)

    def _add_sibling(self, index: str, label: bytes, members: list[str]) -> None:
        if not self._can_walk():
            return  # no walks here: an index would only take memory
        self._script("sibling", 0, [index, label, "\n".join(members), MAX_SIBLINGS])
