"""Backend URIs: a small scheme registry, ``$MLXCACHE_URL`` and the embedded default.

Built-in schemes are named here and imported on first use. Other packages add schemes through
the ``mlxcache.backends`` entry-point group (as fsspec does with ``fsspec.specs``)::

    [project.entry-points."mlxcache.backends"]
    s3 = "mlxcache_s3:from_uri"

so ``pip install mlxcache-s3`` makes ``s3://`` work in ``open_backend`` and the CLI.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import re
from collections.abc import Callable
from urllib.parse import SplitResult, parse_qsl, urlsplit

from mlxcache.options import Options, redact_uri
from mlxcache.protocol import CacheBackend

log = logging.getLogger("mlxcache")

ENV_VAR = "MLXCACHE_URL"
ENTRY_POINT_GROUP = "mlxcache.backends"
_SCHEME_NAME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
DEFAULT_URL = "file://~/.cache/mlxcache?max_bytes=20GiB"

Factory = Callable[[SplitResult, Options], CacheBackend]

# scheme -> factory, or "module:function" imported on first use so unused backends cost nothing
_SCHEMES: dict[str, Factory | str] = {
    "memory": "mlxcache.backends.memory:from_uri",
    "file": "mlxcache.backends.disk.backend:from_uri",
    "redis": "mlxcache.backends.redis.backend:from_uri",
    "rediss": "mlxcache.backends.redis.backend:from_uri",
    "unix": "mlxcache.backends.redis.backend:from_uri",
    "tiered": "mlxcache.backends.tiered:from_uri",
    "redis+cluster": "mlxcache.backends.redis.cluster:from_cluster_uri",
    "rediss+cluster": "mlxcache.backends.redis.cluster:from_cluster_uri",
    "redis+sentinel": "mlxcache.backends.redis.cluster:from_sentinel_uri",
    "rediss+sentinel": "mlxcache.backends.redis.cluster:from_sentinel_uri",
}


def register_scheme(scheme: str, factory: Factory | str, *, replace: bool = False) -> None:
    """Make ``scheme://`` open a backend built by ``factory(parsed_url, options)``.

    ``factory`` is a callable or a ``"module:function"`` string imported on first use. A
    scheme that is already registered is refused unless ``replace=True``.
    """
    if not isinstance(scheme, str) or not _SCHEME_NAME.fullmatch(scheme):
        raise ValueError(f"invalid scheme name {scheme!r}: letters, digits, + - . (RFC 3986)")
    scheme = scheme.lower()
    if scheme in _SCHEMES and not replace:
        raise ValueError(f"scheme {scheme}:// is already registered (pass replace=True)")
    _SCHEMES[scheme] = factory


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """Schemes other packages register; one naming a built-in scheme is ignored, logged."""
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        name = ep.name.lower()
        if name in _SCHEMES:
            log.warning("ignoring entry point %s for %s://: already registered", ep.value, name)
        else:
            found.setdefault(name, ep)
    return found


def schemes() -> list[str]:
    """Every scheme ``open_backend`` knows: registered ones and entry points."""
    return sorted({*_SCHEMES, *_entry_points()})


def _factory(scheme: str) -> Factory | None:
    factory = _SCHEMES.get(scheme)
    if factory is None:
        ep = _entry_points().get(scheme)
        if ep is None:
            return None
        factory = ep.value
    if isinstance(factory, str):
        module, _, name = factory.partition(":")
        factory = getattr(importlib.import_module(module), name)
    return factory


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
    factory = _factory(scheme) if "://" in uri else None
    if factory is None:
        raise ValueError(_unknown(uri, scheme))
    values: dict[str, object] = dict(parse_qsl(url.query, keep_blank_values=True))
    values.update(options)
    return factory(url, Options(scheme, values))


def _unknown(uri: str, scheme: str) -> str:
    """Why ``uri`` names no backend, quoting what was given and saying what to write instead."""
    known = schemes()
    listed = ", ".join(f"{s}://" for s in known)
    if uri.lower() in known:
        return f"cache URI {uri!r} is a scheme alone: write {uri.lower()}://..."
    if "://" not in uri and (not scheme or uri.startswith(("/", ".", "~")) or len(scheme) == 1):
        path = uri if uri.startswith("~") else os.path.abspath(uri)  # C:\\x is a path too
        return f"cache URI {uri!r} is a path, not a URI: write file://{path} (or one of {listed})"
    if "://" not in uri:  # "file:/tmp/x", "redis:host:6379"
        rest = uri.split(":", 1)[1]
        if scheme == "file":
            path = rest if rest.startswith("~") else os.path.abspath(os.path.expanduser(rest))
            fixed = f"file://{path}"
        else:
            fixed = redact_uri(f"{scheme}://{rest.lstrip('/')}")
        given = f"{scheme}:***@{uri.rsplit('@', 1)[1]}" if "@" in uri else uri
        return f"cache URI {given!r} has no '//' after '{scheme}:': write {fixed}"
    return f"unknown cache URI scheme '{scheme}://' in {redact_uri(uri)!r}: use one of {listed}"
