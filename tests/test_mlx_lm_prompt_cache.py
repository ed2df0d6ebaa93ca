"""SharedPromptCache: mlx-lm's LRUPromptCache over a shared PrefixCache tier.

The hot tier holds its entry and byte budget; what it evicts, a restarted process or a second
worker finds in the backend (memory, file, Redis); a dead backend is a miss, never an error.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache
from redis_server import RedisServer

from mlxcache.backends.memory import MemoryBackend
from mlxcache.integrations.mlx_lm.prompt_cache import SharedPromptCache

MODEL = ("tiny", None, None)


def kv(tokens, layers=2):
    """A real KVCache list whose rows are a function of the tokens (so prefixes agree)."""
    t = mx.array(tokens, dtype=mx.float32).reshape(1, 1, -1, 1)
    out = []
    for j in range(layers):
        c = KVCache()
        keys = mx.broadcast_to(t * (j + 1), (1, 2, len(tokens), 8))
        c.update_and_fetch(keys, -keys)
        out.append(c)
    mx.eval([c.state for c in out])
    return out


def rows(prompt_cache):
    keys, _, offset = prompt_cache[0].state
    return keys[0, 0, :offset, 0].tolist()


@pytest.mark.parametrize("background", [False, True])
def test_a_new_instance_finds_what_another_stored(tmp_path, background):
    uri = f"file://{tmp_path}/c"
    prompt = list(range(1, 40))
    first = SharedPromptCache(backend=uri, background=background)
    assert first.fetch_nearest_cache(MODEL, prompt) == (None, prompt)
    answer = prompt + [90, 91, 92]
    first.insert_cache(MODEL, answer, kv(answer))
    first.close()  # finishes the pending store

    second = SharedPromptCache(backend=uri)
    cache, rest = second.fetch_nearest_cache(MODEL, prompt)
    # the same prompt: all but its last token, from the store written at the prompt's length
    assert rest == prompt[-1:]
    assert rows(cache) == [float(t) for t in prompt[:-1]]
    assert second.stats()["backend_hits"] == 1
    # the whole answer is there too, for a follow-up turn that extends it
    follow = answer + [7, 8, 9]
    cache, rest = second.fetch_nearest_cache(MODEL, follow)
    assert rest == [7, 8, 9]
    assert rows(cache) == [float(t) for t in answer]
    # another model key shares nothing
    assert second.fetch_nearest_cache(("other", None, None), follow) == (None, follow)
    second.close()


def test_a_new_process_finds_it(tmp_path):
    uri = f"file://{tmp_path}/c"
    prompt = list(range(3, 300))  # more than one 256-token block
    cache = SharedPromptCache(backend=uri)
    cache.fetch_nearest_cache(MODEL, prompt)
    cache.insert_cache(MODEL, prompt + [5], kv(prompt + [5]))
    cache.close()
    code = (
        "import sys\n"
        "from mlxcache.integrations.mlx_lm.prompt_cache import SharedPromptCache\n"
        "c = SharedPromptCache(backend=sys.argv[1])\n"
        "hit, rest = c.fetch_nearest_cache(('tiny', None, None), list(range(3, 300)))\n"
        "print(len(rest), hit[0].offset, hit[0].state[0][0, 0, :hit[0].offset, 0].tolist()[-1])\n"
    )
    out = subprocess.run([sys.executable, "-c", code, uri], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", str(len(prompt) - 1), str(float(prompt[-2]))]


def test_hot_hit_does_not_touch_the_backend(tmp_path):
    cache = SharedPromptCache(backend="memory://")
    prompt = list(range(1, 30))
    cache.fetch_nearest_cache(MODEL, prompt)
    cache.insert_cache(MODEL, prompt + [4], kv(prompt + [4]))
    before = cache.backend.stats()
    hit, rest = cache.fetch_nearest_cache(MODEL, prompt)
    assert rest == prompt[-1:] and rows(hit) == [float(t) for t in prompt[:-1]]
    after = cache.backend.stats()
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])
    assert cache.stats()["hot_hits"] == 1 and cache.stats()["backend_hits"] == 0


@pytest.mark.parametrize("background", [False, True])
def test_byte_budget_holds_and_evicted_prefixes_stay_reachable(tmp_path, background):
    one = sum(c.nbytes for c in kv(list(range(40))))
    budget = 3 * one + one // 2
    uri = f"file://{tmp_path}/c"
    cache = SharedPromptCache(max_size=100, max_bytes=budget, backend=uri, background=background)
    prompts = [[1000 + i] + list(range(i, i + 30)) for i in range(50)]
    for p in prompts:
        cache.fetch_nearest_cache(MODEL, p)
        cache.insert_cache(MODEL, p + [7] * 9, kv(p + [7] * 9))
        assert cache.nbytes <= budget
        assert len(cache) <= 3
        assert sum(s["n_bytes"] for s in cache.stats_by_type().values()) == cache.nbytes
    assert len(cache) == 3
    cache.flush()
    # the oldest prompts left the hot tier long ago: the backend has them
    for p in prompts[:5]:
        hit, rest = cache.fetch_nearest_cache(MODEL, p)
        assert rest == p[-1:]
        assert rows(hit) == [float(t) for t in p[:-1]]
    assert cache.stats()["backend_hits"] == 5
    # a backend hit does not grow the hot tier (the server inserts after generating)
    assert cache.nbytes <= budget
    # trim_to (what mlx-lm's batch path calls) is honoured as well
    cache.trim_to(n_bytes=one)
    assert cache.nbytes <= one and len(cache) <= 1


def test_redis_shared_by_two_workers():
    server = RedisServer()
    try:
        a = SharedPromptCache(backend=server.url)
        b = SharedPromptCache(backend=server.url)
        prompt = list(range(50, 90))
        a.fetch_nearest_cache(MODEL, prompt)
        a.insert_cache(MODEL, prompt + [1, 2], kv(prompt + [1, 2]))
        assert a.flush(60)  # stores run on a's writer thread
        hit, rest = b.fetch_nearest_cache(MODEL, prompt)
        assert rest == prompt[-1:] and rows(hit) == [float(t) for t in prompt[:-1]]
        a.close()
        b.close()
    finally:
        server.close()


def test_dead_redis_is_a_miss_and_the_hot_tier_still_works(caplog):
    server = RedisServer()
    url = server.url
    server.close()
    cache = SharedPromptCache(backend=url + "?timeout=0.2")
    prompt = list(range(1, 20))
    with caplog.at_level(logging.WARNING, logger="mlxcache"):
        assert cache.fetch_nearest_cache(MODEL, prompt) == (None, prompt)
        cache.insert_cache(MODEL, prompt + [3], kv(prompt + [3]))
    hit, rest = cache.fetch_nearest_cache(MODEL, prompt)
    assert rest == prompt[-1:] and rows(hit) == [float(t) for t in prompt[:-1]]
    assert cache.stats()["tokens_stored"] == 0
    assert caplog.records  # the failure was logged


def test_unstorable_cache_is_logged_not_raised(caplog):
    class Opaque:
        nbytes = 3

        def is_trimmable(self):
            return False

    cache = SharedPromptCache(backend="memory://")
    with caplog.at_level(logging.WARNING, logger="mlxcache"):
        cache.insert_cache(MODEL, [1, 2, 3], [Opaque()])
        assert cache.flush(60)
    assert cache.stats()["store_errors"] == 1
    assert "store failed" in caplog.text
    assert len(cache) == 1  # the hot tier kept it


@pytest.mark.parametrize("background", [False, True])
def test_after_next_insert_runs_once_after_the_store(background):
    cache = SharedPromptCache(backend="memory://", background=background)
    seen = []
    cache.after_next_insert(lambda: seen.append(len(list(cache.backend.keys("")))))
    assert seen == []
    cache.insert_cache(MODEL, [1, 2, 3], kv([1, 2, 3]))
    cache.flush()
    assert len(seen) == 1 and seen[0] > 0  # the records were there when it ran
    cache.insert_cache(MODEL, [4, 5, 6], kv([4, 5, 6]))
    cache.flush()
    assert len(seen) == 1
    cache.close()


def test_background_stores_beside_fetches_on_another_thread(tmp_path):
    """The server's shape: one thread inserts and fetches, the writer stores behind it."""
    cache = SharedPromptCache(backend=f"file://{tmp_path}/c", background=True, max_pending=1)
    prompts = [[500 + i] + list(range(i, i + 60)) for i in range(12)]
    for p in prompts:
        cache.fetch_nearest_cache(MODEL, p)
        cache.insert_cache(MODEL, p + [1], kv(p + [1]))
    cache.close()
    other = SharedPromptCache(backend=f"file://{tmp_path}/c")
    for p in prompts:
        hit, rest = other.fetch_nearest_cache(MODEL, p)
        assert rest == p[-1:] and rows(hit) == [float(t) for t in p[:-1]]
    assert cache.stats()["store_errors"] == 0


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError):
        SharedPromptCache(backend="nosuch://x")


def test_a_longer_prefix_from_another_worker_beats_a_shorter_hot_one(tmp_path):
    uri = f"file://{tmp_path}/c"
    a = SharedPromptCache(backend=uri)
    b = SharedPromptCache(backend=uri)
    turn1 = list(range(1, 300))
    b.insert_cache(MODEL, turn1, kv(turn1))  # b's hot tier: the first turn
    turn2 = turn1 + list(range(400, 480))
    a.fetch_nearest_cache(MODEL, turn2)
    a.insert_cache(MODEL, turn2 + [9], kv(turn2 + [9]))  # a computed the second turn
    assert a.flush(60) and b.flush(60)  # both stores landed
    turn3 = turn2 + [9, 10, 11]
    hit, rest = b.fetch_nearest_cache(MODEL, turn3)
    assert rest == [10, 11]
    assert rows(hit) == [float(t) for t in turn2 + [9]]
    assert b.stats()["backend_hits"] == 1
    # when the shared tier has nothing longer, the hot tier answers and nothing is read
    gets = b.backend.stats()["hits"]
    other = turn1 + [77, 78, 79]
    hit, rest = b.fetch_nearest_cache(MODEL, other)
    assert rest == [77, 78, 79] and b.stats()["hot_hits"] == 1
    assert b.backend.stats()["hits"] == gets


def test_longest_bounds_lookup(tmp_path):
    from mlxcache import PrefixCache

    pc = PrefixCache("memory://", model="m", block_size=16)
    tokens = list(range(100))
    assert pc.longest(tokens) == 0
    pc.store(tokens[:37], kv(tokens[:37]))
    for probe in (tokens, tokens[:40], tokens[:37], tokens[:36], tokens[:20], [5] + tokens):
        hit = pc.lookup(probe)
        assert pc.longest(probe) == (hit.num_tokens if hit else 0)


class _GatedBackend(MemoryBackend):
    """A memory backend whose puts wait for ``gate`` (a slow store) and count reads."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.probes = 0

    def put(self, key, record):
        self.gate.wait(30)
        super().put(key, record)

    def contains_many(self, keys):
        self.probes += 1
        return super().contains_many(keys)


def test_insert_returns_before_the_store_and_close_writes_it():
    backend = _GatedBackend()
    cache = SharedPromptCache(backend=backend)  # background by default
    prompt = list(range(1, 40))
    cache.fetch_nearest_cache(MODEL, prompt)
    cache.insert_cache(MODEL, prompt + [5], kv(prompt + [5]))  # returns, its puts wait
    assert not list(backend.keys()) and not cache.flush(0.05)
    # the hot tier answers meanwhile: the whole prompt but its last token, no backend probe
    probes = backend.probes
    hit, rest = cache.fetch_nearest_cache(MODEL, prompt)
    assert rest == prompt[-1:] and rows(hit) == [float(t) for t in prompt[:-1]]
    assert backend.probes == probes and cache.stats()["hot_hits"] == 1
    backend.gate.set()
    cache.close()  # flushes
    assert len(list(backend.keys())) > 0
    other = SharedPromptCache(backend=backend)
    hit, rest = other.fetch_nearest_cache(MODEL, prompt + [5, 6])
    assert rest == [6] and rows(hit) == [float(t) for t in prompt + [5]]
    other.close()
    with pytest.raises(ValueError):
        SharedPromptCache(backend="memory://", hot_bytes=-1)


def test_hot_probe_false_asks_the_backend_only_when_the_hot_tier_has_nothing():
    backend = _GatedBackend()
    backend.gate.set()
    a = SharedPromptCache(backend=backend, hot_probe=False)
    b = SharedPromptCache(backend=backend)
    turn1 = list(range(1, 60))
    a.insert_cache(MODEL, turn1, kv(turn1))
    turn2 = turn1 + list(range(100, 140))
    b.insert_cache(MODEL, turn2, kv(turn2))  # another worker computed more
    assert a.flush(60) and b.flush(60)
    probes = backend.probes
    cache, rest = a.fetch_nearest_cache(MODEL, turn2 + [7])
    assert rest == turn2[len(turn1) :] + [7] and backend.probes == probes  # hot answer is final
    fresh = SharedPromptCache(backend=backend, hot_probe=False)
    cache, rest = fresh.fetch_nearest_cache(MODEL, turn2 + [7])  # nothing hot: the backend
    assert rest == [7] and rows(cache) == [float(t) for t in turn2]
    for c in (a, b, fresh):
        c.close()


def test_another_workers_prompt_is_fetched_with_one_probe():
    backend = _GatedBackend()
    backend.gate.set()
    a = SharedPromptCache(backend=backend)
    prompt = list(range(1, 60))
    a.insert_cache(MODEL, prompt, kv(prompt))
    assert a.flush(60)
    fresh = SharedPromptCache(backend=backend)
    probes = backend.probes
    hit, rest = fresh.fetch_nearest_cache(MODEL, prompt + [7])
    assert rest == [7] and rows(hit) == [float(t) for t in prompt]
    assert backend.probes == probes + 1  # the lookup's own contains_many, no longest() first
    a.close()
    fresh.close()


def test_store_prefill_keeps_a_windows_blocks_and_leaves_dense_caches_to_the_insert():
    """``store_prefill`` (mlxcache serve, after each prefill chunk): a window layer's blocks are
    stored while it holds them, so a branch at a block boundary hits later; a dense cache waits
    for the insert; a state layer only on its stride (without KV layers: the lcm of the block
    and the prefill step, so at the engine's own chunk ends)."""
    from mlx_lm.models.cache import ArraysCache, RotatingKVCache

    backend = MemoryBackend()
    cache = SharedPromptCache(backend=backend, block_size=8, background=False, prefill_step=8)
    prompt = list(range(1, 25))
    cache.store_prefill(MODEL, prompt[:16], kv(prompt[:16]))
    assert not list(backend.keys(""))  # dense: the insert at the end stores every block
    state = ArraysCache(1)
    state[0] = mx.zeros((1, 4))
    assert not cache.prefill_store_due(12, [state]) and cache.prefill_store_due(16, [state])
    steps = SharedPromptCache(backend=MemoryBackend(), block_size=8, prefill_step=12)
    assert [n for n in range(8, 50, 4) if steps.prefill_store_due(n, [state])] == [24, 48]
    steps.close()

    def rotating(layer, tokens):  # rows that are a function of the tokens, as kv() does
        t = mx.array(tokens, dtype=mx.float32).reshape(1, 1, -1, 1)
        keys = mx.broadcast_to(t, (1, 2, len(tokens), 8))
        layer.update_and_fetch(keys, -keys)
        mx.eval(layer.state)

    window = RotatingKVCache(max_size=4)
    rotating(window, prompt[:16])  # the first chunk
    cache.store_prefill(MODEL, prompt[:16], [window])
    rotating(window, prompt[16:])  # the next chunk: the window drops positions before 13
    cache.insert_cache(MODEL, prompt, [window])
    branch = prompt[:16] + [90, 91]
    hit, rest = SharedPromptCache(backend=backend, block_size=8).fetch_nearest_cache(MODEL, branch)
    assert rest == [90, 91] and hit[0].offset == 16
    keys = hit[0].state[0]
    assert keys[0, 0, -4:, 0].tolist() == [13.0, 14.0, 15.0, 16.0]


def test_branch_gives_the_latest_fetchs_branch_point_and_store_branch_checkpoints_it():
    """``branch`` (mlxcache serve, hybrid models): a prompt whose blocks match a stored one past
    its hit gets the last block boundary before the branch, for its own fetch only; a state
    stored there by ``store_branch`` is what the next prompt branching there restores."""
    from mlx_lm.models.cache import ArraysCache

    def hybrid(tokens):  # a KV layer and a state layer whose state names the length
        state = ArraysCache(1)
        state[0] = mx.full((1, 4), float(len(tokens)))
        return [*kv(tokens, layers=1), state]

    backend = MemoryBackend()
    cache = SharedPromptCache(backend=backend, block_size=8, background=False)
    stored = list(range(1, 41))
    cache.insert_cache(MODEL, stored, hybrid(stored))  # blocks to 40, a checkpoint at 40
    branched = stored[:21] + [90, 91, 92]
    assert cache.fetch_nearest_cache(MODEL, branched) == (None, branched)  # no checkpoint <= 21
    assert cache.branch(branched, 0) == (MODEL, 16)
    assert cache.branch(stored[:21] + [7, 7, 7], 0) == (MODEL, 0)  # not the latest fetch
    assert cache.branch(branched, 16) == (MODEL, 0)  # nothing past the hit
    cache.store_branch(MODEL, branched[:16], hybrid(branched[:16]))
    assert cache.stats()["branch_points"] == 1
    third = stored[:21] + [50, 51]
    hit, rest = SharedPromptCache(backend=backend, block_size=8).fetch_nearest_cache(MODEL, third)
    assert rest == third[16:] and rows(hit) == [float(t) for t in third[:16]]
    assert hit[1][0].tolist() == [[16.0] * 4]
    off = SharedPromptCache(persist=False)
    off.fetch_nearest_cache(MODEL, branched)
    assert off.branch(branched, 0) == (MODEL, 0)  # no shared tier
