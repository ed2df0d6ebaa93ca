"""Every backend the contract suite runs on: name -> a fresh, empty store.

A factory takes pytest's ``request`` and ``tmp_path`` and returns a :class:`Store`: the URI that
opens the backend (``open_backend(uri, **options)``; options override the query) and whether
another process opening the same URI sees the same data. Add a backend here and it runs the
whole of ``tests/test_backend_contract.py``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PLUGIN_DIR = Path(__file__).resolve().parent / "plugin"


@dataclass(frozen=True)
class Store:
    uri: str
    shared: bool  # another process sees the same data
    env: dict[str, str] | None = None  # what a child process needs to open it


def _memory(request: Any, tmp_path: Path) -> Store:
    return Store("memory://", shared=False)


def _file(request: Any, tmp_path: Path) -> Store:
    return Store(f"file://{tmp_path}/cache", shared=True)


def _redis(request: Any, tmp_path: Path) -> Store:
    return Store(request.getfixturevalue("redis_url"), shared=True)


def _plugin(request: Any, tmp_path: Path) -> Store:
    """``dict://``: a third-party backend found through the ``mlxcache.backends`` entry point."""
    if str(PLUGIN_DIR) not in sys.path:
        sys.path.insert(0, str(PLUGIN_DIR))  # holds the module and its .dist-info
    path = os.pathsep.join([str(PLUGIN_DIR), os.environ.get("PYTHONPATH", "")])
    return Store("dict://", shared=False, env={"PYTHONPATH": path})


def _redis_cluster(request: Any, tmp_path: Path) -> Store:
    """A real 3+3 Redis Cluster. One key group: the contract's exact LRU over a few keys is
    what one group gives (test_redis_cluster.py covers the default 16 groups)."""
    return Store(request.getfixturevalue("redis_cluster").url + "?groups=1", shared=True)


def _redis_sentinel(request: Any, tmp_path: Path) -> Store:
    return Store(request.getfixturevalue("redis_sentinel").url, shared=True)


def _tiered(write: str) -> Callable[[Any, Path], Store]:
    def factory(request: Any, tmp_path: Path) -> Store:
        from mlxcache.backends.tiered import tiered_uri

        return Store(tiered_uri("memory://", f"file://{tmp_path}/l2", write=write), shared=True)

    return factory


SIGNED_VAR, SIGNED_SECRET = "MLXCACHE_CONTRACT_SECRET", "contract-suite-secret-0123456789"


def _signed(base: Callable[[Any, Path], Store]) -> Callable[[Any, Path], Store]:
    """The same backend with every record signed and verified (docs/reliability.md)."""

    def factory(request: Any, tmp_path: Path) -> Store:
        request.getfixturevalue("monkeypatch").setenv(SIGNED_VAR, SIGNED_SECRET)
        store = base(request, tmp_path)
        sep = "&" if "?" in store.uri else "?"
        env = {**(store.env or {}), SIGNED_VAR: SIGNED_SECRET}
        return Store(f"{store.uri}{sep}secret_env={SIGNED_VAR}", shared=store.shared, env=env)

    return factory


BACKENDS: dict[str, Callable[[Any, Path], Store]] = {
    "memory": _memory,
    "file": _file,
    "redis": _redis,
    "plugin": _plugin,
    "redis-cluster": _redis_cluster,
    "redis-sentinel": _redis_sentinel,
    "tiered": _tiered("through"),
    "tiered-behind": _tiered("behind"),
    "file-signed": _signed(_file),
    "redis-signed": _signed(_redis),
    "redis-cluster-signed": _signed(_redis_cluster),
}
