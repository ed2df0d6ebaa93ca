"""PrefixCache's hot tier: hits without a backend read, held to its budget, never aliased."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import CountingBackend, bits
from mlx_lm.models.cache import KVCache
from threads import run_threads

from mlxcache import PrefixCache, open_backend
from mlxcache.backends.memory import MemoryBackend
from mlxcache.records.record import Record

BS = 16
LAYERS, HEADS, DIM = 3, 2, 8
PER_TOKEN = LAYERS * 2 * HEADS * DIM * 2  # bytes of one token's keys and values (bf16)


def kv_cache(n: int, seed: int = 0) -> list[KVCache]:
    """Real mlx-lm KVCache layers holding ``n`` tokens of random keys/values (the first ``n``
    of one sequence per seed, so two lengths of one prompt agree)."""
    mx.random.seed(seed)
    out = []
    for _ in range(LAYERS):
        c = KVCache()
        k = mx.random.normal((1, HEADS, 96, DIM)).astype(mx.bfloat16)[..., :n, :]
        v = mx.random.normal((1, HEADS, 96, DIM)).astype(mx.bfloat16)[..., :n, :]
        c.update_and_fetch(k, v)  # preallocates room past n, as during a prefill
        out.append(c)
    mx.eval([(c.keys, c.values) for c in out])
    return out


def state_bits(cache) -> list[bytes]:
    """What each layer holds (mlx-lm's ``state`` includes the preallocated room past it)."""
    return [bits(a[..., : c.offset, :]) for c in cache for a in (c.keys, c.values)]


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(1, 900, n).tolist()


def counting() -> CountingBackend:
    return CountingBackend()


def test_a_stored_prompt_is_a_hot_hit_without_a_backend_read():
    backend = counting()
    pc = PrefixCache(backend, model="m", block_size=BS)
    ids, cache = prompt(40), kv_cache(40)
    want = state_bits(cache)
    pc.store(ids, cache)
    backend.calls.clear()
    hit = pc.lookup(ids)  # the whole request: nothing can be longer, no round trip
    assert hit.num_tokens == 40 and state_bits(hit.prompt_cache) == want
    assert not backend.calls
    assert all(h is not c for h, c in zip(hit.prompt_cache, cache, strict=True))
    assert all(h.keys is not c.keys for h, c in zip(hit.prompt_cache, cache, strict=True))
    # a longer request asks the backend (one contains_many) whether it has more, reads nothing
    hit = pc.lookup(ids + prompt(5, seed=1))
    assert hit.num_tokens == 40 and state_bits(hit.prompt_cache) == want
    assert backend.calls == {"contains_many": 1} and backend.reads == 0
    assert pc.longest(ids) == 40 and backend.calls == {"contains_many": 1}
    st = pc.stats()
    assert st["hits"] == 2 and st["tokens_reused"] == 80 and st["hot"]["hits"] == 2


def test_a_longer_prefix_another_worker_stored_wins_over_the_hot_entry():
    backend = MemoryBackend()
    mine = PrefixCache(backend, model="m", block_size=BS)
    other = PrefixCache(backend, model="m", block_size=BS)
    ids = prompt(60)
    mine.store(ids[:20], kv_cache(20))
    cache = kv_cache(50)
    other.store(ids[:50], cache)
    hit = mine.lookup(ids)
    assert hit.num_tokens == 50 and state_bits(hit.prompt_cache) == state_bits(cache)
    # and that backend hit is now hot: served again without a read
    backend2 = counting()
    pc = PrefixCache(backend2, model="m", block_size=BS)
    PrefixCache(backend2, model="m", block_size=BS).store(ids[:50], cache)
    assert pc.lookup(ids[:50]).num_tokens == 50 and backend2.calls["get_many"] == 1
    backend2.calls.clear()
    assert state_bits(pc.lookup(ids[:50]).prompt_cache) == state_bits(cache)
    assert not backend2.calls


def test_a_caller_updating_its_cache_in_place_never_changes_the_tier_or_another_caller():
    pc = PrefixCache(MemoryBackend(), model="m", block_size=BS)
    ids, cache = prompt(40), kv_cache(40)
    want = state_bits(cache)
    pc.store(ids, cache)
    new_k = mx.ones((1, HEADS, 2, DIM), dtype=mx.bfloat16)
    # the storing caller trims and extends its own cache: written in place (there is room)
    cache[0].trim(4)
    cache[0].update_and_fetch(new_k, new_k)
    assert cache[0].offset == 38
    a = pc.lookup(ids).prompt_cache
    assert state_bits(a) == want
    # caller A does the same on its hit, and writes into its arrays with a slice assignment
    a[0].trim(4)
    a[0].update_and_fetch(new_k, new_k)
    a[1].keys[..., :3, :] = mx.zeros((1, HEADS, 3, DIM), dtype=mx.bfloat16)
    mx.eval([(c.keys, c.values) for c in a])
    assert bits(a[0].keys[..., 36:38, :]) == bits(new_k)
    b = pc.lookup(ids).prompt_cache  # caller B still gets what was stored
    assert state_bits(b) == want
    b[2].trim(10)
    b[2].update_and_fetch(new_k, new_k)
    assert state_bits(pc.lookup(ids).prompt_cache) == want
    assert bits(a[0].keys[..., 36:38, :]) == bits(new_k)  # and A keeps its own update


def test_a_backend_hit_is_verified_once_then_served_even_if_the_records_change():
    backend = counting()
    ids, cache = prompt(40), kv_cache(40)
    want = state_bits(cache)
    PrefixCache(backend, model="m", block_size=BS).store(ids, cache)
    pc = PrefixCache(backend, model="m", block_size=BS)
    assert state_bits(pc.lookup(ids).prompt_cache) == want  # read and verified
    for k in backend.keys():  # the records are now another prompt's (a forged store)
        rec = backend.get(k)
        backend.put(k, Record(arrays=rec.arrays, meta={**rec.meta, "tokens": b"x" * 8}))
    backend.calls.clear()
    assert state_bits(pc.lookup(ids).prompt_cache) == want and not backend.calls
    # a fresh cache sees only the forged records: a miss, and nothing became hot
    fresh = PrefixCache(backend, model="m", block_size=BS)
    assert fresh.lookup(ids) is None and fresh.lookup(ids) is None
    assert fresh.stats()["hot"]["entries"] == 0 and fresh.stats()["rejected"] >= 2


def test_the_budget_holds_and_the_least_recently_used_goes_first():
    backend = counting()
    pc = PrefixCache(backend, model="m", block_size=BS, hot_bytes=2 * 32 * PER_TOKEN)
    a, b, c = prompt(32, 1), prompt(32, 2), prompt(32, 3)
    for i, ids in enumerate((a, b)):
        pc.store(ids, kv_cache(32, seed=i))
    assert pc.lookup(a).num_tokens == 32  # a is now more recent than b
    pc.store(c, kv_cache(32, seed=3))
    hot = pc.stats()["hot"]
    assert hot["entries"] == 2 and hot["bytes"] <= hot["max_bytes"] and hot["evictions"] == 1
    backend.calls.clear()
    assert pc.lookup(a).num_tokens == 32 and pc.lookup(c).num_tokens == 32
    assert not backend.calls  # both hot
    assert pc.lookup(b).num_tokens == 32  # evicted from the tier, still in the backend
    assert backend.calls["get_many"] == 1
    # one entry larger than the whole budget is not kept (and evicts nothing)
    pc.store(prompt(80, 4), kv_cache(80, seed=4))
    hot = pc.stats()["hot"]
    assert hot["too_big"] == 1 and hot["entries"] == 2 and hot["bytes"] <= hot["max_bytes"]


def test_clear_empties_the_hot_tier_and_salts_stay_apart():
    backend = MemoryBackend()
    pc = PrefixCache(backend, model="m", block_size=BS, salt="a")
    ids = prompt(40)
    pc.store(ids, kv_cache(40))
    assert PrefixCache(backend, model="m", block_size=BS, salt="b").lookup(ids) is None
    assert PrefixCache(backend, model="other", block_size=BS, salt="a").lookup(ids) is None
    assert pc.clear() > 0
    assert pc.lookup(ids) is None and pc.stats()["hot"]["entries"] == 0


def test_hot_bytes_zero_disables_the_tier():
    backend = counting()
    pc = PrefixCache(backend, model="m", block_size=BS, hot_bytes=0)
    ids = prompt(40)
    pc.store(ids, kv_cache(40))
    for _ in range(2):
        assert pc.lookup(ids).num_tokens == 40
    assert backend.calls["get_many"] == 2 and pc.stats()["hot"] is None
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError):
            PrefixCache(backend, model="m", hot_bytes=bad)


def test_require_extras_and_images_use_only_entries_that_can_answer_them():
    backend = counting()
    ids = prompt(40)
    cache = kv_cache(40)
    PrefixCache(backend, model="m", block_size=BS).store(ids[:32], kv_cache(32))
    PrefixCache(backend, model="m", block_size=BS).store(
        ids, cache, extras={"d": mx.array([7])}, images=[b"cat"], vision_embeddings=mx.ones(3)
    )
    pc = PrefixCache(backend, model="m", block_size=BS)
    assert pc.lookup(ids[:32] + [1]).num_tokens == 32  # kept hot
    backend.calls.clear()
    hit = pc.lookup(ids, images=[b"cat"])  # the image keys other chains: nothing hot, a read
    assert hit.num_tokens == 40 and hit.extras["d"].item() == 7 and backend.calls["get_many"]
    backend.calls.clear()
    hit = pc.lookup(ids, images=[b"cat"], require_extras=True)  # now hot, with its extras
    assert hit.num_tokens == 40 and hit.extras["d"].item() == 7 and not backend.calls
    assert bits(hit.vision_embeddings) == bits(mx.ones(3))
    assert pc.lookup(ids, images=[b"dog"]) is None  # another image: another key


def test_a_dead_backend_still_serves_what_this_process_stored():
    pc = PrefixCache(open_backend("redis://127.0.0.1:1/0?timeout=0.2"), model="m", block_size=BS)
    ids, cache = prompt(40), kv_cache(40)
    pc.store(ids, cache)
    assert state_bits(pc.lookup(ids + [5]).prompt_cache) == state_bits(cache)
    assert PrefixCache(pc.backend, model="m", block_size=BS).lookup(ids) is None
    pc.backend.close()


def test_two_threads_store_and_look_up_within_the_budget():
    pc = PrefixCache(MemoryBackend(), model="m", block_size=BS, hot_bytes=3 * 24 * PER_TOKEN)
    prompts = [prompt(24, seed=s) for s in range(6)]
    caches = [kv_cache(24, seed=s) for s in range(6)]
    wants = [state_bits(c) for c in caches]

    def work(t: int) -> None:
        for r in range(30):
            i = (t * 3 + r) % 6
            if r % 2 == 0:
                pc.store(prompts[i], caches[i])
            hit = pc.lookup(prompts[i])
            assert hit is None or state_bits(hit.prompt_cache) == wants[i]

    assert run_threads(work, 2) == []
    hot = pc.stats()["hot"]
    assert hot["bytes"] <= hot["max_bytes"] and hot["entries"] <= 3 and hot["evictions"] > 0
    for i in range(6):
        assert state_bits(pc.lookup(prompts[i]).prompt_cache) == wants[i]


def test_longest_with_have_asks_only_about_longer_lengths_and_agrees_with_lookup():
    backend = counting()
    pc = PrefixCache(backend, model="m", block_size=BS, hot_bytes=0)
    ids = prompt(70)
    pc.store(ids[:37], kv_cache(37))
    pc.store(ids[:52], kv_cache(52))
    for n in (70, 60, 52, 50, 40, 37, 30, 16, 5):
        hit = pc.lookup(ids[:n])
        best = hit.num_tokens if hit else 0
        for have in (0, 20, 37, 40, 48):
            if have <= n:
                assert pc.longest(ids[:n], have=have) == max(best, have), (n, have)
    backend.calls.clear()
    assert pc.longest(ids[:60], have=52) == 52  # in the last partial block: one small probe
    assert backend.calls == {"contains_many": 1}


def test_hot_hits_touch_their_records_so_the_backend_keeps_them(monkeypatch):
    from mlxcache.prefix import hot as prefix_hot

    class Touched(MemoryBackend):
        def __init__(self) -> None:
            super().__init__()
            self.touched: list[str] = []

        def touch_many(self, keys):
            self.touched += list(keys)
            super().touch_many(keys)

    backend = Touched()
    pc = PrefixCache(backend, model="m", block_size=BS)
    ids = prompt(40)
    pc.store(ids, kv_cache(40))
    assert pc.lookup(ids).num_tokens == 40 and pc.flush(30)
    assert backend.touched == []  # touched at most every TOUCH_EVERY seconds
    monkeypatch.setattr(prefix_hot, "TOUCH_EVERY", 0.0)
    assert pc.lookup(ids).num_tokens == 40 and pc.flush(30)
    assert set(backend.touched) == set(backend.keys()) and len(backend.touched) == 4
    pc.close()


def test_an_entry_without_vision_embeddings_answers_only_while_the_backend_has_none():
    backend = counting()
    ids = prompt(40)
    pc = PrefixCache(backend, model="m", block_size=BS)
    pc.store(ids, kv_cache(40), images=[b"cat"])  # no vision embeddings stored
    backend.calls.clear()
    hit = pc.lookup(ids, images=[b"cat"])  # one contains_many (the vision key), no read
    assert hit.num_tokens == 40 and hit.vision_embeddings is None
    assert backend.calls == {"contains_many": 1}
    other = PrefixCache(backend, model="m", block_size=BS)  # another worker adds them
    other.store(ids, kv_cache(40), images=[b"cat"], vision_embeddings=mx.full(4, 2.0))
    hit = pc.lookup(ids, images=[b"cat"])  # now read, and kept hot with them
    assert bits(hit.vision_embeddings) == bits(mx.full(4, 2.0))
    backend.calls.clear()
    hit = pc.lookup(ids + [3], images=[b"cat"])
    assert hit.num_tokens == 40 and bits(hit.vision_embeddings) == bits(mx.full(4, 2.0))
    assert backend.calls["get_many"] == 0


def test_hot_probe_false_answers_from_the_tier_without_asking_the_backend():
    backend = counting()
    ids = prompt(60)
    pc = PrefixCache(backend, model="m", block_size=BS, hot_probe=False)
    pc.store(ids[:20], kv_cache(20))
    PrefixCache(backend, model="m", block_size=BS).store(ids[:50], kv_cache(50))
    backend.calls.clear()
    hit = pc.lookup(ids)  # the longer prefix another worker stored is not used
    assert hit.num_tokens == 20 and state_bits(hit.prompt_cache) == state_bits(kv_cache(20))
    assert not backend.calls
    assert pc.lookup(prompt(30, seed=9)) is None and backend.calls["get_many"] == 0  # a miss
    # with nothing hot the backend answers as usual (and that hit is kept)
    fresh = PrefixCache(backend, model="m", block_size=BS, hot_probe=False)
    assert fresh.lookup(ids).num_tokens == 50
