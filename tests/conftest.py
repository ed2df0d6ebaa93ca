"""Shared pytest fixtures."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from redis_server import RedisServer  # noqa: E402

# ---------------------------------------------------------------- Redis


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server on a free loopback port (and a unix socket) for the whole session."""
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture
def redis_url(redis_server):
    """The session server's ``redis://127.0.0.1:PORT/0``, emptied (FLUSHALL) before each test."""
    redis_server.start()  # in case a test stopped it
    with redis_server.client() as c:
        c.flushall()
    return redis_server.url
