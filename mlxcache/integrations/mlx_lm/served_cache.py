"""The prompt cache of ``mlxcache serve`` (mlx-lm): a request's own salt, one line per lookup.

mlx-lm's generation thread tokenizes a request and at once looks its prompt up; it ends a
response and at once inserts its cache. ``use_salt`` (called as the request is tokenized) and
``salt_next_insert`` (as its end is queued) put the request's ``cache_salt`` on exactly those
calls: its keys, hot and shared, are its own. A prompt segment inserted mid-batch, or a chunk
stored mid-prefill, takes the salt of the salted prompt in flight that it begins.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from mlxcache.integrations.mlx_lm.prompt_cache import Salted, SharedPromptCache

log = logging.getLogger("mlxcache")

_IN_FLIGHT = 256  # salted prompts remembered until their final insert
_UNBOUNDED = 1 << 62


class ServedPromptCache(SharedPromptCache):
    """``SharedPromptCache`` with per-request salts and a log line after each lookup."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fetch_salt = ""
        self._insert_salt: str | None = None
        self._in_flight: deque[tuple[str, list[int]]] = deque(maxlen=_IN_FLIGHT)

    def use_salt(self, salt: str) -> None:
        """The salt of the next lookup (the request being tokenized)."""
        self._fetch_salt = salt

    def salt_next_insert(self, salt: str) -> None:
        """The salt of the next insert (the request whose end was just queued)."""
        self._insert_salt = salt

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        salt, self._fetch_salt = self._fetch_salt, ""
        if salt:
            self._in_flight.append((salt, list(tokens)))
        with self._lock:
            before = dict(self._counts)
        cache, rest = super().fetch_nearest_cache(Salted(model, salt) if salt else model, tokens)
        self._log_lookup(before, len(tokens) - len(rest), len(tokens))
        return cache, rest

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list[Any], **kw: Any):
        salt, self._insert_salt = self._insert_salt, None
        if salt is None:  # a segment of a prompt in flight
            salt = self._in_flight_salt(tokens)
        elif salt:  # the request's last insert: forget its prompt
            for entry in reversed(self._in_flight):
                if entry[0] == salt and tokens[: len(entry[1])] == entry[1]:
                    self._in_flight.remove(entry)
                    break
        key = Salted(model, salt) if salt else model
        return super().insert_cache(key, tokens, prompt_cache, **kw)

    def store_prefill(self, model: Any, tokens: list[int], prompt_cache: list[Any]) -> None:
        salt = self._in_flight_salt(tokens)  # a chunk of a prompt in flight
        super().store_prefill(Salted(model, salt) if salt else model, tokens, prompt_cache)

    def _in_flight_salt(self, tokens: list[int]) -> str:
        """The salt of the latest salted prompt in flight that ``tokens`` begins ("" if none)."""
        return next((s for s, p in reversed(self._in_flight) if p[: len(tokens)] == tokens
                     and len(tokens) <= len(p)), "")  # fmt: skip

    def _log_lookup(self, before: dict[str, int], reused: int, total: int) -> None:
        with self._lock:
            now = dict(self._counts)
        if now["backend_hits"] > before["backend_hits"]:
            what = "a shared-tier hit"
        elif now["hot_hits"] > before["hot_hits"]:
            what = "a hot hit"
        else:
            what = "a miss"
        budget = "unbounded" if self.max_bytes >= _UNBOUNDED else f"{self.max_bytes} bytes"
        log.info(
            "mlxcache prompt cache: this request %s (%d of %d tokens reused); hot tier %d "
            "entries, %d bytes (max %s); so far: hot hits %d, shared-tier hits %d, misses %d, "
            "stored %d tokens, errors %d",
            what, reused, total, len(self), self.nbytes, budget, now["hot_hits"],
            now["backend_hits"], now["misses"], now["tokens_stored"],
            now["store_errors"] + now["lookup_errors"],
        )  # fmt: skip
