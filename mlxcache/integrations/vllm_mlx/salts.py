"""A request's ``cache_salt`` (body) or ``X-Cache-Salt`` (header) in vllm-mlx's server.

vllm-mlx 0.6 has no per-request salt. ``mlxcache serve`` adds one on every path that caches
(``install()`` here, ``engine_salts.install()`` and ``mllm_salts.install()``):

- an ASGI middleware reads the salt of every chat completions, completions, Anthropic Messages
  and Responses request (``request_salt``; a bad one is answered 400) into a context variable
  (``current()``);
- text with ``--continuous-batching``: ``vllm_mlx.engine_core.Request`` is a subclass that
  keeps it (it is built in the request's task), and ``Scheduler.add_request`` makes it the
  salt of that request's lookup (``admit``);
- the batched MLLM path (``--mllm --continuous-batching``): ``mllm_salts.py`` carries it to
  the vision cache and to the text-only requests' prefix-cache lookups the same way;
- the default mode (``SimpleEngine``, text and images): ``engine_salts.py`` runs the engine's
  generation steps in the request's context, where ``simple_text.py`` and ``simple_vlm.py``
  key their caches by it, and salts vllm-mlx's own system-prompt KV snapshots;
- the prefix cache keys a salted request's entries behind a 128-bit sentinel of negative
  "tokens" (no real token is negative), so salted and unsalted entries never match in its
  in-process LRU, and the shared tier gives each salt its own ``PrefixCache`` (see
  ``shared_tier.py``). A store takes the salt of the unfinished request whose prompt it shares
  the longest prefix with; when prompts of several salts tie (the same prompt, or a prefix
  they all share), it is not stored: a miss later, never another salt's block.

No salt keeps every key as it was. ``uninstall()`` puts back every name the three replaced.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import importlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from mlxcache.integrations.asgi import replaying, send_json
from mlxcache.integrations.request_salt import HEADER, SaltError, request_salt

PATHS = (  # the routes that generate (vllm-mlx 0.6 serves the bare ones too, but not all)
    "/v1/chat/completions", "/v1/completions", "/chat/completions", "/completions",
    "/v1/messages", "/v1/responses",
)  # fmt: skip
SENTINEL = 4  # negative 32-bit words in front of a salted key
_REQUEST: contextvars.ContextVar[str] = contextvars.ContextVar("mlxcache_salt", default="")
_ADMITTING = threading.local()  # the salt of the request the scheduler admits on this thread
_IN_FLIGHT: OrderedDict[str, tuple[str, tuple[int, ...]]] = OrderedDict()  # id: salt, prompt
_MAX_IN_FLIGHT = 4096
_BY_SENTINEL: OrderedDict[tuple[int, ...], str] = OrderedDict()
_LOCK = threading.Lock()
_undo: list[tuple[Any, str, Any]] = []


def sentinel(salt: str) -> tuple[int, ...]:
    """The negative words that key ``salt``'s entries in vllm-mlx's in-process LRU."""
    digest = hashlib.sha256(salt.encode()).digest()
    words = tuple(-1 - int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4))
    with _LOCK:
        _BY_SENTINEL[words] = salt
        _BY_SENTINEL.move_to_end(words)
        while len(_BY_SENTINEL) > 4096:
            _BY_SENTINEL.popitem(last=False)
    return words


def current() -> str:
    """The salt of the request this code serves ("" for none)."""
    return _REQUEST.get()


@contextlib.contextmanager
def serving(salt: str) -> Iterator[None]:
    """Run a block as serving a request of ``salt`` (where the request's task is not)."""
    token = _REQUEST.set(salt)
    try:
        yield
    finally:
        _REQUEST.reset(token)


def admit(salt: str, request_id: str | None) -> None:
    """The request whose prefix-cache lookup the engine makes next on this thread."""
    _ADMITTING.salt, _ADMITTING.request_id = salt, request_id


def admitting() -> str:
    """The salt of the lookup the scheduler is making on this thread ("" for none)."""
    return getattr(_ADMITTING, "salt", "")


def remember(tokens: Sequence[int]) -> None:
    """The prompt of the request being admitted, until it finishes: the stores of its prefixes
    and extensions take its salt."""
    request_id = getattr(_ADMITTING, "request_id", None)
    if request_id is None:
        return
    with _LOCK:
        _IN_FLIGHT[request_id] = (admitting(), tuple(tokens))
        while len(_IN_FLIGHT) > _MAX_IN_FLIGHT:
            _IN_FLIGHT.popitem(last=False)


def retire(request_ids: Any) -> None:
    """Requests that finished (their stores are done)."""
    with _LOCK:
        for request_id in request_ids:
            _IN_FLIGHT.pop(request_id, None)


def keyed(tokens: Sequence[int]) -> bool:
    """Whether ``tokens`` begin with a salt's sentinel."""
    return len(tokens) >= SENTINEL and all(t < 0 for t in tokens[:SENTINEL])


def key_salt(tokens: Sequence[int]) -> str:
    """The salt of an entry keyed with a sentinel ("" for a plain key, or a sentinel no longer
    remembered: see ``keyed``)."""
    if keyed(tokens):
        with _LOCK:
            return _BY_SENTINEL.get(tuple(tokens[:SENTINEL]), "")
    return ""


def salts_of(tokens: Sequence[int]) -> set[str]:
    """The salts an entry to store may belong to: its sentinel's, else those of the prompts in
    flight that share the longest prefix with it (one salt, or several: ambiguous)."""
    if keyed(tokens):
        return {key_salt(tokens)}
    key = tuple(tokens)
    best, found = 0, set[str]()
    with _LOCK:
        for salt, prompt in _IN_FLIGHT.values():
            n = min(len(prompt), len(key))
            if n < best or not n or prompt[:n] != key[:n]:
                continue
            if n > best:
                best, found = n, set[str]()
            found.add(salt)
    return found or {""}


def salted(tokens: Sequence[int], salt: str) -> list[int]:
    """``tokens`` keyed for ``salt`` (unchanged without one or when already keyed)."""
    key = list(tokens)
    if not salt or keyed(key):
        return key
    return [*sentinel(salt), *key]


def unsalted(tokens: Sequence[int]) -> list[int]:
    """``tokens`` without a salt's sentinel."""
    key = list(tokens)
    return key[SENTINEL:] if keyed(key) else key


class SaltMiddleware:
    """Reads the salt of each request that generates (``PATHS``) into its context (ASGI)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        if scope.get("path") not in PATHS:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        header = headers.get(HEADER.lower())
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None  # vllm-mlx answers invalid JSON
        try:
            salt = request_salt(body, header.decode() if header is not None else None)
        except SaltError as exc:
            return await send_json(send, 400, json.dumps({"error": str(exc)}).encode())
        with serving(salt):
            await self.app(scope, replaying(raw, receive), send)


def patch(obj: Any, name: str, value: Any) -> None:
    """Replace ``obj.name`` until ``uninstall()``."""
    _undo.append((obj, name, getattr(obj, name)))
    setattr(obj, name, value)


def install(app: Any) -> None:
    """Add the middleware to vllm-mlx's ``app`` and carry each request's salt to the text
    scheduler's lookups (``engine_salts`` and ``mllm_salts`` carry it on the other paths)."""
    engine_core = importlib.import_module("vllm_mlx.engine_core")
    scheduler = importlib.import_module("vllm_mlx.scheduler")
    base = engine_core.Request

    class SaltedRequest(base):  # type: ignore[misc, valid-type]
        """vllm-mlx's ``Request``, built in the HTTP request's task: it keeps that salt."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.mlxcache_salt = _REQUEST.get()

    cls = scheduler.Scheduler
    add_request, cleanup, remove = (
        cls.add_request,
        cls._cleanup_finished,
        cls.remove_finished_request,
    )

    def add_salted_request(self: Any, request: Any) -> None:
        admit(getattr(request, "mlxcache_salt", ""), request.request_id)
        try:
            add_request(self, request)
        finally:
            admit("", None)

    def cleanup_finished(self: Any, finished_ids: Any) -> Any:
        try:
            return cleanup(self, finished_ids)  # stores their caches
        finally:
            retire(list(finished_ids))

    def remove_finished_request(self: Any, request_id: str) -> Any:
        retire([request_id])
        return remove(self, request_id)

    patch(engine_core, "Request", SaltedRequest)
    patch(cls, "add_request", add_salted_request)
    patch(cls, "_cleanup_finished", cleanup_finished)
    patch(cls, "remove_finished_request", remove_finished_request)
    app.add_middleware(SaltMiddleware)


def uninstall() -> None:
    """Put back what ``install`` replaced (the middleware stays on the app)."""
    while _undo:
        obj, name, value = _undo.pop()
        setattr(obj, name, value)
