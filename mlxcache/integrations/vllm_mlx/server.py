"""``mlxcache serve --engine vllm-mlx``: vllm-mlx's own server on mlxcache's shared cache.

mlxcache's options (``--model``, ``--cache`` and the ``--cache-*`` settings) are taken out of
the command line; everything else goes to ``vllm-mlx serve`` unchanged. The vllm-mlx version
and the cache settings are checked, and the backend opened, before vllm-mlx parses its options
or loads a model, so bad input is one line and a non-zero exit before a port opens. Then
``install()`` puts vllm-mlx's prefix caches on the backend, ``GET /metrics`` serves the shared
tier's Prometheus metrics, and ``vllm_mlx.cli.main()`` runs the server in this process.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from mlxcache.integrations.server_options import cache_options
from mlxcache.integrations.vllm_mlx import seam
from mlxcache.integrations.vllm_mlx.shared_tier import ERRORS, LIVE
from mlxcache.uri import open_backend

log = logging.getLogger("mlxcache")


def _options() -> argparse.ArgumentParser:
    p = cache_options(
        "mlxcache serve --engine vllm-mlx",
        "vllm-mlx's server (every `vllm-mlx serve` option) on a persistent, shared prefix "
        "cache. mlxcache's own options:",
    )
    p.add_argument("--model", default=None, help="the model (vllm-mlx's positional MODEL)")
    return p


def model_name(model: str, override: str | None) -> str:
    """The model's name in the keys: ``override``, else ``model`` (a folder by real path)."""
    if override:
        return override
    return os.path.realpath(model) if os.path.isdir(model) else model


def _metrics_route(app: Any) -> None:
    """Serve mlxcache's metrics at ``GET /metrics`` (before vllm-mlx's own, off by default)."""
    from starlette.responses import Response
    from starlette.routing import Route

    def metrics(_request: Any) -> Any:
        try:
            from mlxcache.metrics import CONTENT_TYPE, render  # the metrics extra
        except ImportError as exc:
            return Response(f"{exc}\n", status_code=501, media_type="text/plain")
        config = seam.current_config()
        objects: list[Any] = [ERRORS, *(tier.prefix for tier in list(LIVE))]
        if config is not None:
            objects.append(config.backend)
        return Response(render(*objects), media_type=CONTENT_TYPE)

    app.router.routes.insert(0, Route("/metrics", metrics, methods=["GET"]))


def _vllm_argv(model: str | None, rest: list[str]) -> list[str]:
    return ["vllm-mlx", "serve", *([model] if model else []), *rest]


def main(argv: Sequence[str] | None = None) -> int:
    """``mlxcache serve --engine vllm-mlx [mlxcache options] [vllm-mlx serve options]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _options()
    options, rest = parser.parse_known_args(argv)
    helping = "-h" in rest or "--help" in rest
    if helping:
        parser.print_help()
        print()
    try:
        version = seam.check_version()
    except seam.VllmMlxVersionError as exc:
        if helping:  # help works without the engine: it says what to install
            print(f"({exc})")
            return 0
        print(f"mlxcache: error: {exc}", file=sys.stderr)
        return 1
    from vllm_mlx import cli

    if "-h" in rest or "--help" in rest:
        return _run(cli, _vllm_argv(None, rest))
    if options.cache_block_size <= 0:
        print("mlxcache: error: --cache-block-size must be positive", file=sys.stderr)
        return 1
    if options.model is None and (not rest or rest[0].startswith("-")):
        print("mlxcache: error: --model is required", file=sys.stderr)
        return 1
    model = options.model if options.model is not None else rest.pop(0)
    try:
        backend = open_backend(options.cache)
    except (ValueError, TypeError, OSError) as exc:
        print(f"mlxcache: error: {exc}", file=sys.stderr)
        return 1
    try:
        seam.install(
            backend,
            block_size=options.cache_block_size,
            salt=options.cache_salt,
            model_name=model_name(model, options.cache_model_name),
        )
        from vllm_mlx import server

        from mlxcache.integrations.vllm_mlx import engine_salts, mllm_salts, salts

        _metrics_route(server.app)
        salts.install(server.app)  # a request's cache_salt joins its keys, on every path
        engine_salts.install()
        mllm_salts.install()
        log.info("mlxcache serve: vllm-mlx %s on %r", version, backend)
        try:
            return _run(cli, _vllm_argv(model, rest))
        except Exception as exc:  # its model load, before uvicorn opens the port
            text = str(exc).strip()
            reason = text.splitlines()[0] if text else type(exc).__name__
            print(f"mlxcache: error: --model {model}: vllm-mlx cannot load it: {reason}",
                  file=sys.stderr)  # fmt: skip
            return 1
    finally:
        from mlxcache.integrations.vllm_mlx import salts

        salts.uninstall()
        seam.uninstall()
        backend.close()


def _run(cli: Any, argv: list[str]) -> int:
    original = sys.argv
    sys.argv = argv
    try:
        cli.main()
    except SystemExit as exc:  # argparse's --help and usage errors, vllm-mlx's own exits
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = original
    return 0
