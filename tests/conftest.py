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


@pytest.fixture(params=["memory", "file", "redis"])
def uri(request, tmp_path):
    """A store URI: each test that takes ``uri`` runs on memory://, file:// and redis://."""
    if request.param == "memory":
        return "memory://"
    if request.param == "file":
        return f"file://{tmp_path}/cache"
    return request.getfixturevalue("redis_url")


# ---------------------------------------------------------------- fuzzing (hypothesis)


def pytest_addoption(parser):
    parser.addoption(
        "--fuzz-long",
        action="store_true",
        help="run the hypothesis fuzz tests with 50x more examples, randomized (minutes)",
    )


def pytest_configure(config):
    from hypothesis import HealthCheck, settings

    quiet = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]
    # the normal suite: a few seconds, the same examples every run (no flaky CI)
    settings.register_profile(
        "fuzz", max_examples=40, deadline=None, derandomize=True, suppress_health_check=quiet
    )
    settings.register_profile(
        "fuzz-long", max_examples=2000, deadline=None, suppress_health_check=quiet
    )
    settings.load_profile("fuzz-long" if config.getoption("--fuzz-long") else "fuzz")


# ---------------------------------------------------------------- Redis Cluster and Sentinel


@pytest.fixture(scope="session")
def redis_cluster_deployment():
    """A real local Redis Cluster (3 primaries + 3 replicas) for the whole session."""
    from redis_cluster import LocalCluster

    cluster = LocalCluster()
    yield cluster
    cluster.close()


@pytest.fixture
def redis_cluster(redis_cluster_deployment):
    """The session cluster, healed (killed nodes restarted) and emptied before each test."""
    redis_cluster_deployment.heal()
    redis_cluster_deployment.flushall()
    return redis_cluster_deployment


@pytest.fixture(scope="session")
def redis_sentinel_deployment():
    """A real primary + replica watched by 3 sentinels, for the whole session."""
    from redis_cluster import LocalSentinel

    sentinel = LocalSentinel()
    yield sentinel
    sentinel.close()


@pytest.fixture
def redis_sentinel(redis_sentinel_deployment):
    """The session sentinel setup, healed and emptied (FLUSHALL on the primary) per test."""
    redis_sentinel_deployment.heal()
    with redis_sentinel_deployment.current_primary().client() as c:
        c.flushall()
    return redis_sentinel_deployment
