"""ASGI plumbing the servers' request middlewares share: a JSON answer, a body read twice.

A middleware that must read a request's body before the app (its ``model``, its
``cache_salt``) answers errors with ``send_json`` and hands the app ``replaying(raw, receive)``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Receive = Callable[[], Awaitable[Any]]


async def send_json(send: Callable[[dict], Awaitable[Any]], status: int, body: bytes) -> None:
    """Answer a request with ``status`` and the JSON ``body``."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def replaying(raw: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the app the already-read body ``raw`` once, then ``receive``'s."""
    sent = False

    async def replay() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replay
