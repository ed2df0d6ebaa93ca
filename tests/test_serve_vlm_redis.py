"""``mlxcache serve --engine mlx-vlm`` on one real redis-server: (d) two servers share, (e) a dead
Redis still answers, correctly and uncached."""

from __future__ import annotations

import pytest
from redis_server import RedisServer
from vlm_server import VlmServer

from mlxcache.tiny_models import build_tiny_vlm

BLOCK = ("--cache-block-size", "16")


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    return str(build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny"))


def test_two_servers_on_redis_then_redis_dies(tiny_vlm, tmp_path):
    redis = RedisServer()
    servers: list[VlmServer] = []
    try:
        for name in ("one", "two"):
            servers.append(VlmServer(tiny_vlm, redis.url, tmp_path / f"{name}.log", *BLOCK))
        one, two = servers
        cold, n, cached = one.chat(["A"])
        assert cached == 0 and n > 20
        # (d) the other server, on the same redis-server, reuses it
        assert two.chat(["A"]) == (cold, n, n - 1)
        ab_text, m, cached = two.chat(["A", "B"])
        assert cached == 0 and m > n
        assert one.chat(["A", "B"]) == (ab_text, m, m - 1)
        # (e) Redis dies: both answer the same text, uncached (a prefix in the process's hot
        # tier may still serve), and say so in their log
        redis.stop()
        c_text, _, cached = one.chat(["C"])
        assert cached == 0 and c_text
        assert two.chat(["C"]) == (c_text, n, 0)
        again, n2, _ = one.chat(["A"])
        assert (again, n2) == (cold, n)
        assert "redis" in one.log().lower()
    finally:
        for s in servers:
            s.kill()
        redis.close()
