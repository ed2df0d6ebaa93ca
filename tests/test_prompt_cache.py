"""Prompt cache <-> Record: every cache class, real forward passes, bits compared."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zlib

import mlx.core as mx
import mlx_lm.models.cache as lmc
import mlx_vlm.models.cache as vlc
import numpy as np
import pytest
from cache_cases import (  # a module of tests/, on pytest's path
    CASES,
    EMPTY,
    arrays,
    assert_same,
    bits,
    buffered,
    chunked,
    fill,
    kv,
    pooling,
    rand,
    record_bits,
    rotated,
    roundtrip,
    step_for,
    tree_bits,
)

from mlxcache import FormatError, Record, UnsupportedVersionError
from mlxcache.records import format as st
from mlxcache.records import reader as format_read
from mlxcache.serializers import (
    cache_nbytes,
    dump_prompt_cache,
    is_trimmable_prefix,
    load_prompt_cache,
    truncate_prompt_cache,
)
from mlxcache.tiny_models import build_model


@pytest.mark.parametrize("case_id", list(CASES))
def test_roundtrip_every_class(case_id):
    mx.random.seed(zlib.crc32(case_id.encode()))
    cache = CASES[case_id][0]()
    mx.eval(cache.state if not isinstance(cache, lmc.CacheList) else [])
    restored = roundtrip([cache])
    assert isinstance(restored, list) and len(restored) == 1
    restored = restored[0]
    assert_same(cache, restored)
    assert cache_nbytes([cache]) == dump_prompt_cache([cache]).nbytes

    # the restored cache continues exactly like the original
    step = step_for(case_id, cache)
    seed = 1234
    mx.random.seed(seed)
    expected = tree_bits(step(cache))
    mx.random.seed(seed)
    assert tree_bits(step(restored)) == expected
    assert_same(cache, restored)


@pytest.mark.parametrize("case_id", list(EMPTY))
def test_empty_caches(case_id):
    cache = EMPTY[case_id]()
    record = dump_prompt_cache([cache])
    assert record.nbytes == cache_nbytes([cache])
    if "Batch" not in case_id:  # batched caches keep per-row offsets and paddings
        assert record.nbytes == 0
    (restored,) = load_prompt_cache(st.from_bytes(st.to_bytes(record)))
    assert_same(cache, restored)
    assert restored.empty()
    if hasattr(cache, "update_and_fetch") and "Pooling" not in case_id:
        d, b = (64, 2) if "Quantized" in case_id else (16, 2 if "Batch" in case_id else 1)
        mx.random.seed(3)
        a = tree_bits(cache.update_and_fetch(*kv(4, b=b, d=d)))
        mx.random.seed(3)
        assert tree_bits(restored.update_and_fetch(*kv(4, b=b, d=d))) == a


# ---------------------------------------------------------------- real models


@pytest.fixture(scope="module")
def gemma3():
    model, _ = build_model("gemma3")
    return model


@pytest.fixture(scope="module")
def qwen2_vl_bf16():
    model, _ = build_model("qwen2_vl")
    model.set_dtype(mx.bfloat16)
    return model


def test_gemma3_real_prefill_logits_bit_identical(gemma3):
    lm = gemma3.language_model
    mx.random.seed(0)
    ids = mx.random.randint(0, 1000, (1, 100))
    cache = lm.make_cache()
    lm(ids, cache=cache)
    for t in (5, 6, 7):  # three decode steps: the sliding-window caches rotate
        lm(mx.array([[t]]), cache=cache)
    mx.eval([c.state for c in cache])
    kinds = {type(c).__name__ for c in cache}
    assert kinds == {"RotatingKVCache", "KVCache"}
    assert any(c._idx < c.offset for c in cache if isinstance(c, vlc.RotatingKVCache))

    restored, meta = roundtrip(cache, meta={"model": "gemma3", "tokens": 103})
    assert meta == {"model": "gemma3", "tokens": 103}
    for a, b in zip(cache, restored, strict=True):
        assert_same(a, b)
    for tok in ([[11]], [[12]], [[13, 14, 15]]):
        want = lm(mx.array(tok), cache=cache).logits
        got = lm(mx.array(tok), cache=restored).logits
        assert bits(got) == bits(want)


def test_qwen2_vl_bf16_prefill_roundtrip(qwen2_vl_bf16):
    lm = qwen2_vl_bf16.language_model
    mx.random.seed(1)
    cache = [vlc.KVCache() for _ in lm.model.layers]
    lm(mx.random.randint(0, 1000, (1, 100)), cache=cache)
    assert cache[0].keys.dtype == mx.bfloat16 and cache[0].keys.shape[2] == 256
    restored = roundtrip(cache)
    record = dump_prompt_cache(cache)
    per_layer = 2 * cache[0].keys[..., :100, :].nbytes
    assert record.nbytes == len(cache) * per_layer == cache_nbytes(cache)
    for a, b in zip(cache, restored, strict=True):
        assert_same(a, b)
        k, v = kv(1, mx.bfloat16, h=a.keys.shape[1], d=a.keys.shape[3])
        assert tree_bits(a.update_and_fetch(k, v)) == tree_bits(b.update_and_fetch(k, v))


_SUBPROCESS_MAKE = textwrap.dedent(
    """
    import mlx.core as mx
    import mlx_lm.models.cache as lmc
    import mlx_vlm.models.cache as vlc
    from mlxcache.tiny_models import build_model

    def make():
        model, _ = build_model("gemma3")
        lm = model.language_model
        mx.random.seed(42)
        cache = lm.make_cache()
        lm(mx.random.randint(0, 1000, (1, 90)), cache=cache)
        lm(mx.array([[3]]), cache=cache)
        bf = vlc.KVCache()
        raw = mx.random.randint(0, 1 << 16, (1, 2, 33, 16), dtype=mx.int32).astype(mx.uint16)
        bf.update_and_fetch(raw.view(mx.bfloat16), raw.view(mx.bfloat16) + 0)
        q = lmc.QuantizedKVCache(group_size=32, bits=4)
        q.update_and_fetch(mx.random.normal((1, 2, 9, 64)), mx.random.normal((1, 2, 9, 64)))
        return {"model": cache, "extra": [bf, q, (mx.arange(5), None)], "n": 91}
    """
)


def test_subprocess_write_then_load(tmp_path):
    path = tmp_path / "entry.safetensors"
    script = _SUBPROCESS_MAKE + textwrap.dedent(
        f"""
        from mlxcache.serializers import dump_prompt_cache
        from mlxcache.records import format as st
        with open({str(path)!r}, "wb") as f:
            f.write(st.to_bytes(dump_prompt_cache(make(), meta={{"who": "child"}})))
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)

    namespace: dict = {}
    exec(_SUBPROCESS_MAKE, namespace)
    reference = namespace["make"]()
    loaded, meta = load_prompt_cache(format_read.read_file(path), return_metadata=True)
    assert meta == {"who": "child"}
    assert set(loaded) == {"model", "extra", "n"} and loaded["n"] == 91
    assert isinstance(loaded["extra"][2], tuple) and loaded["extra"][2][1] is None
    assert bits(loaded["extra"][2][0]) == bits(reference["extra"][2][0])
    for a, b in zip(
        reference["model"] + reference["extra"][:2],
        loaded["model"] + loaded["extra"][:2],
        strict=True,
    ):
        assert_same(a, b)


# ---------------------------------------------------------------- structures and dtypes


def test_nested_structures_keep_their_shape():
    mx.random.seed(5)
    k, v = kv(4, mx.bfloat16)
    obj = {
        "vision": [rand((2, 8), mx.bfloat16), (k, v), None, 3, 2.5, "s", True, b"raw"],
        "deep": {"t": (mx.arange(3),), "empty": [], "d": {}},
        "cache": [fill(vlc.KVCache(), [3])],
    }
    back = roundtrip(obj)
    assert tree_bits({k2: v2 for k2, v2 in back.items() if k2 != "cache"}) == tree_bits(
        {k2: v2 for k2, v2 in obj.items() if k2 != "cache"}
    )
    assert isinstance(back["vision"][1], tuple) and isinstance(back["deep"]["t"], tuple)
    assert_same(obj["cache"][0], back["cache"][0])
    assert bits(roundtrip(k)) == bits(k)  # a bare array
    assert roundtrip(None) is None and roundtrip((1, "a")) == (1, "a")


ALL_DTYPES = [
    mx.bool_, mx.uint8, mx.uint16, mx.uint32, mx.uint64, mx.int8, mx.int16, mx.int32,
    mx.int64, mx.float16, mx.bfloat16, mx.float32, mx.float64, mx.complex64,
]  # fmt: skip


def test_every_dtype_byte_exact():
    rng = np.random.default_rng(0)
    arrays = {}
    for dtype in ALL_DTYPES:
        if dtype == mx.bool_:
            arrays[str(dtype)] = mx.array(rng.integers(0, 2, 24).astype(np.bool_))
        else:
            raw = mx.array(rng.integers(0, 256, 96, dtype=np.uint8))
            arrays[str(dtype)] = raw.view(dtype).reshape(2, -1)
    back = roundtrip(arrays)
    assert {k: bits(a) for k, a in back.items()} == {k: bits(a) for k, a in arrays.items()}
    cache = vlc.KVCache()
    cache.update_and_fetch(arrays["mlx.core.bfloat16"].reshape(1, 1, 6, 8), rand((1, 1, 6, 8)))
    assert_same(cache, roundtrip(cache))


# ---------------------------------------------------------------- trimming, aliasing, size


@pytest.mark.parametrize("lib", [vlc, lmc], ids=["vlm", "lm"])
def test_trimmed_tokens_are_not_stored(lib):
    mx.random.seed(9)
    cache = fill(lib.KVCache(), [100], mx.bfloat16)
    cache.trim(30)
    record = dump_prompt_cache([cache])
    keys = [a for n, a in record.arrays.items() if n.endswith("keys")]
    assert [a.shape for a in keys] == [(1, 2, 70, 16)]
    assert record.nbytes == 2 * 70 * 2 * 16 * 2 == cache_nbytes([cache])
    assert bits(keys[0]) == bits(cache.keys[..., :70, :])

    rot = fill(lib.RotatingKVCache(32), [10])
    rot.trim(3)
    assert dump_prompt_cache(rot).nbytes == 2 * 7 * 2 * 16 * 4
    q = fill(lib.QuantizedKVCache(), [50], d=64)
    q.trim(10)
    assert all(a.shape[2] == 40 for a in dump_prompt_cache(q).arrays.values())


ALIAS_CASES = ["vlm.KVCache.bf16", "lm.KVCache.f32", "vlm.RotatingKVCache", "vlm.QuantizedKVCache"]


@pytest.mark.parametrize("case_id", [*ALIAS_CASES, "vlm.StaticPrefixKVCache"])
def test_no_aliasing_either_way(case_id):
    mx.random.seed(11)
    cache = CASES[case_id][0]()
    record = dump_prompt_cache([cache])
    snapshot = record_bits(record)
    live = [x for x in vars(cache).values() if isinstance(x, mx.array)]
    live += [p for x in vars(cache).values() if isinstance(x, (list, tuple)) for p in x]
    assert not {id(x) for x in live} & {id(a) for a in record.arrays.values()}
    # a slice of a padded buffer is compacted; a whole buffer may be shared (no copy needed)
    for a in record.arrays.values():
        shared = [x for x in live if _address(x) == _address(a)]
        assert all(x.nbytes == a.nbytes for x in shared)

    # the caller trims and writes over the same positions: the record does not change
    step = step_for(case_id, cache)
    cache.trim(2)
    mx.eval(step(cache))
    assert record_bits(record) == snapshot

    # mutating what load returned does not change the record, nor a second load
    first, second = load_prompt_cache(record)[0], load_prompt_cache(record)[0]
    first.trim(2)
    mx.eval(step(first))
    if hasattr(first, "keys") and not isinstance(first.keys, tuple):
        first.keys[..., :1, :] = mx.zeros_like(first.keys[..., :1, :])
        mx.eval(first.keys)
    assert record_bits(record) == snapshot
    assert record_bits(dump_prompt_cache([second])) == snapshot


def _address(a: mx.array) -> int:
    mx.eval(a)
    return np.frombuffer(memoryview(a), np.uint8).__array_interface__["data"][0]


# ---------------------------------------------------------------- truncation


@pytest.mark.parametrize("lib", [vlc, lmc], ids=["vlm", "lm"])
def test_truncate_prompt_cache(lib):
    mx.random.seed(13)
    ks, vs = kv(50, mx.bfloat16)
    full = lib.KVCache()
    full.update_and_fetch(ks, vs)
    rot = lib.RotatingKVCache(64)
    rot.update_and_fetch(ks, vs)
    q = lib.QuantizedKVCache(group_size=32, bits=8)
    q.update_and_fetch(*kv(50, d=64))
    before = record_bits(dump_prompt_cache([full, rot, q]))

    cut = truncate_prompt_cache([full, rot, q], 20)
    assert [type(c) for c in cut] == [type(full), type(rot), type(q)]
    assert [c.offset for c in cut] == [20, 20, 20] and cut[1]._idx == 20
    assert record_bits(dump_prompt_cache([full, rot, q])) == before  # input untouched
    assert bits(cut[0].keys) == bits(ks[..., :20, :])
    assert cache_nbytes(cut[:2]) == 2 * 2 * (20 * 2 * 16 * 2)
    assert bits(cut[2].keys[0]) == bits(q.keys[0][..., :20, :])

    # continuing the cut cache equals a fresh cache fed only the first 20 tokens
    fresh = lib.KVCache()
    fresh.update_and_fetch(ks[..., :20, :], vs[..., :20, :])
    nk, nv = kv(3, mx.bfloat16)
    assert tree_bits(cut[0].update_and_fetch(nk, nv)) == tree_bits(fresh.update_and_fetch(nk, nv))
    assert truncate_prompt_cache(full, 0)[0].offset == 0
    assert truncate_prompt_cache(full, 50)[0].offset == 50

    with pytest.raises(ValueError, match="holds 50 tokens"):
        truncate_prompt_cache([full], 51)
    with pytest.raises(ValueError):
        truncate_prompt_cache([full], -1)


def test_trimmable_prefix_classification():
    mx.random.seed(17)
    assert is_trimmable_prefix([vlc.KVCache(), lmc.QuantizedKVCache(), vlc.SimpleKVCache()])
    assert is_trimmable_prefix(fill(vlc.ConcatenateKVCache(), [4]))
    assert is_trimmable_prefix(fill(vlc.RotatingKVCache(16), [16]))  # full, nothing dropped
    rot = rotated(vlc)
    assert not is_trimmable_prefix(rot) and not is_trimmable_prefix(rotated(lmc))
    with pytest.raises(ValueError, match="rotated"):
        truncate_prompt_cache([rot], 3)
    assert is_trimmable_prefix(fill(vlc.BufferedRotatingKVCache(16), [12]))
    assert not is_trimmable_prefix(buffered(0))
    chk = chunked(vlc)
    assert not is_trimmable_prefix(chk) and is_trimmable_prefix(vlc.ChunkedKVCache(8))
    assert truncate_prompt_cache(chk, 20)[0].offset == 20  # above start_position 8
    with pytest.raises(ValueError, match="dropped"):
        truncate_prompt_cache(chk, 5)
    for c in (arrays(vlc), pooling(), vlc.BatchKVCache([0])):
        assert not is_trimmable_prefix(c)
        with pytest.raises(ValueError, match="cannot be cut"):
            truncate_prompt_cache([c], 0)
    lst = vlc.CacheList(fill(vlc.KVCache(), [6]), fill(vlc.QuantizedKVCache(), [6], d=64))
    assert is_trimmable_prefix(lst)
    (cut,) = truncate_prompt_cache([lst], 4)
    assert type(cut) is vlc.CacheList and [c.offset for c in cut.caches] == [4, 4]
    assert not is_trimmable_prefix(vlc.CacheList(vlc.KVCache(), arrays(vlc)))


# ---------------------------------------------------------------- bad input


def test_unsupported_objects_raise_type_error():
    class MyKV(vlc.KVCache):  # model-specific subclasses are not in the allowlist
        pass

    for bad, name in [
        (object(), "object"),
        (MyKV(), "MyKV"),
        (np.zeros(3), "ndarray"),
        (vlc.TokenBuffer() if hasattr(vlc, "TokenBuffer") else lmc.TokenBuffer(), "TokenBuffer"),
    ]:
        with pytest.raises(TypeError, match=name):
            dump_prompt_cache([fill(vlc.KVCache(), [2]), bad])
        with pytest.raises(TypeError, match=name):
            cache_nbytes([bad])
        with pytest.raises(TypeError, match=name):
            is_trimmable_prefix(bad)
    with pytest.raises(TypeError, match="str"):
        dump_prompt_cache({1: mx.arange(2)})
    with pytest.raises(TypeError):
        dump_prompt_cache([vlc.KVCache()], meta={"x": object()})
    with pytest.raises(TypeError):
        dump_prompt_cache([vlc.KVCache()], meta=["not", "a", "dict"])
    spec = vlc.ArraysCache(1)
    spec.start_speculation(2)
    with pytest.raises(ValueError, match="speculative"):
        dump_prompt_cache([spec])


def _with_root(root, version=1, arrays=None):
    return Record(arrays=arrays or {}, meta={"prompt_cache": {"version": version, "root": root}})


@pytest.mark.parametrize(
    "root",
    [
        {"kind": "cache", "library": "os", "class": "system", "state": {}},
        {"kind": "cache", "library": "mlx_vlm", "class": "make_prompt_cache", "state": {}},
        {"kind": "cache", "library": "mlx_vlm", "class": "TokenBuffer", "state": {}},
        {"kind": "cache", "library": "builtins", "class": "eval", "state": {}},
        {"kind": "cache", "library": "mlx_vlm", "class": "KVCache", "state": {}},
        {
            "kind": "cache",
            "library": "mlx_lm",
            "class": "KVCache",
            "state": {
                "keys": {"kind": "none"},
                "values": {"kind": "none"},
                "offset": {"kind": "value", "value": "7"},
            },
        },
        {"kind": "array", "name": "missing"},
        {"kind": "pickle", "value": "x"},
        {"kind": "list", "items": "nope"},
        {"kind": "dict", "keys": ["a"], "items": []},
        "not a node",
    ],
)
def test_malformed_records_raise_format_error(root):
    with pytest.raises(FormatError):
        load_prompt_cache(_with_root(root))


def test_versions_and_foreign_records():
    good = dump_prompt_cache([vlc.KVCache()])
    info = dict(good.meta["prompt_cache"])
    with pytest.raises(UnsupportedVersionError):
        load_prompt_cache(Record(arrays={}, meta={"prompt_cache": {**info, "version": 2}}))
    with pytest.raises(FormatError):
        load_prompt_cache(Record(arrays={}, meta={"prompt_cache": {**info, "version": "1"}}))
    with pytest.raises(FormatError):
        load_prompt_cache(Record(arrays={}, meta={"something": "else"}))
    deep: dict = {"kind": "none"}
    for _ in range(100):
        deep = {"kind": "list", "items": [deep]}
    with pytest.raises(FormatError):
        load_prompt_cache(_with_root(deep))
    cache, meta = load_prompt_cache(good, return_metadata=True)
    assert meta == {} and type(cache[0]) is vlc.KVCache
