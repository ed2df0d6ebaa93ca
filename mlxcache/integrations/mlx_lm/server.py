"""``mlxcache serve``: mlx-lm's own HTTP server with a persistent, shared prompt cache.

mlx-lm parses its options, loads the model and answers requests with its handler and its
``ResponseGenerator``; the only change is the prompt cache (``SharedPromptCache`` on ``--cache
URI``, with ``--prompt-cache-size`` and ``--prompt-cache-bytes`` held by the hot tier), a
request's own ``cache_salt`` on its keys (``served_cache``), stores after each prefill chunk of
models with window or state layers (``chunk_stores``), and that a response ends only once its
prompt cache is stored, so a server killed right after answering has lost nothing it answered.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import sys
import threading
from collections.abc import Sequence
from queue import Queue
from typing import Any

from mlxcache.integrations import served_model
from mlxcache.integrations.request_salt import HEADER as SALT_HEADER
from mlxcache.integrations.request_salt import SaltError, request_salt
from mlxcache.integrations.server_options import cache_options
from mlxcache.prefix.model_id import model_identity
from mlxcache.serializers import kv_quant
from mlxcache.uri import open_backend

log = logging.getLogger("mlxcache")
_HANDLER = threading.local()  # the salt of the request the handler thread is putting

INSTALL_HINT = "mlxcache serve needs mlx-lm: pip install 'mlxcache[lm]'"
END_TIMEOUT = 10.0  # seconds a response waits for its store at most


class StartFailed(Exception):
    """The server cannot start (the model does not load, the port is taken): one line."""


def installed() -> bool:
    """Whether mlx-lm (this engine) can be imported."""
    try:
        import mlx_lm.server  # noqa: F401
    except ImportError:
        return False
    return True


def _options() -> argparse.ArgumentParser:
    p = cache_options(
        "mlxcache serve",
        "mlx-lm's server (every mlx_lm.server option) with a persistent prompt cache. "
        "mlxcache's own options:",
    )
    p.add_argument(
        "--cache-kv-bits",
        type=int,
        default=None,
        help="store KV quantized to this many bits (8, 4, ...; lossy, fewer bytes moved; "
        "default exact). Not mlx-lm's --kv-bits, which quantizes the live cache",
    )
    p.add_argument(
        "--cache-kv-group-size", type=int, default=64, help="values per scale (32, 64, 128)"
    )
    return p


def lm_identity(model: Any, name: str) -> str:
    """The ``PrefixCache`` model identity of a loaded mlx-lm model called ``name``."""

    return model_identity(model, name=name)


def key_name(model_key: Any, override: str | None) -> str:
    """``--model`` (a local folder by its real path), adapter and draft model, joined."""
    parts = list(model_key) if isinstance(model_key, tuple | list) else [model_key]
    names = [
        "" if p is None else (os.path.realpath(p) if os.path.isdir(str(p)) else str(p))
        for p in parts
    ]
    if override:
        names[0] = override
    return "+".join(n for n in names if n) or "model"


class _HeldEnd:
    """Forwards a response queue but holds its end marker until the prompt cache has stored."""

    def __init__(
        self, queue: Queue, prompt_cache: Any, salt: str = "", timeout: float = END_TIMEOUT
    ) -> None:
        self._queue, self._cache, self._timeout = queue, prompt_cache, timeout
        self.salt = salt
        self._lock = threading.Lock()

    def put(self, item: Any, *args: Any, **kwargs: Any) -> None:
        if item is not None or not hasattr(self._cache, "after_next_insert"):
            self._queue.put(item, *args, **kwargs)
            return
        if hasattr(self._cache, "salt_next_insert"):  # the insert that follows is this request's
            self._cache.salt_next_insert(self.salt)
        sent = [False]

        def release() -> None:
            with self._lock:
                if sent[0]:
                    return
                sent[0] = True
            timer.cancel()
            self._queue.put(None)

        timer = threading.Timer(self._timeout, release)  # never hold a response forever
        timer.daemon = True
        timer.start()
        self._cache.after_next_insert(release)


class _Requests(Queue):
    """The generator's request queue: wraps each request's response queue in ``_HeldEnd``."""

    def __init__(self, prompt_cache: Any) -> None:
        super().__init__()
        self._cache = prompt_cache

    def put(self, item: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(item, tuple) and item and isinstance(item[0], Queue):
            salt = getattr(_HANDLER, "salt", "")  # put on the handler's thread
            if len(item) > 1 and salt:
                item[1].mlxcache_salt = salt  # read back by _tokenize, on the generation thread
            item = (_HeldEnd(item[0], self._cache, salt), *item[1:])
        super().put(item, *args, **kwargs)


def _response_generator_class():
    from mlx_lm.server import ResponseGenerator

    class CachedResponseGenerator(ResponseGenerator):
        """mlx-lm's ResponseGenerator whose responses end after their cache is stored."""

        @property
        def requests(self) -> Queue:
            return self._mlxcache_requests

        @requests.setter
        def requests(self, _queue: Queue) -> None:  # set once by ResponseGenerator.__init__
            self._mlxcache_requests = _Requests(self.prompt_cache)

        def _tokenize(self, tokenizer, request, args):  # its prompt is looked up next
            if hasattr(self.prompt_cache, "use_salt"):
                self.prompt_cache.use_salt(getattr(request, "mlxcache_salt", ""))
            return super()._tokenize(tokenizer, request, args)

    return CachedResponseGenerator


def _metrics_handler(base: type, prompt_cache: Any) -> type:
    """mlx-lm's handler plus ``GET /metrics`` (Prometheus text of the shared cache) and each
    POST's ``cache_salt`` (``request_salt``: a bad one is answered 400).

    Without prometheus_client (the metrics extra) ``/metrics`` answers 501 saying so.
    """

    class MetricsHandler(base):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            """Read the request's ``cache_salt`` (body or header), then mlx-lm's own handling."""
            try:
                length = int(self.headers.get("Content-Length") or "")
                raw = self.rfile.read(length)  # type: ignore[has-type]
            except ValueError:
                return super().do_POST()  # mlx-lm answers a missing or bad length
            try:
                body = json.loads(raw)
            except ValueError:
                body = None  # mlx-lm answers invalid JSON
            try:
                salt = request_salt(body, self.headers.get(SALT_HEADER))
            except SaltError as exc:
                return self._refuse(str(exc))
            stream, self.rfile = self.rfile, io.BytesIO(raw)  # type: ignore[has-type]
            _HANDLER.salt = salt
            try:
                super().do_POST()
            finally:
                self.rfile, _HANDLER.salt = stream, ""

        def _refuse(self, message: str) -> None:
            body = json.dumps({"error": message}).encode()
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?")[0] != "/metrics":
                return super().do_GET()
            try:
                from mlxcache.metrics import CONTENT_TYPE, render  # the metrics extra
            except ImportError as exc:
                body, status, kind = f"{exc}\n".encode(), 501, "text/plain"
            else:
                objects = [prompt_cache, *prompt_cache.prefix_caches(), prompt_cache.backend]
                body, status, kind = (
                    render(*[o for o in objects if o is not None]),
                    200,
                    CONTENT_TYPE,
                )
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return MetricsHandler


def make_run(options: argparse.Namespace):
    """A replacement for ``mlx_lm.server.run`` that builds the shared prompt cache."""
    import mlx.core as mx
    from mlx_lm import server

    from mlxcache.integrations.mlx_lm import chunk_stores  # imports mlx-lm
    from mlxcache.integrations.mlx_lm.served_cache import ServedPromptCache

    def run(host, port, model_provider, server_class=None, handler_class=None):
        cli = model_provider.cli_args
        if cli.model is not None:  # load before the port opens: a bad model is one line
            try:
                model_provider.load_default()
            except Exception as exc:
                text = str(exc).strip()
                reason = text.splitlines()[0] if text else type(exc).__name__
                raise StartFailed(f"--model {cli.model}: mlx-lm cannot load it: {reason}") from None
        names: dict[Any, str] = {}

        def identity(model_key: Any) -> str:
            if model_key not in names:
                name = key_name(model_key, options.cache_model_name)
                model = model_provider.model if model_provider.model_key == model_key else None
                names[model_key] = lm_identity(model, name) if model is not None else name
            return names[model_key]

        max_bytes = cli.prompt_cache_bytes if cli.prompt_cache_bytes is not None else 1 << 63
        prompt_cache = ServedPromptCache(
            cli.prompt_cache_size,
            max_bytes,
            backend=options.backend,
            identity=identity,
            block_size=options.cache_block_size,
            salt=options.cache_salt,
            kv_bits=options.cache_kv_bits,
            kv_group_size=options.cache_kv_group_size,
            prefill_step=cli.prefill_step_size,
            background=True,  # stores run beside generation; a response still waits for its own
        )
        log.info("mlxcache serve: prompt cache %r", prompt_cache)
        seams = {"BatchGenerator": server.BatchGenerator, "stream_generate": server.stream_generate}

        def key() -> Any:  # the model being served
            return model_provider.model_key

        # stores after each prefill chunk (window and state layers): mlx-lm's own class and
        # function, wrapped where its generation thread looks them up (its module)
        server.BatchGenerator = chunk_stores.batch_generator_class(
            seams["BatchGenerator"], prompt_cache, key
        )
        server.stream_generate = chunk_stores.stream_generate_with_stores(
            seams["stream_generate"], prompt_cache, key
        )
        generator = _response_generator_class()(model_provider, prompt_cache)
        server.scan_cache_dir = served_model.scan_cache_dir  # /v1/models without an HF cache
        handler = _metrics_handler(handler_class or server.APIHandler, prompt_cache)
        kwargs = {"handler_class": served_model.http_handler(handler, cli.model)}
        if server_class is not None:
            kwargs["server_class"] = server_class
        try:
            if mx.distributed.init().rank() == 0:
                server._run_http_server(host, port, generator, **kwargs)
            else:
                generator.join()
        except OSError as exc:  # the port was taken while the model loaded
            generator.stop_and_join()
            raise StartFailed(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        finally:
            prompt_cache.close()
            for name, seam in seams.items():
                setattr(server, name, seam)

    return run


def main(argv: Sequence[str] | None = None) -> int:
    """``mlxcache serve [mlxcache options] [mlx_lm.server options]``; returns an exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        from mlx_lm import server
    except ImportError:
        print(f"mlxcache: error: {INSTALL_HINT}", file=sys.stderr)
        return 1
    parser = _options()
    options, rest = parser.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        parser.print_help()
        print()
    elif options.cache_block_size <= 0:
        print("mlxcache: error: --cache-block-size must be positive", file=sys.stderr)
        return 1
    else:
        try:
            kv_quant.make(options.cache_kv_bits, options.cache_kv_group_size)
            options.backend = open_backend(options.cache)
        except (ValueError, TypeError, OSError) as exc:
            print(f"mlxcache: error: {exc}", file=sys.stderr)
            return 1
    original_run, original_argv = server.run, sys.argv
    server.run = make_run(options)
    sys.argv = ["mlxcache serve", *rest]
    try:
        server.main()
    except StartFailed as exc:
        print(f"mlxcache: error: {exc}", file=sys.stderr)
        return 1
    except SystemExit as exc:  # argparse's --help and usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        server.run, sys.argv = original_run, original_argv
        backend = getattr(options, "backend", None)
        if backend is not None:
            backend.close()
    return 0
