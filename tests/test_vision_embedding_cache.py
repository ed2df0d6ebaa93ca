"""mlxcache.vision_embedding_cache: the vllm-mlx API, its defects fixed, persistence."""

from __future__ import annotations

import inspect
import logging
import os
import subprocess
import sys
import textwrap
from dataclasses import MISSING

import mlx.core as mx
import pytest
from threads import run_threads

from mlxcache import mllm_cache
from mlxcache import vision_embedding_cache as vec
from mlxcache.vision_embedding_cache import (
    EncodingCacheEntry,
    PixelCacheEntry,
    PixelOnlyCacheEntry,
    VisionCacheStats,
    VisionEmbeddingCache,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E = inspect.Parameter.empty
POS = "POSITIONAL_OR_KEYWORD"
KW = "KEYWORD_ONLY"


def params(fn) -> list[tuple[str, object, str]]:
    return [
        (p.name, p.default, p.kind.name)
        for p in inspect.signature(fn).parameters.values()
        if p.name != "self"
    ]


def pixels(fill: float, n: int = 16) -> mx.array:
    a = mx.full((1, 3, n, n), fill)
    mx.eval(a)
    return a


def store_pixels(cache, images, prompt="what color?", extra=None, fill=1.0, n=16):
    cache.set_pixel_cache(
        images=images,
        prompt=prompt,
        pixel_values=pixels(fill, n),
        input_ids=mx.array([[1, 2, 3]]),
        image_grid_thw=mx.array([[1, 4, 4]]),
        extra_kwargs=extra,
        processing_time=0.25,
    )


# ---------------------------------------------------------------- the vllm-mlx API surface


def test_signatures_match_vllm_mlx_plus_budget_and_backend():
    C = VisionEmbeddingCache
    assert params(C.__init__) == [
        ("max_pixel_entries", 100, POS),
        ("max_encoding_entries", 50, POS),
        ("enabled", True, POS),
        ("max_memory_mb", 2048, KW),
        ("backend", "memory://", KW),
    ]
    assert params(C.get_pixel_cache) == [("images", E, POS), ("prompt", E, POS)]
    assert params(C.set_pixel_cache) == [
        ("images", E, POS), ("prompt", E, POS), ("pixel_values", E, POS),
        ("input_ids", E, POS), ("attention_mask", None, POS), ("image_grid_thw", None, POS),
        ("extra_kwargs", None, POS), ("processing_time", 0.0, POS),
    ]  # fmt: skip
    assert params(C.get_pixel_values) == [("images", E, POS)]
    assert params(C.set_pixel_values) == [
        ("images", E, POS), ("pixel_values", E, POS), ("image_grid_thw", None, POS),
        ("processing_time", 0.0, POS),
    ]  # fmt: skip
    assert params(C.get_encoding_cache) == [("images", E, POS), ("prompt", E, POS)]
    assert params(C.set_encoding_cache) == [
        ("images", E, POS), ("prompt", E, POS), ("logits", E, POS), ("first_token", E, POS),
        ("logprobs", E, POS), ("encoding_time", 0.0, POS),
    ]  # fmt: skip
    for name in ("get_stats", "clear", "__repr__"):
        assert params(getattr(C, name)) == []
    assert vec.compute_image_hash is mllm_cache.compute_image_hash
    assert vec.compute_images_hash([]) == "no_images"


def test_dataclasses_as_in_vllm_mlx():
    def fields(cls):
        return [(n, f.default) for n, f in cls.__dataclass_fields__.items()]

    assert fields(PixelCacheEntry) == [
        ("pixel_values", MISSING), ("input_ids", MISSING), ("attention_mask", MISSING),
        ("image_grid_thw", MISSING), ("extra_kwargs", MISSING), ("processing_time", 0.0),
    ]  # fmt: skip
    assert fields(PixelOnlyCacheEntry) == [
        ("pixel_values", MISSING), ("image_grid_thw", MISSING), ("processing_time", 0.0),
    ]  # fmt: skip
    assert fields(EncodingCacheEntry) == [
        ("logits", MISSING), ("first_token", MISSING), ("logprobs", MISSING),
        ("encoding_time", 0.0),
    ]  # fmt: skip
    s = VisionCacheStats(pixel_cache_hits=1, pixel_cache_misses=3, encoding_cache_hits=1)
    assert s.pixel_hit_rate == 0.25 and s.encoding_hit_rate == 1.0
    assert VisionCacheStats().pixel_hit_rate == 0.0 == VisionCacheStats().encoding_hit_rate
    d = s.to_dict()
    for key in (
        "pixel_cache_hits", "pixel_cache_misses", "pixel_hit_rate", "encoding_cache_hits",
        "encoding_cache_misses", "encoding_hit_rate", "total_time_saved",
        "total_images_processed",
    ):  # fmt: skip
        assert key in d


def test_basic_hits_misses_stats_and_repr():
    c = VisionEmbeddingCache(max_pixel_entries=50, max_encoding_entries=20)
    assert repr(c) == "<VisionEmbeddingCache pixel=0/50 pixel_only=0/50 encoding=0/20>"
    assert c.get_pixel_cache(["a.jpg"], "p") is None
    store_pixels(c, ["a.jpg"], "p")
    e = c.get_pixel_cache(["a.jpg"], "p")
    assert isinstance(e, PixelCacheEntry) and e.pixel_values.tolist() == pixels(1.0).tolist()
    assert e.input_ids.tolist() == [[1, 2, 3]] and e.attention_mask is None
    assert e.image_grid_thw.tolist() == [[1, 4, 4]] and e.extra_kwargs == {}
    assert c.get_pixel_cache(["a.jpg"], "other") is None
    c.set_encoding_cache(["a.jpg"], "p", mx.ones((1, 5)), 42, mx.zeros((1, 5)), 1.5)
    enc = c.get_encoding_cache(["a.jpg"], "p")
    assert enc.first_token == 42 and enc.encoding_time == 1.5 and enc.logits.shape == (1, 5)
    assert c.get_encoding_cache(["b.jpg"], "p") is None
    c.set_pixel_values(["a.jpg"], pixels(2.0), mx.array([[1, 2, 2]]), 0.5)
    only = c.get_pixel_values(["a.jpg"])
    assert isinstance(only, PixelOnlyCacheEntry) and only.processing_time == 0.5
    s = c.get_stats()
    assert (s["pixel_cache_hits"], s["pixel_cache_misses"]) == (1, 2)
    assert (s["encoding_cache_hits"], s["encoding_cache_misses"]) == (1, 1)
    assert s["total_time_saved"] == 0.25 + 1.5 + 0.5 and s["total_images_processed"] == 1
    assert (s["pixel_cache_size"], s["pixel_only_cache_size"], s["encoding_cache_size"]) == (
        1, 1, 1,
    )  # fmt: skip
    assert repr(c) == "<VisionEmbeddingCache pixel=1/50 pixel_only=1/50 encoding=1/20>"
    c.clear()
    assert c.get_stats()["pixel_cache_size"] == 0 and c.get_pixel_values(["a.jpg"]) is None
    assert c.stats.pixel_only_cache_misses == 1 and c.stats.pixel_cache_hits == 0


def test_disabled_or_no_images_do_nothing():
    c = VisionEmbeddingCache(enabled=False)
    store_pixels(c, ["a.jpg"])
    assert c.get_pixel_cache(["a.jpg"], "what color?") is None
    c = VisionEmbeddingCache()
    store_pixels(c, [])
    assert c.get_pixel_cache([], "what color?") is None
    assert c.stats.to_dict()["pixel_cache_misses"] == 0 and c.get_stats()["pixel_cache_size"] == 0


def test_lru_by_count_per_level():
    c = VisionEmbeddingCache(max_pixel_entries=2, max_encoding_entries=1)
    store_pixels(c, ["a"])
    store_pixels(c, ["b"])
    c.get_pixel_cache(["a"], "what color?")  # a is now the newest
    store_pixels(c, ["c"])
    assert c.get_pixel_cache(["b"], "what color?") is None
    assert c.get_pixel_cache(["a"], "what color?") is not None
    c.set_encoding_cache(["a"], "p", mx.ones(2), 1, mx.ones(2))
    c.set_encoding_cache(["b"], "p", mx.ones(2), 2, mx.ones(2))
    assert c.get_encoding_cache(["a"], "p") is None and c.get_encoding_cache(["b"], "p")
    assert c.get_stats()["pixel_cache_size"] == 2  # levels evict independently


# ---------------------------------------------------------------- defects fixed


@pytest.mark.parametrize("limits", [(0, 0), (0, 5), (5, 0)])
def test_limits_of_zero_never_raise_and_store_nothing(limits):
    c = VisionEmbeddingCache(max_pixel_entries=limits[0], max_encoding_entries=limits[1])
    store_pixels(c, ["a"])  # vllm-mlx: StopIteration
    c.set_pixel_values(["a"], pixels(1.0))
    c.set_encoding_cache(["a"], "p", mx.ones(2), 1, mx.ones(2))
    s = c.get_stats()
    assert s["pixel_cache_size"] == s["pixel_only_cache_size"] == (0 if not limits[0] else 1)
    assert s["encoding_cache_size"] == (0 if not limits[1] else 1)


def test_zero_byte_budget_stores_nothing():
    c = VisionEmbeddingCache(max_memory_mb=0)
    store_pixels(c, ["a"])
    assert c.get_pixel_cache(["a"], "what color?") is None


def test_extra_kwargs_copied_both_ways():
    c = VisionEmbeddingCache()
    extra = {"image_sizes": [(16, 16)], "mask": mx.ones((2,)), "flag": True}
    store_pixels(c, ["a"], extra=extra)
    extra["image_sizes"].append((1, 1))  # the caller reuses its dict
    extra["flag"] = False
    extra["mask"][0] = 5.0
    got = c.get_pixel_cache(["a"], "what color?").extra_kwargs
    assert got["image_sizes"] == [(16, 16)] and got["flag"] is True  # tuples stay tuples
    assert got["mask"].tolist() == [1.0, 1.0]
    got["image_sizes"].clear()
    got["new"] = 1
    again = c.get_pixel_cache(["a"], "what color?").extra_kwargs
    assert again == {"image_sizes": [(16, 16)], "mask": again["mask"], "flag": True}


def test_stored_arrays_never_alias_the_callers():
    c = VisionEmbeddingCache()
    pv = pixels(1.0)
    c.set_pixel_values(["a"], pv)
    pv[0] = 9.0  # in-place write on the caller's array object
    first = c.get_pixel_values(["a"])
    assert first.pixel_values.max().item() == 1.0
    first.pixel_values[0] = 7.0
    assert c.get_pixel_values(["a"]).pixel_values.max().item() == 1.0


def test_pixel_and_pixel_only_have_separate_counters():
    c = VisionEmbeddingCache()
    c.set_pixel_values(["a"], pixels(1.0))
    c.get_pixel_values(["a"])
    c.get_pixel_values(["b"])
    s = c.stats
    assert (s.pixel_cache_hits, s.pixel_cache_misses) == (0, 0)  # vllm-mlx: 1, 1
    assert (s.pixel_only_cache_hits, s.pixel_only_cache_misses) == (1, 1)
    assert s.pixel_only_hit_rate == 0.5 and c.get_stats()["pixel_only_hit_rate"] == 0.5


def test_byte_budget_evicts_lru_across_levels_and_refuses_oversize(caplog):
    c = VisionEmbeddingCache(max_memory_mb=1)
    one = pixels(1.0, 256).nbytes  # 768 KiB
    c.set_pixel_values(["a"], pixels(1.0, 256))
    c.set_encoding_cache(["a"], "p", mx.ones(4), 1, mx.ones(4))
    c.set_pixel_values(["b"], pixels(2.0, 256))  # a's pixels go: 2 x 768 KiB > 1 MiB
    assert c.get_pixel_values(["a"]) is None and c.get_pixel_values(["b"]) is not None
    assert c.get_encoding_cache(["a"], "p") is not None  # small and newer: kept
    assert c.get_stats()["memory_used_mb"] * 2**20 == one + 32
    with caplog.at_level(logging.WARNING):
        c.set_pixel_values(["huge"], pixels(1.0, 400))  # 1.9 MiB
    assert "larger than max_memory_mb" in caplog.text
    assert c.get_pixel_values(["huge"]) is None and c.get_pixel_values(["b"]) is not None


def test_swapped_images_miss():
    c = VisionEmbeddingCache()
    store_pixels(c, ["a", "b"])
    c.set_pixel_values(["a", "b"], pixels(1.0))
    assert c.get_pixel_cache(["b", "a"], "what color?") is None  # vllm-mlx: a hit
    assert c.get_pixel_values(["b", "a"]) is None
    assert c.get_pixel_cache(["a", "b"], "what color?") is not None


def test_python_objects_memory_vs_persistent(tmp_path):
    marker = object()
    c = VisionEmbeddingCache()
    store_pixels(c, ["a"], extra={"obj": marker})
    assert c.get_pixel_cache(["a"], "what color?").extra_kwargs["obj"] is not None
    p = VisionEmbeddingCache(backend=f"file://{tmp_path}")
    with pytest.raises(TypeError, match=r"extra_kwargs\['obj'\].*memory://"):
        store_pixels(p, ["a"], extra={"obj": marker})
    with pytest.raises(TypeError, match="pixel_values"):
        p.set_pixel_values(["a"], object())


def test_threads_set_and_get_safely():
    c = VisionEmbeddingCache(max_pixel_entries=8, max_encoding_entries=4)

    def work(t: int) -> None:
        for i in range(20):
            imgs = [f"img{(t + i) % 12}"]
            c.set_pixel_values(imgs, mx.full((4, 4), float(i)))
            e = c.get_pixel_values(imgs)
            assert e is None or e.pixel_values.shape == (4, 4)
            c.set_encoding_cache(imgs, "p", mx.ones(3), i, mx.ones(3))
            c.get_encoding_cache(imgs, "p")

    assert run_threads(work, 6) == []
    s = c.get_stats()
    assert s["pixel_only_cache_hits"] + s["pixel_only_cache_misses"] == 120
    assert s["pixel_only_cache_size"] <= 8 and s["encoding_cache_size"] <= 4


# ---------------------------------------------------------------- persistence across processes

CHILD = """
import sys
import mlx.core as mx
from mlxcache.vision_embedding_cache import VisionEmbeddingCache
c = VisionEmbeddingCache(backend=sys.argv[1])
pv = mx.arange(3 * 8 * 8, dtype=mx.float32).reshape(1, 3, 8, 8).astype(mx.bfloat16)
c.set_pixel_cache([b"IMG-A", b"IMG-B"], "describe", pv, mx.array([[5, 6, 7]]),
                  image_grid_thw=mx.array([[1, 2, 2]]),
                  extra_kwargs={"image_sizes": [(8, 8)], "scale": mx.array([0.5])},
                  processing_time=0.75)
c.set_encoding_cache([b"IMG-A"], "describe", mx.ones((1, 4)), 11, mx.zeros((1, 4)), 2.0)
"""


def check_child(uri: str) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT)
    subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), uri], check=True, env=env, timeout=120
    )
    c = VisionEmbeddingCache(backend=uri)
    e = c.get_pixel_cache([b"IMG-A", b"IMG-B"], "describe")
    pv = mx.arange(3 * 8 * 8, dtype=mx.float32).reshape(1, 3, 8, 8).astype(mx.bfloat16)
    assert e.pixel_values.dtype == mx.bfloat16
    assert e.pixel_values.view(mx.uint16).tolist() == pv.view(mx.uint16).tolist()
    assert e.input_ids.tolist() == [[5, 6, 7]] and e.image_grid_thw.tolist() == [[1, 2, 2]]
    assert e.extra_kwargs["image_sizes"] == [(8, 8)] and e.processing_time == 0.75
    assert e.extra_kwargs["scale"].tolist() == [0.5]
    enc = c.get_encoding_cache([b"IMG-A"], "describe")
    assert enc.first_token == 11 and enc.logits.tolist() == [[1.0] * 4]
    assert c.get_pixel_cache([b"IMG-B", b"IMG-A"], "describe") is None
    assert c.get_stats()["pixel_cache_size"] == 1  # adopted on the hit
    c.clear()
    assert VisionEmbeddingCache(backend=uri).get_encoding_cache([b"IMG-A"], "describe") is None


def test_file_backend_shared_by_processes(tmp_path):
    check_child(f"file://{tmp_path}/vision")


def test_redis_backend_shared_by_processes(redis_url):
    check_child(redis_url)


# ---------------------------------------------------------------- vllm-mlx's callers, ported


def test_mllm_batch_generator_usage_runs_unchanged():
    """The calls of vllm-mlx's mllm_batch_generator.py, as written there."""
    vision_cache_size = 10
    vision_cache = VisionEmbeddingCache(
        max_pixel_entries=vision_cache_size,
        max_encoding_entries=vision_cache_size // 2,
        enabled=True,
    )
    all_images = ["data:image/png;base64,AAAA", "data:image/png;base64,BBBB"]
    assert vision_cache.get_pixel_cache([], "text only") is None  # text-only requests
    assert vision_cache.get_pixel_cache(all_images, "prompt") is None
    inputs = {
        "input_ids": mx.array([[1, 2, 3]]),
        "pixel_values": pixels(0.5),
        "attention_mask": mx.ones((1, 3), dtype=mx.int32),
        "image_grid_thw": mx.array([[1, 4, 4]]),
        "image_sizes": [[16, 16]],
        "second_per_grid_ts": None,
    }
    extra_kwargs = {
        k: v for k, v in inputs.items() if k not in ["input_ids", "pixel_values", "attention_mask"]
    }
    image_grid_thw = extra_kwargs.pop("image_grid_thw", None)
    vision_cache.set_pixel_cache(
        images=all_images,
        prompt="prompt",
        pixel_values=inputs["pixel_values"],
        input_ids=inputs["input_ids"],
        attention_mask=inputs["attention_mask"],
        image_grid_thw=image_grid_thw,
        extra_kwargs=extra_kwargs,
        processing_time=0.3,
    )
    extra_kwargs.clear()  # the generator releases the request's inputs after encoding
    cached_pixels = vision_cache.get_pixel_cache(all_images, "prompt")
    request_extra_kwargs = dict(cached_pixels.extra_kwargs)
    assert request_extra_kwargs == {"image_sizes": [[16, 16]], "second_per_grid_ts": None}
    assert cached_pixels.attention_mask.dtype == mx.int32
    assert cached_pixels.image_grid_thw.tolist() == [[1, 4, 4]]
    assert vision_cache.get_pixel_cache(all_images[::-1], "prompt") is None
    assert vision_cache.get_stats()["pixel_cache_size"] == 1


# ---------------------------------------------------------------- robustness


def test_live_extra_kwargs_values_are_copied_when_returned():
    import numpy as np

    c = VisionEmbeddingCache()
    store_pixels(c, ["a"], extra={"sizes": np.ones(3), "mixed": [mx.ones(1), 1]})
    got = c.get_pixel_cache(["a"], "what color?").extra_kwargs
    got["sizes"][0] = 5.0
    got["mixed"].append(9)
    again = c.get_pixel_cache(["a"], "what color?").extra_kwargs
    assert again["sizes"].tolist() == [1.0, 1.0, 1.0] and len(again["mixed"]) == 2


def test_damaged_record_is_a_miss(tmp_path):
    from mlxcache.records.record import Record

    c = VisionEmbeddingCache(backend=f"file://{tmp_path}/v")
    store_pixels(c, ["a"])
    (key,) = list(c._backend.keys("vis."))
    c._backend.put(key, Record(meta={"v": 1, "kind": "p", "fields": {}}))
    assert c.get_pixel_cache(["a"], "what color?") is None
    assert c.stats.pixel_cache_misses == 1


def test_entries_the_backend_did_not_keep_are_not_counted(tmp_path, redis_server, redis_url):
    c = VisionEmbeddingCache(backend=f"file://{tmp_path}/v?max_bytes=1000")
    store_pixels(c, ["a"])  # 3 KiB of pixels > the folder's 1000 bytes
    assert c.get_stats()["pixel_cache_size"] == 0 and c.stats.total_images_processed == 0
    r = VisionEmbeddingCache(backend=redis_url + "?timeout=0.5")
    redis_server.stop()
    try:
        store_pixels(r, ["a"])
        r.set_encoding_cache(["a"], "p", mx.ones(2), 1, mx.ones(2))
        assert r.get_pixel_cache(["a"], "what color?") is None
        assert r.get_encoding_cache(["a"], "p") is None
        s = r.get_stats()
        assert s["pixel_cache_size"] == s["encoding_cache_size"] == 0
    finally:
        redis_server.start()


def test_entries_gone_from_the_backend_do_not_evict_live_ones(tmp_path):
    c = VisionEmbeddingCache(max_pixel_entries=2, backend=f"file://{tmp_path}/v")
    c.set_pixel_values(["a"], pixels(1.0))
    c.set_pixel_values(["b"], pixels(2.0))
    c._backend.delete(c._key("o", ["b"]))  # another process evicted it
    c.set_pixel_values(["c"], pixels(3.0))
    assert c.get_pixel_values(["a"]) is not None
    assert c.get_stats()["pixel_only_cache_size"] == 2
