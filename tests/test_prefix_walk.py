"""One round trip per PrefixCache lookup on Redis (the ``walk_chain`` capability), on a real
redis-server: round trips counted at redis-py's connection, and the same hits as the default
``contains_many`` + ``get_many`` path on the same store (stale, evicted, forged entries too).
The in-process hot tier is off (``hot_bytes=0``): these tests are about the backend path."""

from __future__ import annotations

import contextlib
import logging

import mlx.core as mx
import numpy as np
import pytest
from helpers import bits
from mlx_vlm.models.cache import make_prompt_cache

from mlxcache import PrefixCache
from mlxcache.backends.base import ChainWalk, walks_chains
from mlxcache.backends.memory import MemoryBackend
from mlxcache.backends.redis import RedisBackend
from mlxcache.tiny_models import build_model

BS = 16


class DefaultPath(RedisBackend):
    """The same real Redis backend with the capability off: lookups take the default path."""

    def walk_chain(self, walk):
        return None


@pytest.fixture(scope="module")
def qwen():
    return build_model("qwen2_vl")[0]


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(1, 900, n).tolist()


def prefill(model, ids):
    lm = model.language_model
    lm._rope_deltas, lm._position_ids = None, None
    cache = make_prompt_cache(lm)
    mx.eval(lm(mx.array([list(ids)]), cache=cache).logits)
    return cache


@pytest.fixture(scope="module")
def turn1(qwen):
    ids = prompt(40)  # 2 whole blocks and 8 tokens: a stored partial block
    return ids, prefill(qwen, ids)


@contextlib.contextmanager
def round_trips():
    """Count redis-py ``send_packed_command`` calls (one per command or pipeline sent)."""
    import redis.connection as rc

    counter = [0]
    original = rc.AbstractConnection.send_packed_command

    def counting(self, *args, **kwargs):
        counter[0] += 1
        return original(self, *args, **kwargs)

    rc.AbstractConnection.send_packed_command = counting
    try:
        yield counter
    finally:
        rc.AbstractConnection.send_packed_command = original


def trips(pc, ids, **kw):
    """Round trips of one lookup; the fleet counters (sent at most once a second by any call,
    no part of a lookup) are flushed first so they cannot fall inside."""
    pc.backend.flush_counters()
    with round_trips() as n:
        hit = pc.lookup(ids, **kw)
    return n[0], hit


def same_hit(a, b):
    """Both None, or the same length, extras and bits of every array of the cache."""
    assert (a is None) == (b is None), (a, b)
    if a is None:
        return
    assert a.num_tokens == b.num_tokens
    assert (a.prompt_cache is None) == (b.prompt_cache is None)
    for x, y in zip(a.prompt_cache or [], b.prompt_cache or [], strict=True):
        assert type(x) is type(y)
        for u, v in zip(x.state, y.state, strict=True):
            assert bits(u) == bits(v)
    assert sorted(a.extras) == sorted(b.extras)
    for k in a.extras:
        assert bits(a.extras[k]) == bits(b.extras[k])
    assert (a.vision_embeddings is None) == (b.vision_embeddings is None)


@pytest.fixture
def pair(redis_url):
    """A walking and a default-path PrefixCache on the same store."""
    walk = RedisBackend(redis_url)
    default = DefaultPath(redis_url)
    yield (
        PrefixCache(walk, model="q", block_size=BS, hot_bytes=0),
        PrefixCache(default, model="q", block_size=BS, hot_bytes=0),
    )
    walk.clear()
    walk.close()
    default.close()


# ---------------------------------------------------------------- round trips


def test_every_lookup_is_one_round_trip(pair, turn1):
    ids, cache = turn1
    pc, base = pair
    pc.store(ids, cache)
    pc.lookup(ids)  # loads the scripts once (a fresh server has none), opens a connection
    base.lookup(ids)
    cases = {  # request, tokens hit, round trips of the default path
        "full hit": (ids, 40, 2),
        "partial hit inside the last block": (ids + prompt(4, seed=1), 40, 2),
        "turn 2 extends turn 1": (ids + prompt(100, seed=2), 40, 3),
        "shorter than the stored partial": (ids[:36], 32, 2),
        "miss": (prompt(70, seed=3), None, 2),
        "miss inside the first block": (prompt(5, seed=4), None, 1),
    }
    for name, (request, want, default_trips) in cases.items():
        n, hit = trips(pc, request)
        assert n == 1, name
        assert (hit and hit.num_tokens) == want, name
        n_default, hit_default = trips(base, request)
        same_hit(hit, hit_default)
        assert n_default == default_trips, name


def test_vision_entry_comes_in_the_same_round_trip(pair, turn1):
    ids, cache = turn1
    pc, base = pair
    emb = mx.arange(12, dtype=mx.float16).reshape(1, 3, 4)
    pc.store(ids, cache, images=[b"img"], vision_embeddings=emb)
    pc.lookup(ids, images=[b"img"])
    for request, want in ((ids, 40), (ids + prompt(30, seed=5), 40), (prompt(40, 6), 0)):
        n, hit = trips(pc, request, images=[b"img"])
        assert n == 1
        assert hit.num_tokens == want
        assert bits(hit.vision_embeddings) == bits(emb)
        same_hit(hit, base.lookup(request, images=[b"img"]))
    assert trips(pc, ids, images=[b"other"])[1] is None


def test_hits_refresh_the_lru_like_get(redis_url, turn1):
    """A walk reads like get_many: what it read survives a budget that evicts the rest."""
    ids, cache = turn1
    backend = RedisBackend(redis_url)
    pc = PrefixCache(backend, model="q", block_size=BS, hot_bytes=0)
    pc.store(ids, cache)
    pc.store(prompt(40, seed=7), cache)  # another prompt, written later (more recent)
    assert pc.lookup(ids).num_tokens == 40  # now the first prompt is the recent one
    used = backend.stats()["bytes"]
    backend.trim(used // 2 + 1)
    assert pc.lookup(ids).num_tokens == 40
    assert pc.lookup(prompt(40, seed=7)) is None
    backend.clear()
    backend.close()


# ---------------------------------------------------------------- the same hits as the default


def sibling_index(pc, ids, k):
    """The Redis key of the sibling index of block ``k`` of ``ids``."""
    plan = pc._plan(np.asarray(ids, dtype=np.int64), [], None)
    return pc.backend.layout.heads[0] + "i:s:" + pc._key("s", plan.parent(k)), plan


def check_same(pc, base, requests):
    for request in requests:
        n, hit = trips(pc, request)
        same_hit(hit, base.lookup(request))


def test_stale_index_entries_fall_back_to_the_next_candidate(pair, qwen):
    pc, base = pair
    ids = prompt(44, seed=8)
    pc.store(ids, prefill(qwen, ids))  # partial of 12 tokens in block 2
    pc.store(ids[:36], prefill(qwen, ids[:36]))  # and of 4
    turn2 = ids + prompt(60, seed=9)
    assert pc.lookup(turn2).num_tokens == 44
    index, plan = sibling_index(pc, ids, 2)
    client, layout = pc.backend.client, pc.backend.layout
    assert client.hlen(index) == 2
    # the value of 12 vanishes behind our back (Redis' own maxmemory, a DEL): a stale entry
    assert client.delete(layout.vkey(pc._key("t", plan.partial(2, 12))))
    n, hit = trips(pc, turn2)
    assert (n, hit.num_tokens) == (1, 36)
    check_same(pc, base, [turn2, ids, ids[:40]])
    assert client.hlen(index) == 1  # the walk dropped the vanished key, and its entry
    assert pc.backend.delete(pc._key("t", plan.partial(2, 4)))  # a delete takes its entry
    assert client.hlen(index) == 0
    n, hit = trips(pc, turn2)
    assert (n, hit.num_tokens) == (1, 32)
    check_same(pc, base, [turn2])
    # a stale entry that stays stale: it names keys that were never stored
    client.hset(index, np.asarray(turn2[32:46], dtype=np.int64).tobytes(), b"gone-t\ngone-b")
    n, hit = trips(pc, turn2)
    assert (n, hit.num_tokens) == (1, 32)
    check_same(pc, base, [turn2])


def test_evicted_blocks_and_budget_evictions_give_the_same_hits(redis_url, qwen, turn1):
    ids, cache = turn1
    walk = RedisBackend(redis_url, max_bytes=10**9)
    pc = PrefixCache(walk, model="q", block_size=BS, hot_bytes=0)
    base = PrefixCache(DefaultPath(redis_url), model="q", block_size=BS, hot_bytes=0)
    pc.store(ids, cache)
    turn2 = ids + prompt(50, seed=10)
    pc.store(turn2, prefill(qwen, turn2))
    requests = [ids, turn2, turn2 + prompt(9, seed=11), ids + prompt(20, seed=12)]
    check_same(pc, base, requests)
    _, plan = sibling_index(pc, turn2, 2)
    assert walk.delete(pc._key("b", plan.full(4)[3]))  # a block in the middle of turn 2
    check_same(pc, base, requests)
    assert walk.delete(pc._key("b", plan.partial(2, 8)))  # the partial block, its tail kept
    check_same(pc, base, requests)
    walk.trim(walk.stats()["bytes"] // 3)  # LRU evictions by the store's own budget
    check_same(pc, base, requests)
    assert trips(pc, turn2)[0] == 1
    walk.clear()
    walk.close()
    base.backend.close()


def test_forged_index_entries_are_never_a_wrong_hit(pair, qwen, turn1, caplog):
    ids, cache = turn1
    pc, base = pair
    pc.store(ids, cache)
    other = ids[:32] + prompt(12, seed=13)  # another partial under the same parent
    pc.store(other, prefill(qwen, other))
    turn2 = ids + prompt(60, seed=14)
    index, plan = sibling_index(pc, ids, 2)
    client = pc.backend.client
    label = np.asarray(turn2[32:44], dtype=np.int64).tobytes()  # 12 tokens of turn 2's block 2
    theirs = sibling_index(pc, other, 2)[1].partial(2, 12)
    # a longer label naming another prompt's live keys: picked by the script, refused here
    client.hset(index, label, f"{pc._key('t', theirs)}\n{pc._key('b', theirs)}")
    with caplog.at_level(logging.WARNING, logger="mlxcache"):
        n, hit = trips(pc, turn2)
    assert "sibling index entry names other keys" in caplog.text
    assert hit.num_tokens == 40 and n > 1  # the default path's answer, one walk later
    check_same(pc, base, [turn2, ids, other])
    # garbage entries (no such keys, no separator, empty, a wrong length) are skipped
    for field, value in ((label[:16], b"nope"), (label[:24], b""), (label[:20], b"x\ny")):
        client.hset(index, field, value)
    client.hdel(index, label)
    n, hit = trips(pc, turn2)
    assert (n, hit.num_tokens) == (1, 40)
    check_same(pc, base, [turn2])


def test_a_killed_redis_is_a_miss_and_a_log_line(redis_server, redis_url, turn1, caplog):
    ids, cache = turn1
    pc = PrefixCache(RedisBackend(redis_url, timeout=0.5), model="q", block_size=BS, hot_bytes=0)
    pc.store(ids, cache)
    assert pc.lookup(ids).num_tokens == 40
    redis_server.stop()
    try:
        with caplog.at_level(logging.WARNING, logger="mlxcache"):
            assert pc.lookup(ids) is None
            assert pc.lookup(ids + prompt(20, seed=15)) is None
        assert "unreachable" in caplog.text
        assert pc.backend.stats()["errors"] >= 1
        assert pc.stats()["misses"] == 2
    finally:
        redis_server.start()
    pc.backend.close()


def test_backends_without_the_capability_answer_none():
    walk = ChainWalk(["a"], ["b"], ["c"], bytes(8), 8, 8, [], [])
    assert MemoryBackend().walk_chain(walk) is None
    assert not walks_chains(MemoryBackend())


def test_a_crowded_sibling_index_still_finds_the_longest_entry(pair, turn1):
    """Over 64 entries the script asks for the request's own prefixes (HMGET) instead."""
    ids, cache = turn1
    pc, base = pair
    pc.store(ids, cache)
    index, _ = sibling_index(pc, ids, 2)
    client = pc.backend.client
    for i in range(80):  # labels of other continuations: never a prefix of this request
        label = np.asarray([5000 + i] * (1 + i % 15), dtype=np.int64).tobytes()
        client.hset(index, label, b"k1\nk2")
    assert client.hlen(index) == 81
    turn2 = ids + prompt(40, seed=16)
    n, hit = trips(pc, turn2)
    assert (n, hit.num_tokens) == (1, 40)
    check_same(pc, base, [turn2])


def test_same_tokens_other_images_share_an_entry_and_still_hit_right(pair, qwen, caplog):
    """An index maps tokens to keys, not images: the later prompt's entry wins, the earlier
    prompt's lookup sees other keys and takes the default path (the same hit, never theirs)."""
    pc, base = pair
    ids = prompt(8, seed=17)  # inside block 0, where unplaced images key the hash
    cache = prefill(qwen, ids)
    pc.store(ids, cache, images=[b"cat"])
    pc.store(ids, cache, images=[b"dog"])
    turn2 = ids + prompt(40, seed=18)
    for img, trips_want in ((b"dog", 1), (b"cat", 4)):
        with caplog.at_level(logging.WARNING, logger="mlxcache"):
            n, hit = trips(pc, turn2, images=[img])
        assert (n, hit.num_tokens) == (trips_want, 8)
        same_hit(hit, base.lookup(turn2, images=[img]))
    assert trips(pc, turn2, images=[b"owl"])[1] is None


def test_sibling_indexes_stay_bounded(redis_url):
    backend = RedisBackend(redis_url)
    index = backend.layout.heads[0] + "i:s:idx"
    for i in range(1030):
        backend.add_sibling("idx", i.to_bytes(8, "little"), [f"t{i}", f"b{i}"])
    assert 0 < backend.client.hlen(index) <= 1024
    with pytest.raises(ValueError):
        backend.add_sibling("idx", b"x" * 8, ["a\nb"])
    backend.clear()
    assert not backend.client.exists(index)
    assert not backend.client.exists(backend.layout.heads[0] + "i:sibof")
    backend.close()


def test_chunked_values_come_whole_with_one_more_round_trip(redis_url, turn1):
    """Values over chunk_size come back as manifests; their chunks take one more round trip."""
    ids, cache = turn1
    walk = RedisBackend(redis_url, chunk_size=1024)
    pc = PrefixCache(walk, model="q", block_size=BS, hot_bytes=0)
    base = PrefixCache(
        DefaultPath(redis_url, chunk_size=1024), model="q", block_size=BS, hot_bytes=0
    )
    pc.store(ids, cache)
    turn2 = ids + prompt(30, seed=19)
    pc.lookup(ids), base.lookup(ids)
    for request in (ids, turn2):
        n, hit = trips(pc, request)
        assert (n, hit.num_tokens) == (2, 40)
        same_hit(hit, base.lookup(request))
    walk.clear()
    walk.close()
    base.backend.close()


def test_sentinel_walks_in_one_round_trip(redis_sentinel, turn1):
    ids, cache = turn1
    with PrefixCache(redis_sentinel.url, model="q", block_size=BS, hot_bytes=0) as pc:
        assert walks_chains(pc.backend)
        pc.store(ids, cache)
        pc.lookup(ids)
        for request, want in ((ids, 40), (ids + prompt(50, seed=20), 40), (prompt(40, 21), None)):
            n, hit = trips(pc, request)
            assert (n, hit and hit.num_tokens) == (1, want)


def test_cluster_takes_the_default_path_with_the_same_hits(redis_cluster, redis_url, turn1):
    ids, cache = turn1
    with PrefixCache(redis_cluster.url, model="q", block_size=BS, hot_bytes=0) as pc:
        assert not walks_chains(pc.backend)
        single = PrefixCache(RedisBackend(redis_url), model="q", block_size=BS, hot_bytes=0)
        for c in (pc, single):
            c.store(ids, cache)
        for request in (ids, ids + prompt(50, seed=22), prompt(40, 23)):
            hit = pc.lookup(request)
            same_hit(hit, single.lookup(request))
        assert pc.lookup(ids + prompt(50, seed=22)).num_tokens == 40
        single.backend.close()


def test_a_refused_partial_block_is_not_registered(redis_url, turn1):
    ids, cache = turn1
    backend = RedisBackend(redis_url, max_bytes=0)  # stores nothing: every put refused
    pc = PrefixCache(backend, model="q", block_size=BS, hot_bytes=0)
    assert pc.store(ids, cache) == 0
    index, _ = sibling_index(pc, ids, 2)
    assert not backend.client.exists(index)
    assert trips(pc, ids + prompt(20, seed=24)) == (1, None)
    backend.close()
