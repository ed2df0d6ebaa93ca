"""One deadline per call against a hung Redis (SIGSTOPped: it accepts connections, never answers).

Every operation of every Redis scheme (TLS included), and PrefixCache lookup and store,
returns (a miss, False, nothing) after one wait of the backend's ``timeout`` at most, never two,
whatever it does inside (pipelines, reconnects and their TCP and TLS handshakes, script
reloads, a cluster's slot-map refresh, the fleet counters): in less than twice ``timeout``,
the rest being slack for the call's own CPU time on a machine busy with other tests. The next
call while it stays hung is skipped at once (the backoff); once the server resumes, the record
stored before reads back whole. Only servers these tests start are stopped.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager

import pytest
from helpers import assert_same, full_kv, sample_record
from redis_server import RedisServer

import mlxcache
from mlxcache import PrefixCache
from mlxcache.backends.tiered import tiered_uri

TIMEOUT = 0.5
LIMIT = 2 * TIMEOUT  # one wait, never two; the rest is slack for a busy machine's CPU time
GOOD = sample_record()


@contextmanager
def hung(procs):
    """SIGSTOP the given server processes for the block, SIGCONT them after."""
    for p in procs:
        os.kill(p.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)


def redis_backends(b):
    """The Redis backends a backend calls (itself, or a tiered backend's L2)."""
    return [x for x in (b, getattr(b, "l2", None)) if hasattr(x, "timeout")]


def let_through(b) -> None:
    """End the backoff, so the next call really waits on the hung server."""
    for r in redis_backends(b):
        r.breaker.down_until = 0.0


def timed(fn):
    start = time.monotonic()
    out = fn()
    return out, time.monotonic() - start


OPERATIONS = {
    "get": lambda b: b.get("k"),
    "get_many": lambda b: b.get_many(["k", "other"]),
    "put": lambda b: b.put("new", GOOD),
    "put_many": lambda b: b.put_many([("n1", GOOD), ("n2", GOOD)]),
    "contains": lambda b: "k" in b,
    "contains_many": lambda b: b.contains_many(["k", "other"]),
    "header": lambda b: b.header("k"),
    "delete": lambda b: b.delete("gone"),
    "touch_many": lambda b: b.touch_many(["k"]),
    "keys": lambda b: list(b.keys()),
    "len": lambda b: len(b),
    "stats": lambda b: b.stats(),
    "trim": lambda b: b.trim(1 << 40),
    "pin": lambda b: b.pin("k") if b.pinnable else None,
    "flush_counters": lambda b: b.flush_counters(),
}


def check_hung_calls(b, procs, resume=lambda: None) -> None:
    """Each operation and a PrefixCache lookup/store against the stopped ``procs``."""
    tokens = list(range(40))
    pc = PrefixCache(b, model="deadline-test", block_size=16, hot_bytes=0)
    b.put("k", GOOD)
    assert_same(b.get("k"), GOOD)
    assert pc.store(tokens, full_kv(40)) == 40
    assert pc.lookup(tokens).num_tokens == 40
    for r in redis_backends(b):  # fleet counters due at every call: none may wait a second time
        if r._fleet is not None:
            r._fleet.interval = 0.0
    slow = {}
    with hung(procs):
        for name, op in OPERATIONS.items():
            let_through(b)
            _, took = timed(lambda op=op: op(b))
            slow[name] = took
            _, again = timed(lambda op=op: op(b))  # still hung: skipped at once
            assert again < TIMEOUT / 2, (name, again)
        let_through(b)
        hit, slow["lookup"] = timed(lambda: pc.lookup(tokens))
        assert hit is None or hit.num_tokens in (0, 40)  # tiered: L1 still answers
        let_through(b)
        _, slow["store"] = timed(lambda: pc.store(list(range(100, 140)), full_kv(40)))
    over = {name: round(t, 3) for name, t in slow.items() if t >= LIMIT}
    assert not over, (over, slow)
    resume()
    deadline = time.monotonic() + 30  # the backoff ends, the server answers again
    while b.get("k") is None:
        assert time.monotonic() < deadline, b.last_error
        time.sleep(0.1)
    assert_same(b.get("k"), GOOD)
    assert pc.lookup(tokens).num_tokens == 40
    pc.close()


@pytest.fixture
def own_server():
    server = RedisServer()
    yield server
    server.close()


def test_a_hung_server_costs_one_timeout_per_call(own_server):
    with mlxcache.open_backend(f"{own_server.url}?timeout={TIMEOUT}") as b:
        check_hung_calls(b, [own_server.proc])


def test_a_hung_tls_server(monkeypatch):
    """rediss://: the TLS handshake of a reconnect and every read wait inside the deadline."""
    from tls_redis import TLSRedis

    monkeypatch.setenv("MLXCACHE_SECRET", "tls-deadline-secret-0123456789")  # signed, too
    server = TLSRedis()
    try:
        with mlxcache.open_backend(server.uri(timeout=TIMEOUT)) as b:
            check_hung_calls(b, [server.proc])
    finally:
        server.close()


def test_tiered_over_a_hung_server(own_server):
    uri = tiered_uri("memory://", f"{own_server.url}?timeout={TIMEOUT}")
    with mlxcache.open_backend(uri) as b:
        check_hung_calls(b, [own_server.proc])


def test_a_hung_cluster(redis_cluster):
    procs = [n.proc for n in redis_cluster.nodes]
    with mlxcache.open_backend(f"{redis_cluster.url}?timeout={TIMEOUT}") as b:
        check_hung_calls(b, procs, resume=redis_cluster.wait_healthy)


def test_a_hung_sentinel_primary(redis_sentinel):
    """Both servers hang while the sentinels answer; the sentinels start no failover (that is
    test_redis_cluster's subject), so the clients' deadlines are all that is tested."""
    procs = [redis_sentinel.primary.proc, redis_sentinel.replica.proc]
    url = f"{redis_sentinel.url}?timeout={TIMEOUT}"
    with redis_sentinel.no_failover(), mlxcache.open_backend(url) as b:
        check_hung_calls(b, procs, resume=redis_sentinel.wait_healthy)
