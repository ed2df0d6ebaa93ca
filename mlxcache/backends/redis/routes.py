"""Where a Redis command goes: one server, the primary Sentinel names, or a Cluster's slot owner.

The Redis backend talks to plain ``redis.Redis`` clients only; a router hands it the client for
a hash slot. ``ClusterRouter`` keeps its own map of slot ranges to primaries (``CLUSTER SLOTS``)
and one connection pool per primary, so a batch is one pipeline per node (with ``EVALSHA`` and
``MULTI``, which redis-py's cluster pipeline refuses), and refreshes the map after any failure
(a dead node, ``MOVED``, ``CLUSTERDOWN``): after a failover the promoted replica is found.
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import Any

import redis
from redis.sentinel import Sentinel

from mlxcache.backends.redis.deadline import arm


class SingleRouter:
    """Every slot is on one server (``redis://``, ``rediss://``, ``unix://``)."""

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self.pool = pool
        self.one = redis.Redis(connection_pool=pool)

    def client(self, slot: int) -> redis.Redis:
        return self.one

    def clients(self) -> list[redis.Redis]:
        return [self.one]

    def node_name(self, slot: int) -> str | None:
        """``host:port`` of the node serving ``slot`` when there are several (else None)."""
        return None

    def invalidate(self) -> None:
        pass

    def close(self) -> None:
        self.pool.disconnect()


class SentinelRouter(SingleRouter):
    """The primary of ``service`` as the sentinels name it; a failover is followed by itself
    (redis-py asks the sentinels again for every new connection, and drops connections to a
    primary that became a replica)."""

    def __init__(
        self,
        sentinels: list[tuple[str, int]],
        service: str,
        *,
        sentinel_kwargs: dict[str, Any],
        **kwargs: Any,
    ) -> None:
        self.sentinel = Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs, **kwargs)
        self.service = service
        client = self.sentinel.master_for(service, **kwargs)
        arm(client.connection_pool)
        super().__init__(client.connection_pool)
        self.one = client

    def invalidate(self) -> None:
        # connections to a dead or demoted primary are useless: the next ones ask the sentinels
        self.pool.disconnect()

    def close(self) -> None:
        self.pool.disconnect()
        for s in self.sentinel.sentinels:
            s.connection_pool.disconnect()


class ClusterRouter:
    """Slot -> primary of a Redis Cluster, from ``CLUSTER SLOTS`` of any reachable node."""

    def __init__(self, seeds: list[tuple[str, int]], **kwargs: Any) -> None:
        if not seeds:
            raise ValueError("a cluster needs at least one seed node")
        self.seeds = list(seeds)
        self.kwargs = kwargs
        self._lock = threading.Lock()
        self._pools: dict[tuple[str, int], redis.Redis] = {}
        self._starts: list[int] = []  # sorted first slots of the ranges
        self._owners: list[tuple[str, int]] = []  # owner of each range
        self._ends: list[int] = []
        self._stale = True
        self._failed_at: dict[tuple[str, int], float] = {}  # nodes that did not answer

    def _client_at(self, addr: tuple[str, int]) -> redis.Redis:
        with self._lock:
            c = self._pools.get(addr)
            if c is None:
                pool = arm(redis.ConnectionPool(host=addr[0], port=addr[1], **self.kwargs))
                c = self._pools[addr] = redis.Redis(connection_pool=pool)
            return c

    def refresh(self) -> None:
        """Read the slot map from the first node that answers (known primaries, then seeds)."""
        tried: list[str] = []
        candidates = list(dict.fromkeys([*self._owners, *self.seeds]))
        # nodes that failed lately go last: a dead host costs a connect timeout each time
        candidates.sort(key=lambda a: self._failed_at.get(a, 0.0))
        for addr in candidates:
            try:
                reply = self._client_at(addr).execute_command("CLUSTER SLOTS")
            except (redis.RedisError, OSError) as exc:
                self._failed_at[addr] = time.monotonic()
                tried.append(f"{addr[0]}:{addr[1]} ({exc})")
                continue
            self._failed_at.pop(addr, None)
            ranges = []
            for entry in reply:
                start, end, primary = int(entry[0]), int(entry[1]), entry[2]
                host = primary[0].decode() if isinstance(primary[0], bytes) else primary[0]
                ranges.append((start, end, (host or addr[0], int(primary[1]))))
            ranges.sort()
            with self._lock:
                self._starts = [r[0] for r in ranges]
                self._ends = [r[1] for r in ranges]
                self._owners = [r[2] for r in ranges]
                self._stale = False
            return
        raise redis.ConnectionError("no cluster node answered CLUSTER SLOTS: " + "; ".join(tried))

    def _ready(self) -> None:
        if self._stale:
            self.refresh()

    def client(self, slot: int) -> redis.Redis:
        self._ready()
        i = bisect.bisect_right(self._starts, slot) - 1
        if i < 0 or slot > self._ends[i]:
            self._stale = True
            raise redis.ConnectionError(f"slot {slot} is not served by any cluster node")
        return self._client_at(self._owners[i])

    def node_name(self, slot: int) -> str | None:
        self._ready()
        i = bisect.bisect_right(self._starts, slot) - 1
        if i < 0 or slot > self._ends[i]:
            return None
        host, port = self._owners[i]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def clients(self) -> list[redis.Redis]:
        """One client per primary."""
        self._ready()
        return [self._client_at(a) for a in dict.fromkeys(self._owners)]

    def invalidate(self) -> None:
        self._stale = True

    def close(self) -> None:
        with self._lock:
            pools = list(self._pools.values())
        for c in pools:
            c.connection_pool.disconnect()
