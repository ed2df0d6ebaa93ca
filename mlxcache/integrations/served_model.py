"""Which ``model`` a request may name, for ``mlxcache serve`` on mlx-lm and mlx-vlm.

Both engines load whatever a request's ``model`` names, so a typo (or a client's default
such as ``gpt-4o``) starts a Hugging Face download, or fails offline with a 200 or a 500 that
clients cannot read. Here a request may name the served model (``--model`` as given or by its
real path, or no model at all), a local folder, or a model already in the local Hugging Face
cache; any other name is a 404 that names the served model, before anything loads. And
listing the local cache (``GET /v1/models``) works when that cache folder does not exist.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Awaitable, Callable, Iterable
from types import SimpleNamespace
from typing import Any

from mlxcache.integrations.asgi import replaying, send_json

# the POST routes whose body names a model, on mlx-lm's and mlx-vlm's servers
GENERATION_PATHS = frozenset(
    ("/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions",
     "/v1/messages", "/messages", "/v1/responses", "/responses")
)  # fmt: skip


def scan_cache_dir() -> Any:
    """``huggingface_hub.scan_cache_dir()``, with no repos when the cache folder is absent."""
    from huggingface_hub import scan_cache_dir as scan
    from huggingface_hub.errors import CacheNotFound

    try:
        return scan()
    except CacheNotFound:
        return SimpleNamespace(repos=frozenset(), size_on_disk=0, warnings=[])


def served_names(model: str | None) -> set[str]:
    """The names of the served model: as given and, for a folder, its real path."""
    if not model:
        return set()
    names = {model}
    if os.path.isdir(model):
        names.add(os.path.realpath(model))
    return names


def unknown_model(requested: Any, served: str | None) -> str | None:
    """Why ``requested`` cannot be served (one sentence naming the served model), or None."""
    if not served or requested in (None, "", "default_model"):
        return None
    if not isinstance(requested, str):
        return f"model must be a string, got {type(requested).__name__}"
    if requested in served_names(served) or os.path.isdir(requested):
        return None
    if requested in {repo.repo_id for repo in scan_cache_dir().repos}:
        return None
    return (
        f"The model `{requested}` does not exist on this server: it serves `{served}` "
        "(a local folder or a model in the local Hugging Face cache may also be named)"
    )


def error_body(message: str) -> bytes:
    """The JSON of a 404 for an unknown model (OpenAI's error shape)."""
    error = {"message": message, "type": "invalid_request_error", "code": "model_not_found"}
    return json.dumps({"error": error}).encode()


def requested_model(raw: bytes) -> Any:
    """The ``model`` of a JSON request body (None if the body is not a JSON object)."""
    try:
        body = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError):
        return None
    return body.get("model") if isinstance(body, dict) else None


Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class ModelCheck:
    """ASGI middleware: a generation request naming an unknown model gets a 404 before the
    app sees it (the app reads the same body, replayed)."""

    def __init__(self, app: Any, served: str | None, paths: Iterable[str] = GENERATION_PATHS):
        self.app, self.served, self.paths = app, served, frozenset(paths)

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False) and message["type"] == "http.request"
        raw = b"".join(chunks)
        problem = unknown_model(requested_model(raw), self.served)
        if problem is not None:
            await send_json(send, 404, error_body(problem))
            return
        await self.app(scope, replaying(raw, receive), send)


def http_handler(base: Any, served: str | None) -> type:
    """An ``http.server`` handler class (mlx-lm's) that answers an unknown model with a 404."""

    class ModelCheckedHandler(base):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self.path in GENERATION_PATHS:
                try:
                    length = int(self.headers.get("Content-Length") or "")
                except ValueError:  # the base answers it (411, 400)
                    return super().do_POST()
                reader: Any = vars(self)["rfile"]  # set by StreamRequestHandler.setup()
                raw: bytes = reader.read(length)
                reader = io.BufferedReader(io.BytesIO(raw))  # the base reads the body again
                self.rfile = reader
                problem = unknown_model(requested_model(raw), served)
                if problem is not None:
                    body = error_body(problem)
                    self.send_response(404)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return None
            return super().do_POST()

    return ModelCheckedHandler
