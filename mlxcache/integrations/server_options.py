"""The options every ``mlxcache serve`` engine adds to its engine server's own: where the cache
is, its block size, a tenant salt and the model's name in the shared keys."""

from __future__ import annotations

import argparse

DEFAULT_CACHE_HELP = (
    "cache URI (default: $MLXCACHE_URL, else file://~/.cache/mlxcache?max_bytes=20GiB)"
)


def cache_options(
    prog: str, description: str, *, cache_help: str = DEFAULT_CACHE_HELP
) -> argparse.ArgumentParser:
    """A parser of mlxcache's own serve options; every other option is the engine server's.

    No abbreviations, so an engine option is never taken for one of ours."""
    p = argparse.ArgumentParser(
        prog=prog, add_help=False, allow_abbrev=False, description=description
    )
    p.add_argument("--cache", default=None, help=cache_help)
    p.add_argument(
        "--cache-block-size", type=int, default=256, help="tokens per stored block (256)"
    )
    p.add_argument("--cache-salt", default="", help="isolates tenants sharing one cache")
    p.add_argument(
        "--cache-model-name",
        default=None,
        help="the model's name in the shared keys (default: --model, a local folder by its "
        "real path); servers share KV only when name, config and weights layout match",
    )
    return p
