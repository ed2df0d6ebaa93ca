"""redis+cluster:// and redis+sentinel:// against real local deployments (see redis_cluster.py):
one slot per record, budget and LRU across the cluster, batches per node, failovers."""

from __future__ import annotations

import collections
import random
import threading
import time

import pytest
import redis
from helpers import assert_same, bits, blob_record, run_py, sample_record
from redis.crc import key_slot

import mlxcache
from mlxcache.backends.redis.keys import KeyLayout

# ---------------------------------------------------------------- helpers


def node_keys(cluster) -> dict[int, list[bytes]]:
    """Every key on every primary, by primary port."""
    out = {}
    for n in cluster.primaries():
        with n.client() as c:
            out[n.port] = list(c.scan_iter(count=1000))
    return out


def wait_serving(backend, timeout: float = 30.0) -> float:
    """Poll until a put and a get on ``backend`` work again; returns the seconds it took."""
    t0 = time.monotonic()
    rec = blob_record(100, 99)
    i = 0
    while time.monotonic() - t0 < timeout:
        i += 1
        backend.put(f"probe-{i}", rec)
        got = backend.get(f"probe-{i}")
        if got is not None:
            assert_same(rec, got)
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"the cache did not serve again within {timeout}s")


class Workers:
    """Threads that put two versions of known records and read them back until stopped:
    every hit must be one whole version, bit for bit (chunked records included)."""

    def __init__(self, backend, records: dict[int, object], n: int = 3) -> None:
        self.backend, self.records = backend, records
        self.versions = {i: blob_record(r.arrays["x"].size, 1000 + i) for i, r in records.items()}
        self.expected = {i: bits(r.arrays["x"]) for i, r in records.items()}
        self.allowed = {i: {self.expected[i], bits(self.versions[i].arrays["x"])} for i in records}
        self.stop = threading.Event()
        self.seen: collections.Counter[str] = collections.Counter()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(t,)) for t in range(n)]
        for th in self.threads:
            th.start()

    def _run(self, t: int) -> None:
        rng = random.Random(t)
        try:
            while not self.stop.is_set():
                i = rng.randrange(len(self.records))
                if rng.random() < 0.3:
                    rec = self.records[i] if rng.random() < 0.5 else self.versions[i]
                    self.backend.put(f"k{i}", rec)
                    continue
                got = self.backend.get(f"k{i}")
                if got is None:
                    self.seen["miss"] += 1
                else:
                    assert bits(got.arrays["x"]) in self.allowed[i], f"wrong bits for k{i}"
                    self.seen["hit"] += 1
        except BaseException as exc:  # reported by finish()
            self.errors.append(exc)

    def finish(self) -> collections.Counter[str]:
        self.stop.set()
        for th in self.threads:
            th.join(30)
        assert not self.errors, self.errors
        return self.seen


# ---------------------------------------------------------------- cluster: layout


def test_cluster_round_trip_is_bit_exact_and_spreads_over_primaries(redis_cluster):
    with mlxcache.open_backend(redis_cluster.url, chunk_size=1024) as b:
        rec = sample_record()
        b.put("one", rec)
        assert_same(rec, b.get("one"))
        for i in range(60):
            b.put(f"k{i}", blob_record(50 if i % 5 else 3000, i))  # every 5th is chunked
        got = b.get_many([f"k{i}" for i in range(60)])
        for i, g in enumerate(got):
            assert_same(blob_record(50 if i % 5 else 3000, i), g)
        assert len(b) == 61 and sorted(b.keys("k")) == sorted(f"k{i}" for i in range(60))
        s = b.stats()
        assert s["backend"] == "redis+cluster" and s["entries"] == 61 and s["groups"] == 16
        assert s["errors"] == 0 and s["available"]
        nodes = s["nodes"]  # the spread over the primaries, for monitoring
        assert len(nodes) == 3 and sum(n["groups"] for n in nodes.values()) == 16
        assert sum(n["entries"] for n in nodes.values()) == 61
        assert sum(n["bytes"] for n in nodes.values()) == s["bytes"]
    per_node = node_keys(redis_cluster)
    assert sum(1 for keys in per_node.values() if keys) == 3  # all primaries hold records


def test_every_key_of_a_record_and_its_index_share_one_slot(redis_cluster):
    b = mlxcache.open_backend(redis_cluster.url, chunk_size=512)
    for i in range(20):
        b.put(f"r{i}", blob_record(2000, i))  # 4+ chunks each
    layout = KeyLayout("mlxcache:", 16)
    for keys in node_keys(redis_cluster).values():
        for k in keys:
            text = k.decode()
            g = layout.heads.index(text[: text.index("}") + 1])
            assert key_slot(k) == layout.slots[g]  # value, chunks, index: the group's slot
    # each value key's chunks are in the value's group (the manifest names them)
    r = redis.RedisCluster(host="127.0.0.1", port=redis_cluster.seeds[0].port)
    for i in range(20):
        g = layout.group(f"r{i}")
        manifest = r.get(layout.vkey(f"r{i}"))
        assert manifest.startswith(b"mlxcache-chunks:1\n")
        chunk_keys = [k for k in r.scan_iter(match=layout.heads[g] + "c:*")]
        assert chunk_keys and all(key_slot(k) == layout.slots[g] for k in chunk_keys)
    r.close()


def test_cluster_budget_and_lru_hold_across_the_cluster(redis_cluster):
    rec_size = len(mlxcache.records.format.to_bytes(blob_record(1000)))
    budget = 16 * 4 * rec_size  # room for 4 records per group
    b = mlxcache.open_backend(redis_cluster.url, max_bytes=budget)
    for i in range(200):
        b.put(f"k{i}", blob_record(1000, i))
        if i == 0:
            b.get("k0")
    s = b.stats()
    assert s["bytes"] <= budget and s["entries"] == s["bytes"] // rec_size
    assert s["entries"] <= 64 and s["evictions"] == 200 - s["entries"]
    # LRU inside each group: the newest key of every group survives, so at least 16 do
    layout = KeyLayout("mlxcache:", 16)
    newest = {}
    for i in range(200):
        newest[layout.group(f"k{i}")] = f"k{i}"
    assert all(b.contains_many(sorted(newest.values())))
    # a second client with the same prefix sees the same totals
    other = mlxcache.open_backend(redis_cluster.url, max_bytes=budget)
    assert other.stats()["bytes"] == s["bytes"]
    # a record over one group's share of the budget is refused (and evicts nothing)
    other.put("huge", blob_record(budget // 16 + 1))
    assert "huge" not in other and other.stats()["entries"] == s["entries"]
    # trim (what `mlxcache gc` does) evicts down to a smaller budget on every node
    assert b.trim(budget // 2) > 0
    assert b.stats()["bytes"] <= budget // 2


def test_cluster_batches_are_one_pipeline_per_node(redis_cluster, monkeypatch):
    b = mlxcache.open_backend(redis_cluster.url)
    keys = [f"k{i}" for i in range(40)]
    for i, k in enumerate(keys):
        b.put(k, blob_record(30, i))
    b.get("k0")  # connections and the slot map are ready
    calls = collections.Counter()
    real_execute = redis.client.Pipeline.execute
    direct = redis.Redis.execute_command

    def counted_execute(self, *a, **kw):
        calls[(self.connection_pool.connection_kwargs["port"], "pipeline")] += 1
        return real_execute(self, *a, **kw)

    def counted_direct(self, *a, **kw):
        calls["direct"] += 1
        return direct(self, *a, **kw)

    monkeypatch.setattr(redis.client.Pipeline, "execute", counted_execute)
    monkeypatch.setattr(redis.Redis, "execute_command", counted_direct)
    got = b.get_many(keys + ["missing"])
    assert [g is not None for g in got] == [True] * 40 + [False]
    assert calls["direct"] == 0 and len(calls) == 3 and set(calls.values()) == {1}
    calls.clear()
    assert b.contains_many(keys + ["missing"]) == [True] * 40 + [False]
    assert calls["direct"] == 0 and len(calls) == 3 and set(calls.values()) == {1}


def test_cluster_keys_clear_and_delete(redis_cluster):
    b = mlxcache.open_backend(redis_cluster.url, chunk_size=1024)
    other = mlxcache.open_backend(redis_cluster.url, prefix="other:")
    other.put("x", blob_record(10))
    for i in range(30):
        b.put(f"a/{i}", blob_record(2000 if i % 3 == 0 else 10, i))
    b.put("b/0", blob_record(10))
    assert sorted(b.keys("a/")) == sorted(f"a/{i}" for i in range(30))
    assert b.delete("a/0") and not b.delete("a/0") and "a/0" not in b
    b.clear()
    assert list(b.keys()) == [] and len(b) == 0 and b.stats()["bytes"] == 0
    leftover = [k for keys in node_keys(redis_cluster).values() for k in keys]
    ours = [k for k in leftover if not k.startswith(b"other:")]
    assert [k.endswith(b"}f:counters") for k in ours] == [True]  # clear() keeps the counts
    assert other.get("x") is not None


# ---------------------------------------------------------------- cluster: failover


def test_primary_killed_mid_run_gives_misses_then_serves_again(redis_cluster):
    """Workers put and get while a primary is SIGKILLed: every read is bit-exact or a miss,
    nothing raises, and after the replica's promotion the cache serves every slot again."""
    # chunk_size 256: most records are 2-3 chunks, committed by one script in their slot
    b = mlxcache.open_backend(redis_cluster.url, timeout=1, max_backoff=0.5, chunk_size=256)
    records = {i: blob_record(200 + 10 * i, i) for i in range(40)}
    for i, rec in records.items():
        b.put(f"k{i}", rec)
    workers = Workers(b, records)
    time.sleep(0.3)
    redis_cluster.kill_primary(1)
    wait_serving(b)
    time.sleep(0.3)
    seen = workers.finish()
    assert seen["hit"] > 0 and seen["miss"] > 0  # the outage was seen, and served around
    assert b.stats()["errors"] > 0
    # every slot answers again: all 40 keys (on every primary) are written and read back
    deadline = time.monotonic() + 30
    while True:
        for i, rec in records.items():
            b.put(f"k{i}", rec)
        got = b.get_many([f"k{i}" for i in range(40)])
        if all(g is not None for g in got) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert all(
        g is not None and bits(g.arrays["x"]) == workers.expected[i] for i, g in enumerate(got)
    )


# ---------------------------------------------------------------- cluster: PrefixCache


def test_prefix_cache_shared_by_two_processes_over_the_cluster(redis_cluster):
    code = """
        import hashlib
        import sys

        import mlx.core as mx
        import numpy as np
        from mlx_vlm.models.cache import make_prompt_cache
        from mlxcache import PrefixCache
        from mlxcache.tiny_models import build_model
        url, mode = sys.argv[1], sys.argv[2]

        def digest(cache):
            h = hashlib.sha256()
            for c in cache:
                for a in c.state:
                    h.update(bytes(memoryview(mx.contiguous(a))))
            return h.hexdigest()

        lm = build_model("qwen2_vl")[0].language_model
        ids = np.random.default_rng(7).integers(1, 900, 70).tolist()
        pc = PrefixCache(url, model="qwen", block_size=16)
        if mode == "store":
            cache = make_prompt_cache(lm)
            mx.eval(lm(mx.array([ids]), cache=cache).logits)
            print(pc.store(ids, cache))
            print(digest(cache))
        else:
            hit = pc.lookup(ids + [5, 6, 7])
            print(hit.num_tokens if hit else 0)
            print(digest(hit.prompt_cache))
    """
    stored = run_py(code, redis_cluster.url, "store", timeout=120).split()
    found = run_py(code, redis_cluster.url, "lookup", timeout=120).split()
    assert stored[0] == "70" and found[0] == "70"
    assert found[1] == stored[1]  # the other process's blocks, bit for bit
    keys = list(mlxcache.open_backend(redis_cluster.url).keys())
    layout = KeyLayout("mlxcache:", 16)
    assert len({layout.group(k) for k in keys}) > 1  # the blocks live in several groups


# ---------------------------------------------------------------- sentinel


def test_sentinel_round_trip(redis_sentinel):
    with mlxcache.open_backend(redis_sentinel.url, chunk_size=1024) as b:
        rec = sample_record()
        b.put("k", rec)
        b.put("big", blob_record(5000))
        assert_same(rec, b.get("k"))
        assert_same(blob_record(5000), b.get("big"))
        s = b.stats()
        assert s["backend"] == "redis+sentinel" and s["entries"] == 2 and s["errors"] == 0
        assert "mymaster" in s["url"]


def test_sentinel_failover_mid_run_gives_misses_then_serves_again(redis_sentinel):
    b = mlxcache.open_backend(redis_sentinel.url, timeout=1, max_backoff=0.5, chunk_size=256)
    records = {i: blob_record(200 + 10 * i, i) for i in range(20)}
    for i, rec in records.items():
        b.put(f"k{i}", rec)
    workers = Workers(b, records)
    time.sleep(0.3)
    redis_sentinel.failover()
    wait_serving(b)
    time.sleep(0.3)
    seen = workers.finish()
    assert seen["hit"] > 0 and seen["miss"] > 0 and b.stats()["errors"] > 0


def test_sentinel_failover_is_followed(redis_sentinel):
    b = mlxcache.open_backend(redis_sentinel.url, timeout=1, max_backoff=0.5)
    rec = blob_record(500, 1)
    b.put("before", rec)
    with redis_sentinel.current_primary().client() as c:
        c.execute_command("WAIT", 1, 5000)  # replicated before the crash
    old = redis_sentinel.failover()
    during = b.get("before")  # the old primary is gone: a miss (or already the new one)
    assert during is None or bits(during.arrays["x"]) == bits(rec.arrays["x"])
    wait_serving(b)
    assert redis_sentinel.current_primary() is not old
    got = b.get("before")  # the promoted replica had it
    assert got is not None and bits(got.arrays["x"]) == bits(rec.arrays["x"])
    b.put("after", rec)
    assert b.get("after") is not None


# ---------------------------------------------------------------- URIs


@pytest.mark.parametrize(
    "uri, match",
    [
        ("redis+cluster://127.0.0.1:1,/", "host:port"),
        ("redis+cluster://127.0.0.1:99999/", "bad port"),
        ("redis+cluster://127.0.0.1:7000/3", "no path"),
        ("redis+cluster://127.0.0.1:7000/?groups=0", "groups"),
        ("redis+cluster://127.0.0.1:7000/?groups=300", "groups"),
        ("redis+cluster://127.0.0.1:7000/?db=1", "unknown option"),
        ("redis+cluster://127.0.0.1:7000/?ssl_ca_certs=/x", "rediss"),
        ("redis+cluster://127.0.0.1:7000/?prefix=a{b}", "hash tags"),
        ("redis+sentinel://127.0.0.1:26379/", "service_name"),
        ("redis+sentinel://127.0.0.1:26379/svc/x", "service_name"),
        ("redis+sentinel://127.0.0.1:26379/svc/0?bogus=1", "unknown option"),
    ],
)
def test_bad_cluster_and_sentinel_uris_name_the_problem(uri, match):
    with pytest.raises(ValueError, match=match):
        mlxcache.open_backend(uri)


def test_unreachable_cluster_is_misses_not_exceptions():
    from redis_server import free_port

    b = mlxcache.open_backend(f"redis+cluster://127.0.0.1:{free_port()}/", timeout=0.5)
    b.put("k", blob_record(10))
    assert b.get("k") is None and "k" not in b and len(b) == 0 and list(b.keys()) == []
    s = b.stats()
    assert s["errors"] >= 1 and not s["available"] and "unreachable" in b.last_error


def test_cluster_uri_options_reach_the_backend():
    b = mlxcache.open_backend(
        "redis+cluster://user:secret@127.0.0.1:7000,[::1]:7001/?groups=4&max_bytes=1MiB&ttl=5"
    )
    assert b.groups == 4 and b.max_bytes == 2**20 and b.ttl == 5
    assert b.router.seeds == [("127.0.0.1", 7000), ("::1", 7001)]
    assert "secret" not in b.url and b.url.startswith("redis+cluster://user@127.0.0.1:7000,")
    assert b.router.kwargs["password"] == "secret"
    tls = mlxcache.open_backend("rediss+cluster://127.0.0.1:7000/?ssl_cert_reqs=none")
    assert tls.router.kwargs["connection_class"] is redis.SSLConnection


def test_the_command_line_works_on_a_cluster(redis_cluster, tmp_path, capsys):
    import json

    from mlxcache.cli import main

    src = f"file://{tmp_path}/src"
    with mlxcache.open_backend(src) as b:
        for i in range(10):
            b.put(f"k/{i}", blob_record(100, i))
    assert main(["copy", src, redis_cluster.url]) == 0
    capsys.readouterr()
    assert main(["stats", redis_cluster.url, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["entries"] == 10 and stats["backend"] == "redis+cluster"
    assert main(["verify", redis_cluster.url]) == 0
    capsys.readouterr()
    assert main(["inspect", redis_cluster.url, "k/3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["meta"] == {"seed": 3}
    assert main(["gc", redis_cluster.url, "--max-bytes", "0"]) == 0
    assert len(mlxcache.open_backend(redis_cluster.url)) == 0
