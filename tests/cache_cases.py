"""Cache objects of every supported class, filled reproducibly, and ways to compare them.

Shared by the serializer tests and the backend round-trip tests (which rebuild the same cases
in a child process from the same seeds).
"""

from __future__ import annotations

import zlib

import mlx.core as mx
import mlx_lm.models.cache as lmc
import mlx_vlm.models.cache as vlc

from mlxcache import Record
from mlxcache.records import format as st
from mlxcache.serializers import dump_prompt_cache, load_prompt_cache
from mlxcache.tiny_models import build_model

# ---------------------------------------------------------------- helpers


def bits(a: mx.array) -> tuple:
    """Everything that identifies an array's content: dtype, shape and raw bytes."""
    return (str(a.dtype), tuple(a.shape), bytes(memoryview(mx.contiguous(a))))


def tree_bits(x):
    """An array-free, comparable image of a nested structure (arrays -> bits)."""
    if isinstance(x, mx.array):
        return ("array", bits(x))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [tree_bits(v) for v in x])
    if isinstance(x, dict):
        return ("dict", [(k, tree_bits(v)) for k, v in x.items()])
    return ("value", type(x).__name__, x)


def record_bits(record: Record) -> dict:
    return {name: bits(a) for name, a in record.arrays.items()}


def roundtrip(obj, meta=None):
    """dump -> safetensors bytes -> parse -> load."""
    blob = st.to_bytes(dump_prompt_cache(obj, meta))
    return load_prompt_cache(st.from_bytes(blob), return_metadata=meta is not None)


_SKIP_ATTRS = {"_speculation_generation", "metadata_revision"}


def scalar_attrs(c) -> dict:
    """Plain (non-array) attributes of a cache object, e.g. offset, _idx, keep, max_size."""
    out = {}
    for k, v in vars(c).items():
        if k in _SKIP_ATTRS:
            continue
        if v is None or isinstance(v, (bool, int, float, str)):
            out[k] = v
        elif isinstance(v, list) and all(isinstance(x, int) for x in v):
            out[k] = list(v)
    return out


def assert_same(orig, restored):
    """Same class, same scalar attributes and the same stored bits."""
    assert type(restored) is type(orig)
    if isinstance(orig, (vlc.CacheList, lmc.CacheList)):
        assert len(orig.caches) == len(restored.caches)
        for a, b in zip(orig.caches, restored.caches, strict=True):
            assert_same(a, b)
        return
    assert scalar_attrs(restored) == scalar_attrs(orig)
    a, b = dump_prompt_cache(orig), dump_prompt_cache(restored)
    assert a.meta == b.meta
    assert record_bits(a) == record_bits(b)


def rand(shape, dtype=mx.float32):
    """Random values; for bf16 random *bit patterns* (NaN payloads, infs, subnormals)."""
    if dtype == mx.bfloat16:
        raw = mx.random.randint(0, 1 << 16, shape, dtype=mx.int32).astype(mx.uint16)
        return raw.view(mx.bfloat16)
    return mx.random.normal(shape).astype(dtype)


def kv(n, dtype=mx.float32, b=1, h=2, d=16):
    return rand((b, h, n, d), dtype), rand((b, h, n, d), dtype)


# ---------------------------------------------------------------- the cases


def kv_updates(steps, dtype=mx.float32, d=16, b=1):
    def step(c):
        return [c.update_and_fetch(*kv(n, dtype, b=b, d=d)) for n in steps]

    return step


def fill(c, steps, dtype=mx.float32, d=16, b=1):
    kv_updates(steps, dtype, d, b)(c)
    return c


def chunked(lib):
    c = fill(lib.ChunkedKVCache(32), [40], mx.bfloat16)
    c.maybe_trim_front()  # start_position 8
    return fill(c, [5], mx.bfloat16)


def chunked_step(c):
    out = c.update_and_fetch(*kv(3, mx.bfloat16))
    c.maybe_trim_front()
    return [out, c.update_and_fetch(*kv(2, mx.bfloat16))]


def arrays(lib):
    c = lib.ArraysCache(3)
    c[0] = rand((1, 3, 8), mx.bfloat16)
    c[1] = rand((1, 2, 4, 4))
    return c  # c[2] stays None


def pooling():
    c = vlc.PoolingCache(4)
    c.accumulate_windows(rand((1, 10, 8)), rand((1, 10, 8)), 0)  # remainder 2
    c.update_and_fetch(rand((1, 2, 8)))
    return c


def pooling_step(c):
    a = c.accumulate_windows(rand((1, 1, 8)), rand((1, 1, 8)), 10)
    b = c.accumulate_windows(rand((1, 1, 8)), rand((1, 1, 8)), 11)
    return [a[:2], b[:2], c.update_and_fetch(rand((1, 1, 8)))]


def batch_pooling():
    rows = [pooling(), vlc.PoolingCache(4)]
    rows[1].accumulate_windows(rand((1, 5, 8)), rand((1, 5, 8)), 0)
    rows[1].update_and_fetch(rand((1, 1, 8)))
    return vlc.BatchPoolingCache.merge(rows)


def batch_pooling_step(c):
    return [c.accumulate_windows(rand((2, 1, 8)), rand((2, 1, 8)), 12)[:2]]


def rotated(lib):
    c = fill(lib.RotatingKVCache(max_size=16, keep=4), [10], mx.float16)
    return fill(c, [1] * 12, mx.float16)  # offset 22 > 16: rotated buffer


def buffered(keep):
    c = fill(vlc.BufferedRotatingKVCache(16, keep=keep, buffer_size=8), [10], mx.bfloat16)
    return fill(c, [1] * 20, mx.bfloat16)


def quant_vlm():
    return fill(vlc.QuantizedKVCache(group_size=32, bits=4), [37, 1], mx.bfloat16, d=64)


def to_quantized(lib):
    return fill(lib.KVCache(), [37], d=64).to_quantized(group_size=64, bits=8)


def static():
    c = fill(vlc.StaticPrefixKVCache(64), [20], mx.bfloat16)
    c.trim(3)
    return c


CASES = {
    # id: (make, continue-step)
    "vlm.KVCache.bf16": (lambda: fill(vlc.KVCache(), [37, 5], mx.bfloat16), None),
    "vlm.KVCache.f16": (lambda: fill(vlc.KVCache(), [300], mx.float16), None),
    "lm.KVCache.f32": (lambda: fill(lmc.KVCache(), [37, 1]), None),
    "lm.KVCache.bf16": (lambda: fill(lmc.KVCache(), [20], mx.bfloat16), None),
    "vlm.RotatingKVCache": (lambda: rotated(vlc), None),
    "lm.RotatingKVCache": (lambda: rotated(lmc), None),
    "vlm.RotatingKVCache.partial": (lambda: fill(vlc.RotatingKVCache(64), [1] * 5), None),
    "vlm.QuantizedKVCache": (quant_vlm, None),
    "lm.QuantizedKVCache": (lambda: fill(lmc.QuantizedKVCache(), [40], d=64), None),
    "vlm.KVCache.to_quantized": (lambda: to_quantized(vlc), None),
    "lm.KVCache.to_quantized": (lambda: to_quantized(lmc), None),
    "vlm.ChunkedKVCache": (lambda: chunked(vlc), chunked_step),
    "lm.ChunkedKVCache": (lambda: chunked(lmc), chunked_step),
    "vlm.ConcatenateKVCache": (lambda: fill(vlc.ConcatenateKVCache(), [7, 3]), None),
    "lm.ConcatenateKVCache": (lambda: fill(lmc.ConcatenateKVCache(), [7, 3]), None),
    "vlm.SimpleKVCache": (lambda: fill(vlc.SimpleKVCache(), [9, 2], mx.bfloat16), None),
    "vlm.StaticPrefixKVCache": (static, None),
    "vlm.BufferedRotatingKVCache": (lambda: buffered(0), None),
    "vlm.BufferedRotatingKVCache.keep": (lambda: buffered(2), None),
    "vlm.ArraysCache": (lambda: arrays(vlc), lambda c: list(c.cache)),
    "lm.ArraysCache": (lambda: arrays(lmc), lambda c: list(c.cache)),
    "vlm.PoolingCache": (pooling, pooling_step),
    "vlm.CacheList": (
        lambda: vlc.CacheList(fill(vlc.KVCache(), [6]), fill(vlc.RotatingKVCache(8), [12])),
        lambda c: [kv_updates([1])(x) for x in c.caches],
    ),
    "lm.CacheList": (
        lambda: lmc.CacheList(fill(lmc.KVCache(), [6]), fill(lmc.ArraysCache(1), [])),
        lambda c: [kv_updates([1])(c.caches[0]), c.caches[1].cache],
    ),
    "vlm.BatchKVCache": (lambda: fill(vlc.BatchKVCache([1, 0]), [5, 1], b=2), None),
    "lm.BatchKVCache": (lambda: fill(lmc.BatchKVCache([1, 0]), [5, 1], b=2), None),
    "vlm.BatchRotatingKVCache": (
        lambda: fill(vlc.BatchRotatingKVCache(8, [1, 0]), [6] + [1] * 5, mx.bfloat16, b=2),
        None,
    ),
    "lm.BatchRotatingKVCache": (
        lambda: fill(lmc.BatchRotatingKVCache(8, [1, 0]), [6] + [1] * 5, b=2),
        None,
    ),
    "vlm.BatchQuantizedKVCache": (
        lambda: fill(vlc.BatchQuantizedKVCache([0, 2]), [5, 1], d=64, b=2),
        lambda c: [c.update_and_fetch(*kv(1, d=64, b=2))],
    ),
    "vlm.BatchPoolingCache": (batch_pooling, batch_pooling_step),
}


def step_for(case_id, c):
    step = CASES[case_id][1]
    if step is not None:
        return step
    dtype = c.keys.dtype if isinstance(c.keys, mx.array) else mx.float32
    if "Batch" in case_id:
        return lambda c: [c.update_and_fetch(*kv(1, dtype, b=2)) for _ in range(2)]
    if "Quantized" in case_id or "to_quantized" in case_id:
        return lambda c: [c.update_and_fetch(*kv(n, d=64)) for n in (1, 3)]
    return kv_updates([1, 3, 1], dtype)


EMPTY = {
    "vlm.KVCache": vlc.KVCache,
    "lm.KVCache": lmc.KVCache,
    "vlm.RotatingKVCache": lambda: vlc.RotatingKVCache(16, keep=4),
    "lm.RotatingKVCache": lambda: lmc.RotatingKVCache(16),
    "vlm.QuantizedKVCache": vlc.QuantizedKVCache,
    "lm.QuantizedKVCache": lmc.QuantizedKVCache,
    "vlm.ChunkedKVCache": lambda: vlc.ChunkedKVCache(32),
    "lm.ChunkedKVCache": lambda: lmc.ChunkedKVCache(32),
    "vlm.ConcatenateKVCache": vlc.ConcatenateKVCache,
    "lm.ConcatenateKVCache": lmc.ConcatenateKVCache,
    "vlm.SimpleKVCache": vlc.SimpleKVCache,
    "vlm.StaticPrefixKVCache": lambda: vlc.StaticPrefixKVCache(32),
    "vlm.BufferedRotatingKVCache": lambda: vlc.BufferedRotatingKVCache(16),
    "vlm.ArraysCache": lambda: vlc.ArraysCache(2),
    "lm.ArraysCache": lambda: lmc.ArraysCache(2),
    "vlm.PoolingCache": lambda: vlc.PoolingCache(4),
    "vlm.CacheList": lambda: vlc.CacheList(vlc.KVCache(), vlc.RotatingKVCache(8)),
    "lm.CacheList": lambda: lmc.CacheList(lmc.KVCache(), lmc.KVCache()),
    "vlm.BatchKVCache": lambda: vlc.BatchKVCache([0, 1]),
    "lm.BatchKVCache": lambda: lmc.BatchKVCache([0, 1]),
    "vlm.BatchRotatingKVCache": lambda: vlc.BatchRotatingKVCache(8, [0, 1]),
    "lm.BatchRotatingKVCache": lambda: lmc.BatchRotatingKVCache(8, [0, 1]),
    "vlm.BatchQuantizedKVCache": lambda: vlc.BatchQuantizedKVCache([0, 1]),
    "vlm.BatchPoolingCache": lambda: vlc.BatchPoolingCache(4, [0, 1]),
}


# ---------------------------------------------------------------- caches from real forward passes

_MODELS: dict = {}


def _prefill(name: str, n_tokens: int):
    ids = mx.random.randint(0, 1000, (1, n_tokens))  # before build_model, which reseeds
    if name not in _MODELS:
        _MODELS[name] = build_model(name)[0]
    lm = _MODELS[name].language_model
    cache = lm.make_cache() if hasattr(lm, "make_cache") else [vlc.KVCache() for _ in lm.layers]
    lm(ids, cache=cache)
    return cache


MODEL_CASES = {
    "gemma3.prefill": lambda: _prefill("gemma3", 90),  # RotatingKVCache (rotated) + KVCache
    "qwen2_vl.prefill": lambda: _prefill("qwen2_vl", 40),
}
ALL_CASES = [*CASES, *MODEL_CASES]


def build_case(case_id: str) -> list:
    """The prompt cache (a list of cache objects) of a case, the same in every process."""
    mx.random.seed(zlib.crc32(case_id.encode()))
    if case_id in MODEL_CASES:
        return MODEL_CASES[case_id]()
    return [CASES[case_id][0]()]
