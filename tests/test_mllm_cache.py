"""mlxcache.mllm_cache: the vllm-mlx API, its defects fixed, prefix matching, persistence."""

from __future__ import annotations

import base64
import hashlib
import inspect
import logging
import os
import subprocess
import sys
import textwrap
import time

import mlx.core as mx
import numpy as np
import pytest
from helpers import CountingBackend
from mlx_vlm.models.cache import KVCache, QuantizedKVCache
from PIL import Image
from threads import run_threads

from mlxcache import mllm_cache as mc
from mlxcache.backends.memory import MemoryBackend
from mlxcache.integrations.vllm_mlx import payloads
from mlxcache.mllm_cache import (
    MLLMCacheManager,
    MLLMCacheStats,
    MLLMPrefixCacheEntry,
    MLLMPrefixCacheManager,
    compute_image_hash,
    compute_images_hash,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kv(n: int, seed: int = 0, dtype=mx.float32) -> list[KVCache]:
    """A two-layer KV cache holding ``n`` tokens of deterministic data."""
    layers = []
    for layer in range(2):
        c = KVCache()
        x = mx.arange(n * 16, dtype=mx.float32).reshape(1, 2, n, 8) + 1000 * seed + layer
        c.update_and_fetch(x.astype(dtype), (-x).astype(dtype))
        layers.append(c)
    mx.eval([(c.keys, c.values) for c in layers])
    return layers


def bits(cache: list) -> list:
    """Keys and values of each layer up to its offset, as raw uint8 bits."""
    out = []
    for c in cache:
        k, v = c.state[:2]
        out += [k.view(mx.uint8).tolist(), v.view(mx.uint8).tolist()]
    return out


@pytest.fixture
def images(tmp_path):
    paths = []
    for i in range(3):
        p = tmp_path / f"img{i}.jpg"
        p.write_bytes(f"image {i} content".encode() * 10)
        paths.append(str(p))
    return paths


# ---------------------------------------------------------------- the vllm-mlx API surface


def params(fn) -> list[tuple[str, object, str]]:
    return [
        (p.name, p.default, p.kind.name)
        for p in inspect.signature(fn).parameters.values()
        if p.name != "self"
    ]


E = inspect.Parameter.empty
POS = "POSITIONAL_OR_KEYWORD"


def test_names_and_aliases_as_in_vllm_mlx():
    assert mc.MLLMCacheManager is MLLMPrefixCacheManager
    assert mc.VLMCacheStats is MLLMCacheStats
    assert mc.VLMPrefixCacheEntry is MLLMPrefixCacheEntry
    assert mc.VLMCacheEntry is MLLMPrefixCacheEntry
    assert mc.VLMPrefixCacheManager is MLLMPrefixCacheManager
    assert mc.VLMCacheManager is MLLMPrefixCacheManager


def test_signatures_match_vllm_mlx_plus_backend_keyword():
    M = MLLMPrefixCacheManager
    assert params(M.__init__) == [
        ("max_entries", 50, POS),
        ("max_memory_mb", 2048, POS),
        ("backend", "memory://", "KEYWORD_ONLY"),
    ]
    assert params(M.fetch) == [("images", E, POS), ("prompt", E, POS), ("token_ids", None, POS)]
    assert params(M.fetch_cache) == [("images", E, POS), ("prompt", E, POS)]
    assert params(M.store) == [
        ("images", E, POS), ("prompt", E, POS), ("vision_embeddings", E, POS),
        ("kv_cache", E, POS), ("token_ids", E, POS), ("num_image_tokens", 0, POS),
        ("model_name", "", POS),
    ]  # fmt: skip
    assert params(M.store_cache) == [
        ("images", E, POS), ("prompt", E, POS), ("cache", E, POS), ("num_tokens", 0, POS),
    ]  # fmt: skip
    for name in ("get_stats", "reset_stats", "clear", "__len__", "__repr__"):
        assert params(getattr(M, name)) == []
    assert params(compute_image_hash) == [("image_path", E, POS)]
    assert params(compute_images_hash) == [("images", E, POS)]


def test_dataclass_fields_and_defaults():
    s = MLLMCacheStats()
    assert list(s.to_dict()) == [
        "hits", "misses", "partial_hits", "hit_rate", "tokens_saved", "image_cache_hits",
        "vision_encoder_skips", "total_queries", "evictions",
    ]  # fmt: skip
    assert MLLMCacheStats(hits=3, misses=7, total_queries=10).hit_rate == 0.3
    assert s.hit_rate == 0.0
    e = MLLMPrefixCacheEntry(image_hash="a", prompt_hash="b")
    assert (e.vision_embeddings, e.kv_cache, e.token_ids) == (None, [], [])
    assert (e.num_image_tokens, e.num_text_tokens, e.prompt_tokens, e.hit_count) == (0, 0, 0, 0)
    assert e.model_name == "" and isinstance(e.created_at, float)
    e.token_ids = [1, 2, 3, 4]
    assert e.total_tokens == 4
    assert e.get_prefix_match_length([1, 2, 9]) == 2
    assert e.get_prefix_match_length([1, 2, 3, 4, 5]) == 4
    assert e.get_prefix_match_length([]) == 0


def test_manager_attributes_stats_repr():
    m = MLLMCacheManager(max_entries=10, max_memory_mb=3)
    assert m.max_size == 10 and m.max_memory == 3 * 1024 * 1024
    assert isinstance(m.stats, MLLMCacheStats) and len(m) == 0
    assert repr(m) == "<MLLMPrefixCacheManager entries=0 memory=0.0MB>"
    stats = m.get_stats()
    assert stats["entries"] == 0 and stats["max_entries"] == 10
    assert stats["memory_used_mb"] == 0 and stats["max_memory_mb"] == 3


# ---------------------------------------------------------------- public hash helpers


def test_compute_image_hash_documented_contract(tmp_path, images):
    data = open(images[0], "rb").read()
    want = hashlib.sha256(data).hexdigest()[:16]
    assert compute_image_hash(images[0]) == want  # file path: SHA-256 of the file bytes
    uri = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    assert compute_image_hash(uri) == want  # base64: the same content, the same hash
    assert compute_image_hash(data) == want
    url = "https://example.com/image.jpg"
    assert compute_image_hash(url) == hashlib.sha256(url.encode()).hexdigest()[:16]
    img = Image.new("RGB", (4, 3), (10, 20, 30))
    h = compute_image_hash(img)
    assert len(h) == 16 and h == compute_image_hash(img.copy())
    assert h != compute_image_hash(Image.new("RGB", (4, 3), (10, 20, 31)))


def test_compute_images_hash_keeps_order(images):
    a, b = images[:2]
    assert compute_images_hash([]) == "no_images"
    ha, hb = compute_image_hash(a), compute_image_hash(b)
    assert compute_images_hash([a, b]) == hashlib.sha256(f"{ha}_{hb}".encode()).hexdigest()[:16]
    assert compute_images_hash([a, b]) != compute_images_hash([b, a])  # vllm-mlx: equal
    assert len(compute_images_hash([a])) == 16


# ---------------------------------------------------------------- vllm-mlx behaviour kept


def test_legacy_store_and_fetch(images):
    m = MLLMCacheManager(max_entries=10)
    assert m.fetch_cache([images[0]], "Describe") == (None, False)
    m.store_cache([images[0]], "Describe", kv(5), num_tokens=100)
    cache, hit = m.fetch_cache([images[0]], "Describe")
    assert hit is True and bits(cache) == bits(kv(5))
    assert m.fetch_cache([images[0]], "Other prompt") == (None, False)
    assert m.fetch_cache([images[1]], "Describe") == (None, False)
    s = m.get_stats()
    assert (s["hits"], s["misses"], s["total_queries"], s["tokens_saved"]) == (1, 3, 4, 100)
    assert s["image_cache_hits"] == 1 and s["hit_rate"] == 0.25
    m.store_cache([images[0]], "p", None)
    m.store_cache([images[0]], "p", [])
    assert len(m) == 1
    m.reset_stats()
    assert m.stats.hits == 0 and len(m) == 1
    m.clear()
    assert len(m) == 0 and m.fetch_cache([images[0]], "Describe") == (None, False)


def test_video_keys_and_lru_touch():
    m = MLLMCacheManager(max_entries=3)
    m.store_cache(["video:t.mp4:fps2.0:max32"], "p", ["c"], num_tokens=4)
    assert m.fetch_cache(["video:t.mp4:fps2.0:max32"], "p")[1] is True
    assert m.fetch_cache(["video:t.mp4:fps1.0:max64"], "p")[1] is False
    m.clear()
    for i in (1, 2, 3):
        m.store_cache([f"img{i}.jpg"], f"p{i}", [f"cache{i}"])
    m.fetch_cache(["img1.jpg"], "p1")
    m.store_cache(["img4.jpg"], "p4", ["cache4"])
    assert len(m) == 3 and m.stats.evictions == 1
    assert m.fetch_cache(["img1.jpg"], "p1")[1] is True
    assert m.fetch_cache(["img2.jpg"], "p2")[1] is False


def test_python_objects_kept_as_they_are_in_memory():
    m = MLLMCacheManager()
    original = [[1, 2, 3]]
    m.store_cache(["a.jpg"], "p", original)
    cache, hit = m.fetch_cache(["a.jpg"], "p")
    assert hit and cache is original  # as vllm-mlx: arbitrary objects by reference


def test_python_objects_refused_by_persistent_backend(tmp_path):
    m = MLLMCacheManager(backend=f"file://{tmp_path}")
    with pytest.raises(TypeError, match="not an MLX array or cache.*memory://"):
        m.store_cache(["a.jpg"], "p", ["kv_layer_1"])
    with pytest.raises(TypeError, match="vision_embeddings"):
        m.store(["a.jpg"], "p", object(), kv(2), [1, 2])
    assert len(m) == 0


# ---------------------------------------------------------------- defects fixed


def test_swapped_images_miss(images):
    a, b = images[:2]
    m = MLLMCacheManager()
    m.store([a, b], "Compare", mx.ones((2, 4)), kv(4), [1, 2, 3, 4])
    assert m.fetch([a, b], "Compare", [1, 2, 3, 4])[1] == 4
    assert m.fetch([b, a], "Compare", [1, 2, 3, 4]) == (None, 0)  # vllm-mlx: a hit
    assert m.fetch_cache([b, a], "Compare") == (None, False)


def test_storing_a_key_twice_counts_once_and_refreshes_lru():
    m = MLLMCacheManager(max_entries=3)
    one = payloads.true_nbytes(kv(8))
    for i in range(3):
        m.store([f"i{i}"], "p", None, kv(8, i), list(range(8)))
    m.store(["i0"], "p", None, kv(8, 9), list(range(8)))  # again: i0 is now the newest
    assert len(m) == 3 and m.get_stats()["memory_used_mb"] * 2**20 == 3 * one
    m.store(["i3"], "p", None, kv(8), list(range(8)))
    assert m.fetch_cache(["i1"], "p")[1] is False  # the oldest went, not i0
    cache, hit = m.fetch_cache(["i0"], "p")
    assert hit and bits(cache) == bits(kv(8, 9))  # the second store replaced the first


def test_oversize_entry_refused_with_warning_and_nothing_flushed(caplog):
    m = MLLMCacheManager(max_memory_mb=1)
    m.store(["small"], "p", None, kv(4), [1, 2, 3, 4])
    big = [KVCache()]
    big[0].update_and_fetch(mx.zeros((1, 8, 4096, 16)), mx.zeros((1, 8, 4096, 16)))  # 4 MiB
    with caplog.at_level(logging.WARNING):
        m.store(["big"], "p", None, big, list(range(4096)))
    assert "larger than max_memory_mb" in caplog.text
    assert len(m) == 1 and m.fetch_cache(["small"], "p")[1] is True
    assert m.fetch_cache(["big"], "p")[1] is False and m.stats.evictions == 0


@pytest.mark.parametrize("limits", [{"max_entries": 0}, {"max_memory_mb": 0}])
def test_limits_of_zero_store_nothing(limits):
    m = MLLMCacheManager(**limits)
    m.store(["a"], "p", mx.ones(3), kv(2), [1, 2])
    m.store_cache(["a"], "q", ["x"], 3)
    assert len(m) == 0 and m.fetch(["a"], "p", [1, 2]) == (None, 0)


def test_true_byte_sizes_for_quantized_cache():
    q = QuantizedKVCache(group_size=32, bits=8)
    x = mx.random.normal((1, 2, 10, 64))
    q.update_and_fetch(x, x)
    want = sum(a[..., :10, :].nbytes for part in (q.keys, q.values) for a in part)
    entry = MLLMPrefixCacheEntry(image_hash="", prompt_hash="", kv_cache=[q])
    assert entry.memory_size == want > 0  # vllm-mlx: 0 (its state is tuples of arrays)
    m = MLLMCacheManager()
    m.store(["a"], "p", mx.zeros((5, 8)), [q], list(range(10)))
    assert m.get_stats()["memory_used_mb"] * 2**20 == want + 5 * 8 * 4
    kv_entry = MLLMPrefixCacheEntry(image_hash="", prompt_hash="", kv_cache=kv(10))
    assert kv_entry.memory_size == 2 * 2 * (2 * 10 * 8 * 4)


def test_every_cache_class_round_trips_with_true_sizes(tmp_path):
    from mlx_lm.models.cache import KVCache as LmKVCache
    from mlx_vlm.models import cache as C

    from mlxcache.serializers import cache_nbytes, dump_prompt_cache

    x = mx.random.normal((1, 2, 10, 64), key=mx.random.key(3))
    caches = [
        C.RotatingKVCache(max_size=8),
        C.QuantizedKVCache(group_size=32, bits=4),
        C.ChunkedKVCache(chunk_size=4),
        LmKVCache(),
    ]
    for c in caches:
        c.update_and_fetch(x, x)
    arrays = C.ArraysCache(2)
    arrays[0], arrays[1] = mx.ones((1, 3, 4)), mx.zeros((1, 5))
    caches.append(arrays)
    m = MLLMCacheManager(backend=f"file://{tmp_path}")
    m.store(["i"], "p", None, caches, list(range(10)))
    entry, n = m.fetch(["i"], "p", list(range(10)))
    assert n == 10 and [type(c) for c in entry.kv_cache] == [type(c) for c in caches]
    want = dump_prompt_cache(caches).arrays
    got = dump_prompt_cache(entry.kv_cache).arrays
    assert sorted(got) == sorted(want)
    for name, a in want.items():
        assert got[name].view(mx.uint8).tolist() == a.view(mx.uint8).tolist(), name
    size = cache_nbytes(caches)
    assert entry.memory_size == size and m.get_stats()["memory_used_mb"] * 2**20 == size


def test_stored_kv_never_aliases_the_callers_or_other_fetches():
    m = MLLMCacheManager()
    cache = kv(6)
    want = bits(cache)
    m.store(["a"], "p", None, cache, list(range(6)))
    cache[0].trim(3)  # the caller keeps using its cache: trim, then write over the buffer
    cache[0].update_and_fetch(mx.full((1, 2, 3, 8), 7.0), mx.full((1, 2, 3, 8), 7.0))
    first, _ = m.fetch(["a"], "p", list(range(6)))
    assert bits(first.kv_cache) == want
    first.kv_cache[0].trim(6)
    first.kv_cache[0].update_and_fetch(mx.zeros((1, 2, 1, 8)), mx.zeros((1, 2, 1, 8)))
    second, _ = m.fetch(["a"], "p", list(range(6)))
    assert second.kv_cache[0] is not first.kv_cache[0] and bits(second.kv_cache) == want


def test_threads_store_and_fetch_safely():
    m = MLLMCacheManager(max_entries=12)
    caches = [kv(4, s) for s in range(4)]

    def work(t: int) -> None:
        for i in range(15):
            key = f"img{(t * 7 + i) % 20}"
            m.store([key], "p", None, caches[i % 4], [t, i, 0, 0])
            entry, n = m.fetch([key], "p", [t, i, 0, 0])
            assert entry is None or 0 <= n <= 4
            m.fetch_cache([f"img{i}"], "p")

    assert run_threads(work, 6) == []
    s = m.get_stats()
    assert s["total_queries"] == 6 * 15 * 2 == s["hits"] + s["misses"]
    assert len(m) <= 12 and s["entries"] == len(m)
    one = payloads.true_nbytes(kv(4))
    assert s["memory_used_mb"] * 2**20 == len(m) * one


def test_image_only_lookup_uses_the_index_not_a_scan():
    backend = CountingBackend()
    m = MLLMCacheManager(max_entries=100, backend=backend)
    for i in range(40):
        m.store([f"other{i}"], "p", mx.ones((2, 2)), kv(2), [i, 1])
    m.store(["x.jpg"], "first prompt", mx.full((3, 4), 5.0), kv(3), [7, 8, 9])
    backend.reads = 0
    entry, n = m.fetch(["x.jpg"], "a new prompt")
    assert n == 0 and entry.vision_embeddings.tolist() == [[5.0] * 4] * 3
    assert backend.reads <= 3  # exact key, the images' index, the entry
    assert m.stats.partial_hits == 1 and m.stats.vision_encoder_skips == 1
    # the legacy API never hands out another prompt's KV as a hit (vllm-mlx does)
    assert m.fetch_cache(["x.jpg"], "a new prompt") == (None, False)


def test_internal_keys_use_full_width_digests():
    backend = MemoryBackend()
    m = MLLMCacheManager(backend=backend)
    m.store(["a.jpg", "b.jpg"], "p", None, kv(2), [1, 2])
    (key,) = list(backend.keys("mllm.e."))
    images_hex, prompt_hex = key[len("mllm.e.") :].split(".")
    assert len(images_hex) == 64 and len(prompt_hex) == 64
    assert prompt_hex == hashlib.sha256(b"p").hexdigest()
    entry, _ = m.fetch(["a.jpg", "b.jpg"], "p")
    assert entry.image_hash == compute_images_hash(["a.jpg", "b.jpg"])  # public field: 16 hex


# ---------------------------------------------------------------- prefix matching


def test_fetch_returns_longest_prefix_among_entries_with_same_images(images):
    m = MLLMCacheManager()
    turn1 = list(range(100, 120))
    m.store([images[0]], "turn 1", mx.ones((2, 2)), kv(20, 1), turn1, num_image_tokens=4)
    m.store([images[0]], "short", None, kv(5, 2), turn1[:5])
    turn2 = turn1 + [7, 8, 9]
    entry, n = m.fetch([images[0]], "turn 2", turn2)
    assert n == 20 and entry.token_ids == turn1 and entry.num_image_tokens == 4
    assert bits(entry.kv_cache) == bits(kv(20, 1))
    assert m.stats.hits == 1 and m.stats.tokens_saved == 20 and m.stats.partial_hits == 0
    # a divergence after 12 tokens: still the 20-token entry, 12 tokens usable
    entry, n = m.fetch([images[0]], "edited", turn1[:12] + [0, 0])
    assert n == 12 and entry.token_ids == turn1 and m.stats.partial_hits == 1
    # the same tokens with other images, or images swapped, never match
    assert m.fetch([images[1]], "turn 2", turn2) == (None, 0)
    # without token ids only the exact prompt hits
    assert m.fetch([images[0]], "turn 2")[0].vision_embeddings is not None  # vision only
    assert m.fetch([images[0]], "turn 2")[1] == 0


def test_prefix_hits_are_verified_against_the_stored_tokens():
    backend = MemoryBackend()
    m = MLLMCacheManager(backend=backend)
    m.store(["a"], "p", None, kv(4), [1, 2, 3, 4])
    (ikey,) = list(backend.keys("mllm.i."))
    rec = backend.get(ikey)
    forged = [
        dict(i, tokens=np.asarray([9, 9, 9, 9], dtype=np.int64).tobytes())
        for i in rec.meta["entries"]
    ]
    backend.put(ikey, type(rec)(meta={**rec.meta, "entries": forged}))
    assert m.fetch(["a"], "q", [9, 9, 9, 9]) == (None, 0)  # the index lied: a miss
    assert m.fetch(["a"], "q", [1, 2, 3, 9])[1] == 0  # stale index: not found, never wrong


def test_legacy_dummy_tokens_never_match_other_prompts():
    m = MLLMCacheManager()
    m.store_cache(["a"], "p", kv(3), num_tokens=3)  # token ids [0, 0, 0]
    assert m.fetch(["a"], "q", [0, 0, 0, 5]) == (None, 0)
    assert m.fetch(["a"], "p", [0, 0, 0, 5])[1] == 3  # its own prompt still hits


# ---------------------------------------------------------------- persistence across processes

CHILD = """
import sys
import mlx.core as mx
from mlx_vlm.models.cache import KVCache
from mlxcache.mllm_cache import MLLMPrefixCacheManager
m = MLLMPrefixCacheManager(backend=sys.argv[1])
c = KVCache()
x = mx.arange(2 * 9 * 8, dtype=mx.float32).reshape(1, 2, 9, 8).astype(mx.bfloat16)
c.update_and_fetch(x, -x)
m.store([b"PNG-bytes-1", b"PNG-bytes-2"], "child prompt", mx.full((4, 8), 3.5), [c],
        list(range(50, 59)), num_image_tokens=2, model_name="tiny")
"""


def child_store(uri: str) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT)
    code = textwrap.dedent(CHILD)
    subprocess.run([sys.executable, "-c", code, uri], check=True, env=env, timeout=120)


def check_child_entry(m: MLLMPrefixCacheManager) -> None:
    imgs = [b"PNG-bytes-1", b"PNG-bytes-2"]
    entry, n = m.fetch(imgs, "follow-up", list(range(50, 59)) + [1, 2])
    assert n == 9 and entry.model_name == "tiny" and entry.num_image_tokens == 2
    x = mx.arange(2 * 9 * 8, dtype=mx.float32).reshape(1, 2, 9, 8).astype(mx.bfloat16)
    k, v = entry.kv_cache[0].state[:2]
    assert k.dtype == mx.bfloat16 and entry.kv_cache[0].offset == 9
    assert k.view(mx.uint16).tolist() == x.view(mx.uint16).tolist()
    assert v.view(mx.uint16).tolist() == (-x).view(mx.uint16).tolist()
    assert entry.vision_embeddings.tolist() == [[3.5] * 8] * 4
    assert m.fetch(imgs[::-1], "child prompt", list(range(50, 59))) == (None, 0)


def test_file_backend_shared_by_processes_and_survives_restart(tmp_path):
    uri = f"file://{tmp_path}/cache"
    child_store(uri)
    m = MLLMCacheManager(backend=uri)
    assert len(m) == 1  # warm start from the index records, no tensors read
    check_child_entry(m)
    m.store(["z"], "p", None, kv(3), [1, 2, 3])
    m.close()
    again = MLLMCacheManager(backend=uri)
    assert len(again) == 2 and again.fetch_cache(["z"], "p")[1] is True
    again.clear()
    assert len(MLLMCacheManager(backend=uri)) == 0


def test_redis_backend_shared_by_processes(redis_url):
    child_store(redis_url)
    m = MLLMCacheManager(backend=redis_url)
    assert len(m) == 1
    check_child_entry(m)
    m.clear()
    assert m.fetch_cache([b"PNG-bytes-1", b"PNG-bytes-2"], "child prompt") == (None, False)


# ---------------------------------------------------------------- vllm-mlx's callers, ported


@pytest.mark.parametrize("where", ["memory", "file"])
def test_vllm_mlx_callers_run_unchanged(tmp_path, images, where):
    """The calls of vllm-mlx's models/mllm.py (MLXMultimodalLM generate/chat/get_cache_stats/
    clear_cache), as written there, with a real model's prompt cache."""
    import copy

    from mlx_vlm.models import cache as vlm_cache

    from mlxcache.tiny_models import build_model

    model = build_model("qwen2_vl")[0]
    backend = "memory://" if where == "memory" else f"file://{tmp_path}/c"
    cache_manager = MLLMPrefixCacheManager(max_entries=50, backend=backend)  # __init__

    # generate(): fetch_cache, make_prompt_cache on a miss (empty caches), store_cache
    all_sources = [images[0], "video:clip.mp4:fps2.0:max32"]
    prompt_cache, cache_hit = cache_manager.fetch_cache(all_sources, "Describe")
    assert (prompt_cache, cache_hit) == (None, False)
    prompt_cache = vlm_cache.make_prompt_cache(model.language_model)
    cache_manager.store_cache(all_sources, "Describe", prompt_cache, 500)  # before prefill
    ids = mx.array([list(range(1, 13))])
    model.language_model(ids, cache=prompt_cache)
    mx.eval([c.state for c in prompt_cache])
    cache_manager.store_cache(all_sources, "Describe", prompt_cache, 12)
    cached, hit = cache_manager.fetch_cache(all_sources, "Describe")
    assert hit and [c.offset for c in cached] == [12] * len(prompt_cache)
    assert bits(cached) == bits(prompt_cache)

    # chat(): fetch with token ids, deepcopy of a hit, store of trimmed copies
    token_ids = list(range(1, 13))
    cache_entry, prefix_match_len = cache_manager.fetch([images[1]], "chat", token_ids)
    assert cache_entry is None and prefix_match_len == 0
    prompt_tokens_count = 8
    cache_to_store = []
    for layer_cache in prompt_cache:
        new_cache = copy.copy(layer_cache)
        state = layer_cache.state
        keys, values = mx.array(state[0]), mx.array(state[1])
        if layer_cache.offset > prompt_tokens_count:
            new_cache.keys = keys[:, :, :prompt_tokens_count, :]
            new_cache.values = values[:, :, :prompt_tokens_count, :]
            new_cache.offset = prompt_tokens_count
        cache_to_store.append(new_cache)
    cache_manager.store(
        images=[images[1]],
        prompt="chat",
        vision_embeddings=None,
        kv_cache=cache_to_store,
        token_ids=token_ids[:8],
        num_image_tokens=256,
        model_name="tiny-qwen2-vl",
    )
    cache_entry, prefix_match_len = cache_manager.fetch([images[1]], "chat 2", token_ids)
    assert prefix_match_len == 8 and cache_entry.model_name == "tiny-qwen2-vl"
    assert cache_entry.num_text_tokens == 8 - 256  # as vllm-mlx computes it
    assert cache_entry.vision_embeddings is None and cache_entry.kv_cache
    restored = copy.deepcopy(cache_entry.kv_cache)
    assert bits(restored) == bits(cache_to_store)

    # get_cache_stats() / clear_cache()
    stats = cache_manager.get_stats()
    stats["enabled"] = True
    stats["cache_entries"] = len(cache_manager)
    stats["max_entries"] = cache_manager.max_size
    assert stats["cache_entries"] == stats["entries"] == 2 and stats["max_entries"] == 50
    assert stats["hits"] == 2 and stats["misses"] == 2 and stats["memory_used_mb"] > 0
    cache_manager.clear()
    assert len(cache_manager) == 0


# ---------------------------------------------------------------- robustness


@pytest.mark.parametrize("where", ["memory", "file"])
def test_fresh_caches_of_every_class_are_stored_as_caches(tmp_path, where):
    """An empty QuantizedKVCache's ``state`` raises TypeError, an empty ChunkedKVCache's
    AttributeError: fresh caches (make_prompt_cache before a prefill) were rejected or kept
    by reference."""
    from cache_cases import EMPTY

    from mlxcache.serializers import cache_nbytes

    backend = MemoryBackend() if where == "memory" else f"file://{tmp_path}/c"
    m = MLLMCacheManager(max_entries=100, backend=backend)
    for name, make in EMPTY.items():
        cache = [make()]
        entry = MLLMPrefixCacheEntry(image_hash="", prompt_hash="", kv_cache=cache)
        assert entry.memory_size == cache_nbytes(cache), name
        m.store_cache(["a"], name, cache, num_tokens=3)
        got, hit = m.fetch_cache(["a"], name)
        assert hit and type(got[0]) is type(cache[0]) and got[0] is not cache[0], name


def test_damaged_records_are_misses_never_exceptions(tmp_path):
    from mlxcache.records.record import Record

    uri = f"file://{tmp_path}/c"
    m = MLLMCacheManager(backend=uri)
    m.store(["a"], "p", mx.ones((2, 2)), kv(4), [1, 2, 3, 4])
    backend = m._backend
    (key,) = list(backend.keys("mllm.e."))
    (ikey,) = list(backend.keys("mllm.i."))
    backend.put(key, Record(meta={"v": 1, "other": "layout"}))
    assert m.fetch(["a"], "p", [1, 2, 3, 4]) == (None, 0)
    assert m.fetch(["a"], "q") == (None, 0)  # the vision-only path too
    for entries in ([{"no": "key"}, {"key": key, "tokens": b"odd"}, 7], "not a list"):
        backend.put(ikey, Record(meta={"v": 1, "entries": entries}))
        assert len(MLLMCacheManager(backend=uri)) == 0  # warm start
        assert m.fetch(["a"], "q", [1, 2, 3, 4]) == (None, 0)


def test_index_lines_of_gone_entries_are_dropped(tmp_path):
    m = MLLMCacheManager(backend=f"file://{tmp_path}/c")
    m.store(["a"], "p", mx.ones((2, 2)), kv(4), [1, 2, 3, 4])
    m.store(["a"], "q", None, kv(4, 1), [1, 2, 5, 6])
    p_key = m._keys(["a"], "p")[1]
    m._backend.delete(p_key)  # another process evicted it
    group = m._keys(["a"], "p")[0]
    entry, n = m.fetch(["a"], "r", [1, 2, 3, 4, 9])
    assert n == 2 and entry.token_ids == [1, 2, 5, 6]  # the other entry, verified
    assert [i["key"] for i in m._read_index(group)] == [m._keys(["a"], "q")[1]]


def test_entries_gone_from_the_backend_do_not_evict_live_ones(tmp_path):
    m = MLLMCacheManager(max_entries=2, backend=f"file://{tmp_path}/c")
    m.store(["a"], "p", None, kv(4, 1), [1, 2, 3, 4])
    m.store(["b"], "p", None, kv(4, 2), [1, 2, 3, 4])
    m._backend.delete(m._keys(["b"], "p")[1])  # another process evicted the newer one
    m.store(["c"], "p", None, kv(4, 3), [1, 2, 3, 4])
    assert m.fetch_cache(["a"], "p")[1] is True  # was evicted for b's phantom bytes
    assert len(m) == 2 and m.stats.evictions == 0
    assert m.get_stats()["memory_used_mb"] * 2**20 == 2 * payloads.true_nbytes(kv(4))


def test_entry_the_backend_refuses_is_not_counted(tmp_path, caplog):
    m = MLLMCacheManager(backend=f"file://{tmp_path}/c?max_bytes=1000")
    with caplog.at_level(logging.WARNING):
        m.store(["a"], "p", None, kv(8), list(range(8)))  # 2 KiB > the folder's 1000 bytes
    assert "did not keep" in caplog.text
    assert len(m) == 0 and m.get_stats()["memory_used_mb"] == 0
    assert m.fetch(["a"], "p", list(range(8))) == (None, 0)


def test_dead_redis_is_a_miss_and_nothing_is_counted(redis_server, redis_url):
    url = redis_url + "?timeout=0.5&backoff=0.01&max_backoff=0.02"
    m = MLLMCacheManager(backend=url)
    m.store(["a"], "p", mx.ones((2, 2)), kv(4), [1, 2, 3, 4])
    redis_server.stop()
    try:
        m.store(["b"], "p", None, kv(4), [1, 2, 3, 4])
        assert len(m) == 1  # only the entry stored while Redis was up
        assert m.fetch(["a"], "p", [1, 2, 3, 4]) == (None, 0)
        assert m.fetch(["b"], "q") == (None, 0) and m.fetch_cache(["b"], "p") == (None, False)
        assert len(MLLMCacheManager(backend=url)) == 0
        m.clear()
    finally:
        redis_server.start()
    time.sleep(0.05)  # past the reconnect backoff
    m.store(["b"], "p", None, kv(4), [1, 2, 3, 4])
    assert m.fetch_cache(["b"], "p")[1] is True


def test_threads_store_fetch_and_clear_on_a_shared_folder(tmp_path):
    m = MLLMCacheManager(max_entries=6, backend=f"file://{tmp_path}/c")

    def work(t: int) -> None:
        for i in range(12):
            c = KVCache()
            x = mx.random.normal((1, 2, 4, 8))  # lazy, built on this thread
            c.update_and_fetch(x, x)
            m.store([f"i{(t + i) % 5}"], "p", mx.ones((2, 2)), [c], [t, i, 1, 2])
            entry, n = m.fetch([f"i{(t + i) % 5}"], "q", [t, i, 1, 2, 3])
            if entry is not None:
                mx.eval(entry.kv_cache[0].state)
            if t == 0 and i % 5 == 2:
                m.clear()

    assert run_threads(work, 4) == []
    on_disk = set(m._backend.keys("mllm.e."))
    assert set(m._lru.items) == on_disk and len(m) <= 6
    indexed = {i["key"] for k in m._backend.keys("mllm.i.") for i in m._read_index(k[7:])}
    assert indexed == on_disk
