"""Backend URIs: a small scheme registry, ``$MLXCACHE_URL`` and the embedded default."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from urllib.parse import SplitResult, parse_qsl, urlsplit

from mlxcache.backends.base import CacheBackend
from mlxcache.options import Options

ENV_VAR = "MLXCACHE_URL"
DEFAULT_URL = "file://~/.cache/mlxcache?max_bytes=20GiB"

Factory = Callable[[SplitResult, Options], CacheBackend]

# scheme -> factory, or "module:function" imported on first use so unused backends cost nothing
_SCHEMES: dict[str, Factory | str] = {
    "memory": "mlxcache.backends.memory:from_uri",
    "file": "mlxcache.backends.disk:from_uri",
    "redis": "mlxcache.backends.redis:from_uri",
    "rediss": "mlxcache.backends.redis:from_uri",
    "unix": "mlxcache.backends.redis:from_uri",
    "tiered": "mlxcache.backends.tiered:from_uri",
    "redis+cluster": "mlxcache.backends.redis_cluster:from_cluster_uri",
    "rediss+cluster": "mlxcache.backends.redis_cluster:from_cluster_uri",
    "redis+sentinel": "mlxcache.backends.redis_cluster:from_sentinel_uri",
    "rediss+sentinel": "mlxcache.backends.redis_cluster:from_sentinel_uri",
}


def register_scheme(scheme: str, factory: Factory | str) -> None:
    """Make ``scheme://`` open a backend built by ``factory(parsed_url, options)``."""
    _SCHEMES[scheme.lower()] = factory


def schemes() -> list[str]:
    return sorted(_SCHEMES)


def default_uri() -> str:
    """``$MLXCACHE_URL`` when set, else the embedded default (~/.cache/mlxcache, 20 GiB LRU)."""
    return os.environ.get(ENV_VAR) or DEFAULT_URL


def open_backend(uri: str | None = None, **options: object) -> CacheBackend:
    """Open the backend a URI names; keyword options override the query string.

    ``open_backend()`` uses ``$MLXCACHE_URL`` or ``file://~/.cache/mlxcache?max_bytes=20GiB``.
    """
    uri = default_uri() if uri is None else uri
    if not isinstance(uri, str):
        raise TypeError(f"backend URI must be a str, got {type(uri).__name__}")
    url = urlsplit(uri)
    scheme = url.scheme.lower()
    if "://" not in uri or scheme not in _SCHEMES:
        raise ValueError(
            f"unknown cache URI {uri!r}: the scheme must be one of "
            + ", ".join(f"{s}://" for s in schemes())
        )
    values: dict[str, object] = dict(parse_qsl(url.query, keep_blank_values=True))
    values.update(options)
    factory = _SCHEMES[scheme]
    if isinstance(factory, str):
        module, _, name = factory.partition(":")
        factory = getattr(importlib.import_module(module), name)
    opts = Options(scheme, values)
    backend = factory(url, opts)
    return backend
