"""``redis+cluster://`` and ``redis+sentinel://``: the Redis backend on many servers.

Both build a :class:`~mlxcache.backends.redis.RedisBackend` over a router: a Cluster's slot
map (one pipeline per primary, every record and its group's index in one slot) or the primary
a set of sentinels names (a failover is followed by itself). See docs/backends.md and
docs/operations.md.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import SplitResult, unquote

import redis

from mlxcache.backends.redis.backend import RedisBackend, pool_kwargs, redis_options
from mlxcache.backends.redis.routes import ClusterRouter, SentinelRouter
from mlxcache.options import Options

DEFAULT_CLUSTER_GROUPS = 16
_TLS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
_HOST = re.compile(r"^(?:\[(?P<v6>[0-9a-fA-F:.]+)\]|(?P<host>[^:\[\]]+))(?::(?P<port>\d+))?$")


def parse_hosts(url: SplitResult, default_port: int) -> tuple[list[tuple[str, int]], dict]:
    """``user:password@h1:p1,[::1]:p2`` -> ([(host, port), ...], {username, password})."""
    scheme = url.scheme.lower()
    netloc = url.netloc
    auth: dict[str, str] = {}
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        user, _, password = userinfo.partition(":")
        if user:
            auth["username"] = unquote(user)
        if password:
            auth["password"] = unquote(password)
    hosts = []
    for part in netloc.split(","):
        m = _HOST.match(part.strip())
        if not m:
            raise ValueError(f"{scheme}:// needs host:port[,host:port...], got {part!r}")
        port = int(m["port"]) if m["port"] else default_port
        if not 0 < port < 65536:
            raise ValueError(f"{scheme}:// URI has a bad port: {port}")
        hosts.append((m["v6"] or m["host"], port))
    return hosts, auth


def _tls(scheme: str, kwargs: dict[str, Any], sentinel: bool = False) -> dict[str, Any]:
    """Connection options for TLS (``rediss+...``): SSL connections and the ssl_* options."""
    tls = {k: kwargs.pop(k) for k in _TLS if k in kwargs}
    if scheme.startswith("rediss"):
        # redis-py's sentinel pool picks its own SSL connection class from ssl=True
        if sentinel:
            return {"ssl": True, **tls}
        return {"connection_class": redis.SSLConnection, **tls}
    if tls:
        tls_scheme = scheme.replace("redis", "rediss", 1)
        raise ValueError(f"{scheme}:// takes no ssl_* options: use {tls_scheme}://")
    return {}


def _public(scheme: str, hosts: list[tuple[str, int]], tail: str, auth: dict) -> str:
    names = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in hosts)
    user = f"{auth['username']}@" if "username" in auth else ""
    return f"{scheme}://{user}{names}{tail}"


def from_cluster_uri(url: SplitResult, opts: Options) -> RedisBackend:
    """``redis+cluster://[user:password@]host:port[,host:port...]/`` (``rediss+cluster`` for
    TLS). The hosts are seeds: any reachable node gives the whole slot map.

    Options: those of ``redis://`` (no ``db``: a cluster has only database 0), and
    ``groups`` (default 16): key groups, each in its own hash slot with its own LRU and
    ``max_bytes / groups`` of the budget, spread evenly over the slot space.
    """
    scheme = url.scheme.lower()
    if url.path not in ("", "/"):
        raise ValueError(f"{scheme}:// takes no path (a cluster has only database 0): {url.path!r}")
    hosts, auth = parse_hosts(url, 6379)
    names = ("username", "password", "max_connections", *_TLS)
    kwargs = redis_options(opts, groups=DEFAULT_CLUSTER_GROUPS, names=names)
    opts.done()
    conn = {**auth, **{k: kwargs.pop(k) for k in ("username", "password") if k in kwargs}}
    if "max_connections" in kwargs:
        conn["max_connections"] = kwargs.pop("max_connections")
    conn.update(_tls(scheme, kwargs))
    router = ClusterRouter(hosts, **pool_kwargs(kwargs["timeout"]), **conn)
    backend = RedisBackend(_public(scheme, hosts, "/", auth), router=router, **kwargs)
    backend.scheme = "redis+cluster"
    return backend


def from_sentinel_uri(url: SplitResult, opts: Options) -> RedisBackend:
    """``redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db]``
    (``rediss+sentinel`` for TLS to the servers). The hosts are sentinels (default port
    26379); user and password are the Redis servers'.

    Options: those of ``redis://``, plus ``sentinel_username`` and ``sentinel_password`` when
    the sentinels themselves require authentication.
    """
    scheme = url.scheme.lower()
    m = re.fullmatch(r"/([^/]+)(?:/(\d+))?/?", url.path)
    if not m:
        raise ValueError(
            f"{scheme}:// path must be /service_name or /service_name/db, got {url.path!r}"
        )
    service, db = unquote(m[1]), int(m[2] or 0)
    hosts, auth = parse_hosts(url, 26379)
    sentinel_auth = {}
    for name in ("sentinel_username", "sentinel_password"):
        value = opts.str(name, None)
        if value is not None:
            sentinel_auth[name.removeprefix("sentinel_")] = value
    names = ("username", "password", "max_connections", *_TLS)
    kwargs = redis_options(opts, groups=1, names=names)
    opts.done()
    conn: dict[str, Any] = {**auth, "db": db}
    for k in ("username", "password", "max_connections"):
        if k in kwargs:
            conn[k] = kwargs.pop(k)
    conn.update(_tls(scheme, kwargs, sentinel=True))
    timeout = kwargs["timeout"]
    sentinel_kwargs = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        **sentinel_auth,
    }
    router = SentinelRouter(
        hosts, service, sentinel_kwargs=sentinel_kwargs, **pool_kwargs(timeout), **conn
    )
    public = _public(scheme, hosts, f"/{service}/{db}", auth)
    backend = RedisBackend(public, router=router, **kwargs)
    backend.scheme = "redis+sentinel"
    return backend
