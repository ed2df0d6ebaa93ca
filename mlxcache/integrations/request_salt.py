"""A request's own cache salt, as vLLM's ``cache_salt``: one user's prompts never meet another's.

Every engine server reads it the same way: the ``cache_salt`` field of a chat or completions
request body, or the ``X-Cache-Salt`` header for clients that cannot add body fields. It joins
the server's ``--cache-salt`` in every key the request reads or writes, so two salts never share
a block (nor reveal by timing that another user sent a prompt) and the same salt does.
"""

from __future__ import annotations

from typing import Any

FIELD = "cache_salt"
HEADER = "X-Cache-Salt"
MAX_CHARS = 1024


class SaltError(ValueError):
    """A salt the request cannot have (answered 400, nothing read or stored)."""


def request_salt(body: Any, header: str | None) -> str:
    """The salt of one request: the body's ``cache_salt``, else the header, else ""."""
    value = body.get(FIELD) if isinstance(body, dict) else None
    if value is not None and not isinstance(value, str):
        raise SaltError(f"{FIELD} must be a string, got {type(value).__name__}")
    if value is not None and header is not None and value != header:
        raise SaltError(f"the {FIELD} field and the {HEADER} header differ: send one of them")
    salt = value if value is not None else (header or "")
    if len(salt) > MAX_CHARS:
        raise SaltError(f"{FIELD} is longer than {MAX_CHARS} characters")
    return salt


def join_salt(server: str, request: str) -> str:
    """The server's salt with a request's: no request salt leaves the server's keys as they were.

    Distinct (server, request) pairs give distinct results, as long as server salts (set by the
    operator) do not contain the separator character.
    """
    if not request:
        return server
    return f"{server}\x1frequest:{len(request)}:{request}"
