"""``mlxcache serve --engine mlx-vlm``: mlx-vlm's own HTTP server with its prefix cache on mlxcache.

mlx-vlm parses every one of its options, loads the model and answers requests; before its
``cli.main()`` runs (in this process: uvicorn without ``--reload``) names are replaced:
``mlx_vlm.apc.from_env`` builds a ``SharedAPCManager`` on ``--cache URI`` (see ``apc.py``),
``mlx_vlm.apc.hash_image_payload`` also records each request's pixel digest, and
``mlx_vlm.server.app.VisionFeatureCache`` becomes a vision feature cache with a shared tier,
keyed per request tenant (``cache_salt``, ``X-APC-Tenant``) by ``vision_tenant.py``;
``PromptProcessingBatch.prompt_step`` also stores after each prefill chunk of a sliding-window or
hybrid model (``chunk_stores.py``).
``GET /metrics`` is added (Prometheus text of the prefix caches and the backend).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from mlxcache.backends.base import CacheBackend
from mlxcache.integrations.server_options import cache_options
from mlxcache.prefix.model_id import model_identity
from mlxcache.uri import open_backend

log = logging.getLogger("mlxcache")

_KV_ENV = ("KV_BITS", "KV_KEY_BITS", "KV_VALUE_BITS", "KV_KEY_SCHEME", "KV_VALUE_SCHEME",
           "KV_QUANT_SCHEME", "KV_GROUP_SIZE", "QUANTIZED_KV_START")  # fmt: skip


def _options() -> argparse.ArgumentParser:
    return cache_options(
        "mlxcache serve --engine mlx-vlm",
        "mlx-vlm's server (every mlx_vlm.server option) with its prefix cache on mlxcache. "
        "mlxcache's own options:",
    )


def model_folder(model: str) -> str | None:
    """The local folder of ``model`` (a folder, or a Hugging Face id already downloaded)."""
    if os.path.isdir(model):
        return model
    try:
        from mlx_vlm.utils import get_model_path

        return str(get_model_path(model))
    except Exception:  # not downloaded and offline, or not a repo: mlx-vlm will say so
        return None


def check_model(model: str | None) -> str | None:
    """Why mlx-vlm cannot load the local folder ``model`` (one line), or None."""
    if model is None or not (os.path.isdir(model) or os.path.exists(model)):
        if model is not None and (model.startswith((".", "/", "~")) or model.count("/") > 1):
            return f"--model {model}: no such folder"
        return None  # a Hugging Face id: mlx-vlm fetches it (or fails before its port opens)
    path = os.path.join(model, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
        from mlx_vlm.utils import get_model_and_args

        get_model_and_args(config)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:
        return f"--model {model}: mlx-vlm cannot load it: {exc}"
    return None


def identity(model_path: str, override: str | None) -> str:
    """The prefix cache's model identity: name, config digest and quantization of the folder."""
    name = override or (os.path.realpath(model_path) if os.path.isdir(model_path) else model_path)
    folder = model_folder(model_path)
    if folder is None:
        return model_identity({"model_type": "model"}, name=name)
    return model_identity(folder, name=name)


def kv_salt(salt: str) -> str:
    """``--cache-salt`` plus mlx-vlm's live-KV quantization settings, when any are set.

    Its harvest stores quantized KV dequantized: it must not meet an unquantized server's.
    """
    if not any(os.environ.get(k) for k in ("KV_BITS", "KV_KEY_BITS", "KV_VALUE_BITS")):
        return salt
    kv = ",".join(f"{k}={os.environ.get(k, '')}" for k in _KV_ENV)
    return f"{salt}|kv:{kv}"


def _metrics_route(app: Any, installed: Any, backend: CacheBackend) -> None:
    """``GET /metrics`` on mlx-vlm's FastAPI app, ahead of its own routes."""
    from fastapi.responses import Response

    def metrics() -> Response:
        try:
            from mlxcache.metrics import CONTENT_TYPE, render  # the metrics extra
        except ImportError as exc:
            return Response(f"{exc}\n", status_code=501, media_type="text/plain")
        objects = [installed.errors, *installed.prefix_caches(), backend]
        return Response(render(*objects), media_type=CONTENT_TYPE)

    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    app.router.routes.insert(0, app.router.routes.pop())


def _model_check(app: Any, served: str | None) -> None:
    """Unknown ``model`` names are a 404 naming the served one, before mlx-vlm loads anything."""
    from mlxcache.integrations import served_model

    app.add_middleware(served_model.ModelCheck, served=served)


def install_all(options: argparse.Namespace, backend: CacheBackend) -> Any:
    """Put mlxcache into mlx-vlm's server (see the module docstring); returns the undo."""
    from mlxcache.integrations.mlx_vlm import chunk_stores, salts, vision_tenant
    from mlxcache.integrations.mlx_vlm.apc import install
    from mlxcache.integrations.mlx_vlm.models import refused_type
    from mlxcache.integrations.mlx_vlm.server_vision import VisionBinder
    from mlxcache.prefix import PrefixCache

    names: dict[str, str] = {}

    def name_of(model_path: str) -> str:
        if model_path not in names:
            names[model_path] = identity(model_path, options.cache_model_name)
        return names[model_path]

    def make_prefix(model_path: str) -> PrefixCache:
        config = _config(model_path)
        return PrefixCache(
            backend,
            model=name_of(model_path),
            block_size=options.cache_block_size,
            salt=kv_salt(options.cache_salt),
            image_token_id=config.get("image_token_id"),
        )

    def refusal(model_path: str) -> str | None:
        return refused_type(str(_config(model_path).get("model_type", "")))

    vision = VisionBinder(backend, salt=options.cache_salt)
    installed = install(
        make_prefix, on_load=lambda path: vision.bind(name_of(path)), refusal=refusal
    )
    app_module = importlib.import_module("mlx_vlm.server.app")
    installed.replace(app_module, "VisionFeatureCache", vision.make)
    salts.install(installed)  # a request's cache_salt joins its keys
    vision_tenant.install(installed)  # and its vision features' keys
    chunk_stores.install(installed)  # window models: each prefill chunk's blocks are stored
    from mlx_vlm.server import app

    _metrics_route(app, installed, backend)
    return installed


def _config(model_path: str) -> dict[str, Any]:
    folder = model_folder(model_path)
    try:
        with open(os.path.join(folder or model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    token = config.get("image_token_id", config.get("image_token_index"))
    return {
        "image_token_id": token if isinstance(token, int) else None,
        "model_type": config.get("model_type"),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``mlxcache serve --engine mlx-vlm [mlxcache options] [mlx_vlm.server options]``.

    ``mlxcache.cli.serve`` checks mlx-vlm's version first (this module imports mlx-vlm).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _options()
    options, rest = parser.parse_known_args(argv)
    backend = None
    if "-h" in rest or "--help" in rest:
        parser.print_help()
        print()
    else:
        probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        probe.add_argument("--model", default=None)
        problem = check_model(probe.parse_known_args(rest)[0].model)
        if options.cache_block_size <= 0:
            problem = "--cache-block-size must be positive"
        if problem is None:
            try:
                backend = open_backend(options.cache)
            except (ValueError, TypeError, OSError) as exc:
                problem = str(exc)
        if problem:
            print(f"mlxcache: error: {problem}", file=sys.stderr)
            return 1
    from mlx_vlm.server import cli

    installed = install_all(options, backend) if backend is not None else None
    if backend is not None:
        from mlx_vlm.server import app

        _model_check(app, probe.parse_known_args(rest)[0].model)
    original_argv, original_apc = sys.argv, os.environ.get("APC_ENABLED")
    if installed is not None:
        os.environ["APC_ENABLED"] = "1"  # mlx-vlm's settings read it; PATCH can turn APC off
    sys.argv = ["mlxcache serve --engine mlx-vlm", *rest]
    try:
        cli.main()
    except SystemExit as exc:  # argparse's --help and usage errors, uvicorn's startup failure
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = original_argv
        if original_apc is None:
            os.environ.pop("APC_ENABLED", None)
        else:
            os.environ["APC_ENABLED"] = original_apc
        if installed is not None:
            for manager in installed.managers:
                manager.prefix.flush()
            installed.uninstall()
        if backend is not None:
            backend.close()
    return 0
