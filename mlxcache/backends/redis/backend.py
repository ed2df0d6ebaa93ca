"""Redis backend: one record per value, a shared LRU index, failures read as misses.

The same code serves one server (``redis://``), a Sentinel-managed primary
(``redis+sentinel://``) and a Redis Cluster (``redis+cluster://``): a router
(:mod:`mlxcache.backends.redis.routes`) names the server of a hash slot, and the key layout
(:mod:`mlxcache.backends.redis.keys`) puts every key of a record and its group's LRU index in
one slot. Every write and its index update run in one MULTI/EXEC (small values) or one Lua
script (chunked values), so every client sees one true total per group and evicts by one LRU
order. See docs/backends.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import SplitResult

import redis
from redis._parsers import Encoder
from redis.backoff import NoBackoff
from redis.connection import PythonRespSerializer
from redis.exceptions import NoScriptError
from redis.retry import Retry

from mlxcache.backends import clock
from mlxcache.backends.base import BackendBase, check_budget, log
from mlxcache.backends.clock import check_lifetime
from mlxcache.backends.fleet import FLEET
from mlxcache.backends.redis import deadline
from mlxcache.backends.redis.keys import KeyLayout, glob_escape
from mlxcache.backends.redis.lookup import WalkMixin
from mlxcache.backends.redis.reads import ReadMixin
from mlxcache.backends.redis.routes import SingleRouter
from mlxcache.backends.redis.scripts import SCRIPTS, SHAS
from mlxcache.backends.redis.writes import WriteMixin
from mlxcache.options import Options, redact_uri
from mlxcache.records import signing

__all__ = ["RedisBackend", "from_uri", "glob_escape", "pool_kwargs", "redis_options"]

REDIS_MAX_STRING = 512 * 1024 * 1024
DEFAULT_CHUNK_SIZE = 256 * 1024 * 1024
DEFAULT_TIMEOUT = 5.0
TOUCH_BATCH = 512  # keys per touch_many command: bounds the time one script holds the server

# redis-py's pure-Python packer sends large values and memoryviews as they are; with hiredis
# installed the default packer would copy every value into one new command buffer (a full
# extra copy of each record). Replies are still parsed by hiredis when it is there.
_PACKER = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)

# Errors that mean "the server is not there": they start the reconnect backoff.
_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, OSError)


def pool_kwargs(timeout: float) -> dict[str, Any]:
    """Connection settings every router uses: timeouts, one quick retry, the copy-free packer."""
    return {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        # one quick retry of a stale pooled connection; a timeout spent the call's deadline
        "retry": Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        "command_packer": _PACKER,
    }


class RedisBackend(WalkMixin, ReadMixin, WriteMixin, BackendBase):
    """Records in Redis under a key prefix, with a byte budget and LRU shared by all clients.

    ``url`` is any redis-py URL (``redis://``, ``rediss://``, ``unix://``); or pass a
    ``router`` (a Sentinel or Cluster router, with ``url`` naming it for logs). ``ttl``
    (seconds) applies to every value written; ``max_bytes`` bounds the stored bytes of all
    clients using the same prefix (None: unbounded, leave it to Redis' ``maxmemory``). Keys
    are split into ``groups`` hash-tagged groups, each with its own LRU and ``max_bytes //
    groups`` of the budget (1 on one server: one exact LRU; more on a Cluster, to spread over
    its primaries). Values larger than ``chunk_size`` are split and still committed
    atomically. When Redis is unreachable every call degrades (miss, no-op, empty) and the
    server is skipped for a backoff that grows from ``backoff`` to ``max_backoff`` seconds.
    With a ``signer`` (default: from ``$MLXCACHE_SECRET``, or the variable ``secret_env``
    names) every record is signed for its key and a value without a valid MAC is rejected
    (``stats()["rejected"]``) and deleted.
    """

    scheme = "redis"
    pinnable = True
    _unreachable = _UNREACHABLE

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "mlxcache:",
        ttl: float | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_bytes: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        backoff: float = 0.1,
        max_backoff: float = 5.0,
        signer: signing.Signer | None = None,
        secret_env: str | None = None,
        groups: int = 1,
        router: Any = None,
        idle_ttl: float | None = None,
        pin_max_bytes: int | None = None,
        **redis_kwargs: Any,
    ) -> None:
        if not isinstance(url, str):
            raise TypeError(f"url must be a str, got {type(url).__name__}")
        if ttl is not None and not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds or None, got {ttl!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if not 0 < chunk_size <= REDIS_MAX_STRING:
            raise ValueError(f"chunk_size must be in 1..{REDIS_MAX_STRING} bytes, got {chunk_size}")
        self.layout = KeyLayout(prefix, groups)
        super().__init__(max_bytes=max_bytes, backoff=backoff, max_backoff=max_backoff)
        self.signer = signer if signer is not None else signing.resolve(secret_env)
        self.prefix = prefix
        self.groups = groups
        self.ttl = ttl
        self.timeout = timeout
        self.chunk_size = chunk_size
        self._ttl_ms = 0 if ttl is None else max(1, round(ttl * 1000))
        self.idle_ttl = check_lifetime("idle_ttl", idle_ttl)
        self._idle_ms = 0 if idle_ttl is None else max(1, round(idle_ttl * 1000))
        pin_max = check_budget("pin_max_bytes", pin_max_bytes)
        self.pin_max_bytes = max_bytes if pin_max is None else pin_max
        if router is None:
            pool = redis.ConnectionPool.from_url(url, **pool_kwargs(timeout), **redis_kwargs)
            router = SingleRouter(deadline.arm(pool))
            url = redact_uri(url)  # fit to print: user:***@host:port/db, never the password
        self.router = router
        self.url = url
        self.pool = getattr(router, "pool", None)  # one server's pool (None on a Cluster)
        self.client = getattr(router, "one", None)  # and its client
        if max_bytes is not None:
            self.trim(max_bytes)  # opening with a budget enforces it (``mlxcache gc``)

    def where(self) -> str:
        return self.url

    def _within(self) -> Any:
        """Every call waits at most ``timeout`` seconds on a silent server, in all."""
        return deadline.scope(self.timeout)

    @property
    def group_budget(self) -> int | None:
        """The byte budget of one key group (``max_bytes // groups``)."""
        return None if self.max_bytes is None else self.max_bytes // self.groups

    def _trim(self, max_bytes: int) -> int:
        share = max_bytes // self.groups
        return sum(int(x) for x in self._each_group("evict", lambda g: [share]))

    # ------------------------------------------------------------ routing and scripts

    def _client(self, g: int) -> redis.Redis:
        return self.router.client(self.layout.slots[g])

    def _by_node(self, groups: Iterable[int]) -> list[tuple[redis.Redis, list[int]]]:
        """Positions of ``groups`` batched by the node serving them (one pipeline each)."""
        batches: dict[int, tuple[redis.Redis, list[int]]] = {}
        for i, g in enumerate(groups):
            c = self._client(g)
            batches.setdefault(id(c), (c, []))[1].append(i)
        return list(batches.values())

    def error(self, op: str, exc: BaseException | str, n: int = 1, logged: bool = False,
              spent: float = 0.0) -> None:  # fmt: skip
        """Count a failure (see BackendBase.error); a router then reads the topology again, so
        a failover or a moved slot is followed."""
        if not isinstance(exc, str):
            self.router.invalidate()
        super().error(op, exc, n, logged, spent)

    def _eval(self, target: Any, name: str, g: int, keys: list[str], args: list[Any]) -> Any:
        offset = round(clock.offset() * 1000)  # 0 unless a test moved the lifetime clock
        head = self.layout.heads[g]
        return target.evalsha(
            SHAS[name], len(keys), *keys, head, offset, self._ttl_ms, self._idle_ms, *args
        )

    def _load_scripts(self, client: redis.Redis) -> None:
        for body in SCRIPTS.values():
            client.script_load(body)

    def _script(self, name: str, g: int, args: list[Any], keys: list[str] | None = None) -> Any:
        """Run a script on group ``g`` by SHA, loading it once if the server forgot it."""
        client = self._client(g)
        keys = self.layout.index[g] if keys is None else keys
        try:
            return self._eval(client, name, g, keys, args)
        except NoScriptError:
            self._load_scripts(client)
            return self._eval(client, name, g, keys, args)

    def _scripts(self, client: redis.Redis, calls: list[tuple[str, int, list, list]]) -> list:
        """Run ``(script, group, keys, args)`` calls in one pipeline on one node; the scripts
        are loaded once if the node forgot them (a restart, a promoted replica)."""
        for attempt in (0, 1):
            pipe = client.pipeline(transaction=False)
            for name, g, keys, args in calls:
                self._eval(pipe, name, g, keys, args)
            replies = pipe.execute(raise_on_error=False)
            if attempt == 0 and any(isinstance(r, NoScriptError) for r in replies):
                self._load_scripts(client)
                continue
            for r in replies:
                if isinstance(r, Exception):
                    raise r
            return replies
        raise AssertionError("unreachable")  # pragma: no cover

    def _each_group(self, name: str, args: Callable[[int], list[Any]]) -> list[Any]:
        """Run a script once per group, one pipeline per node; results in group order."""
        out: list[Any] = [None] * self.groups
        for client, gs in self._by_node(range(self.groups)):
            calls = [(name, g, self.layout.index[g], args(g)) for g in gs]
            for g, r in zip(gs, self._scripts(client, calls), strict=True):
                out[g] = r
        return out

    # ------------------------------------------------------------ reading

    def _touch_many(self, keys: list[str]) -> None:
        """Refresh LRU order of keys (the touch script), one pipeline per node."""
        self._live(keys, refresh=True)

    def _live(self, keys: list[str], refresh: bool) -> list[bool]:
        """Whether each key is stored and live (``refresh``: as a read, in the LRU order): one
        ``touch_many`` per group and ``TOUCH_BATCH`` keys, one pipelined round trip per node.
        One command per key cost more to pack than the server took to answer (a prefix
        lookup's probe asks up to a block's worth of tail keys)."""
        groups = [self.layout.group(k) for k in keys]
        found = [False] * len(keys)
        for client, pos in self._by_node(groups):
            by_group: dict[int, list[int]] = {}
            for i in pos:
                by_group.setdefault(groups[i], []).append(i)
            calls, order = [], []
            for g, members in by_group.items():
                for at in range(0, len(members), TOUCH_BATCH):
                    part = members[at : at + TOUCH_BATCH]
                    vkeys = [self.layout.vkey(keys[i], g) for i in part]
                    args = [int(refresh), *(keys[i] for i in part)]
                    calls.append(("touch_many", g, [*self.layout.index[g], *vkeys], args))
                    order.append(part)
            for part, replies in zip(order, self._scripts(client, calls), strict=True):
                for i, x in zip(part, replies, strict=True):
                    found[i] = bool(x)
        return found

    # ------------------------------------------------------------ the rest of the protocol

    def _delete(self, key: str) -> bool:
        return bool(self._script("drop", self.layout.group(key), [key]))

    def _contains_many(self, keys: list[str]) -> list[bool]:
        """Whether keys are stored and live (the LRU order untouched)."""
        return self._live(keys, refresh=False)

    def _pin(self, key: str, on: bool) -> bool:
        g = self.layout.group(key)
        keys = [*self.layout.index[g], self.layout.vkey(key, g)]
        budget = self.group_budget
        pmax = self.pin_max_bytes
        pmax = -1 if pmax is None else pmax // self.groups
        args = [key, int(on), pmax, -1 if budget is None else budget]
        status, n = self._script("pin", g, args, keys)
        if status == -1:
            log.warning(
                "%s cache: not pinning %r: pins hold %d bytes of pin_max_bytes=%s",
                self.scheme, key, int(n), self.pin_max_bytes,
            )  # fmt: skip
            return False
        if status == 1 and not on and n:
            self._counters.add("evictions", int(n))
        return status == 1

    def _keys(self, prefix: str) -> Iterator[str]:
        """User keys starting with ``prefix`` (SCAN of every primary, never KEYS)."""
        if self._ttl_ms or self._idle_ms:
            self._each_group("stats", lambda g: [])  # drops expired keys first
        pattern = self.layout.value_pattern(prefix)
        seen: set[bytes] = set()
        for client in self.router.clients():
            for raw in client.scan_iter(match=pattern, count=1000):
                if raw not in seen:
                    seen.add(raw)
                    key = self.layout.user_key(raw)
                    if key is not None and key.startswith(prefix):
                        yield key

    def _count(self) -> int:
        return self._stats()["entries"]

    def _clear(self) -> None:
        """Remove every key under our prefix (SCAN + UNLINK); other keys are untouched.

        Keys of the layout before key groups (``{prefix}v:...``) are removed too."""
        for client in self.router.clients():
            for pattern in self.layout.all_patterns():
                batch: list[bytes] = []
                for raw in client.scan_iter(match=pattern, count=1000):
                    batch.append(raw)
                    if len(batch) >= 1000:
                        _unlink(client, batch)
                        batch.clear()
                _unlink(client, batch)

    def _fleet_key(self) -> tuple[redis.Redis, str]:
        return self.router.client(self.layout.slots[0]), self.layout.heads[0] + "f:counters"

    def _fleet_add(self, deltas: dict[str, int]) -> None:
        """Fleet counters are one hash (``{prefix}{tag}f:counters``) summed with HINCRBY."""
        client, name = self._fleet_key()
        pipe = client.pipeline(transaction=False)
        for k, v in deltas.items():
            pipe.hincrby(name, k, int(v))
        pipe.execute()

    def _fleet_read(self) -> dict[str, int]:
        client, name = self._fleet_key()
        raw = client.hgetall(name)
        out = dict.fromkeys(FLEET, 0)
        for k, v in raw.items():
            name_ = k.decode("utf-8", "replace") if isinstance(k, bytes) else str(k)
            if name_ in out and re.fullmatch(rb"-?\d{1,19}", v if isinstance(v, bytes) else b""):
                out[name_] = int(v)
        return out

    def _stats(self) -> dict[str, Any]:
        """Entries and bytes from the shared index (hits/misses/...: this process's)."""
        found = self._each_group("stats", lambda g: [])
        out: dict[str, Any] = {
            "entries": sum(int(f[0]) for f in found),
            "bytes": sum(int(f[1]) for f in found),
            "pinned_entries": sum(int(f[2]) for f in found),
            "pinned_bytes": sum(int(f[3]) for f in found),
        }
        nodes: dict[str, dict[str, int]] = {}
        for g, (e, b, *_) in enumerate(found):
            name = self.router.node_name(self.layout.slots[g])
            if name is not None:  # a cluster: how the groups and bytes spread over primaries
                n = nodes.setdefault(name, {"groups": 0, "entries": 0, "bytes": 0})
                n["groups"] += 1
                n["entries"] += int(e)
                n["bytes"] += int(b)
        if nodes:
            out["nodes"] = nodes
        return out

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "prefix": self.prefix,
            "groups": self.groups,
            "ttl": self.ttl,
            "idle_ttl": self.idle_ttl,
            "pin_max_bytes": self.pin_max_bytes,
            "chunk_size": self.chunk_size,
            "signed_by": self.signer.key_id if self.signer else None,  # a public key id
        }

    def _close(self) -> None:
        """Close pooled connections (a later call would open new ones)."""
        self.router.close()

    def __repr__(self) -> str:
        return f"RedisBackend({self.url!r}, prefix={self.prefix!r})"


def _unlink(client: redis.Redis, names: list[bytes]) -> None:
    """UNLINK one key per command (keys of many slots may share a cluster node)."""
    if names:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.unlink(name)
        pipe.execute()


_REDIS_OPTIONS = ("db", "username", "password", "max_connections", "ssl_cert_reqs",
                  "ssl_ca_certs", "ssl_certfile", "ssl_keyfile")  # fmt: skip


def redis_options(
    opts: Options, *, groups: int, names: tuple[str, ...] = _REDIS_OPTIONS
) -> dict[str, Any]:
    """The typed options every Redis scheme takes, then redis-py's own (``names``)."""
    out: dict[str, Any] = {
        "prefix": opts.str("prefix", "mlxcache:"),
        "ttl": opts.float("ttl", None, minimum=0.001),
        "idle_ttl": opts.float("idle_ttl", None, minimum=0.001),
        "pin_max_bytes": opts.size("pin_max_bytes", None),
        "timeout": opts.float("timeout", DEFAULT_TIMEOUT, minimum=0.001),
        "max_bytes": opts.size("max_bytes", None),
        "chunk_size": opts.size("chunk_size", DEFAULT_CHUNK_SIZE),
        "backoff": opts.float("backoff", 0.1, minimum=0.001),
        "max_backoff": opts.float("max_backoff", 5.0, minimum=0.001),
        "groups": opts.int("groups", groups, minimum=1),
        "secret_env": opts.str("secret_env", None),
    }
    for name in names:
        value = opts.int(name, None) if name in ("db", "max_connections") else opts.str(name, None)
        if value is not None:
            out[name] = value
    return out


def from_uri(url: SplitResult, opts: Options) -> RedisBackend:
    """``redis://[user:password@]host:port/db``, ``rediss://...``, ``unix:///path.sock?db=0``.

    Options: prefix, ttl (s), idle_ttl (s), pin_max_bytes, timeout (s), max_bytes, chunk_size,
    backoff (s), max_backoff (s),
    groups (default 1), secret_env, and for redis-py: db, username, password, max_connections,
    ssl_cert_reqs, ssl_ca_certs, ssl_certfile, ssl_keyfile.
    """
    scheme = url.scheme.lower()
    try:
        url.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise ValueError(f"{scheme}:// URI has a bad port: {exc}") from None
    if scheme == "unix":
        if url.hostname or not url.path.startswith("/"):
            raise ValueError("unix:// needs an absolute socket path, like unix:///run/redis.sock")
    elif url.path not in ("", "/") and not re.fullmatch(r"/\d+", url.path):
        raise ValueError(f"{scheme}:// path must be a database number like /0, got {url.path!r}")
    kwargs = redis_options(opts, groups=1)
    opts.done()
    base = f"{scheme}://{url.netloc}{url.path}"  # urlunsplit drops "//" of unix:///x
    return RedisBackend(base, **kwargs)
