"""PrefixCache on real caches from a real forward pass of the tiny models, on every backend."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from helpers import CountingBackend, bits
from mlx_vlm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from mlxcache import PrefixCache, PrefixHit, model_identity, open_backend, truncate_prompt_cache
from mlxcache.backends.memory import MemoryBackend
from mlxcache.tiny_models import build_model, load_config

BS = 16


@pytest.fixture(scope="module")
def qwen():
    return build_model("qwen2_vl")[0]


@pytest.fixture(scope="module")
def gemma():
    return build_model("gemma3")[0]


def prefill(model, ids, cache=None, rope_deltas=None):
    """Run the language model on ``ids`` (continuing ``cache``); returns (last logits, cache).

    Qwen2-VL keeps M-RoPE state between calls: it is reset here, and a continued cache needs
    the ``rope_deltas`` of its prompt (stored as an extra, or recomputed from the request).
    """
    lm = model.language_model
    kw = {}
    if hasattr(lm, "_rope_deltas"):
        lm._rope_deltas, lm._position_ids = None, None
        if cache is not None:
            kw["rope_deltas"] = rope_deltas
    cache = make_prompt_cache(lm) if cache is None else cache
    logits = lm(mx.array([list(ids)]), cache=cache, **kw).logits[0, -1]
    mx.eval(logits)
    return logits, cache


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(1, 900, n).tolist()


@pytest.fixture(scope="module")
def turn1(qwen):
    ids = prompt(40)
    return ids, prefill(qwen, ids)[1]


# ---------------------------------------------------------------- hits and misses


def test_exact_repeat_hits_in_full_and_store_writes_only_new_blocks(uri, turn1):
    ids, cache = turn1
    with PrefixCache(uri, model="qwen", block_size=BS) as pc:
        assert pc.store(ids, cache) == 40
        assert pc.store(ids, cache) == 0  # everything exists already
        hit = pc.lookup(ids)
        assert isinstance(hit, PrefixHit) and hit.num_tokens == 40
        assert [type(c) for c in hit.prompt_cache] == [KVCache] * 4
        for got, want in zip(hit.prompt_cache, cache, strict=True):
            assert got.offset == 40
            assert bits(got.keys) == bits(want.keys[..., :40, :])
            assert bits(got.values) == bits(want.values[..., :40, :])
        assert pc.lookup(prompt(40, seed=1)) is None
        s = pc.stats()
        assert (s["hits"], s["misses"], s["tokens_reused"], s["tokens_written"]) == (1, 1, 40, 40)


def test_turn_two_reuses_turn_one_and_continues_bit_exactly(qwen, turn1):
    ids, cache = turn1
    lm = qwen.language_model
    prefill(qwen, ids)
    deltas = lm._rope_deltas  # M-RoPE state the model needs to resume: kept as an extra
    pc = PrefixCache("memory://", model="qwen", block_size=BS)
    pc.store(ids, cache, extras={"rope_deltas": deltas})
    turn2 = ids + prompt(30, seed=2)  # turn 1 + answer + new question
    hit = pc.lookup(turn2)
    assert hit.num_tokens == 40  # turn 1's blocks and its stored partial tail
    assert bits(hit.extras["rope_deltas"]) == bits(deltas)
    warm, _ = prefill(qwen, turn2[40:], hit.prompt_cache, hit.extras["rope_deltas"])
    cold, _ = prefill(qwen, turn2)
    assert bits(warm) == bits(cold)
    # shares 37 tokens: reuses the 2 whole blocks; no extras there, so recompute them
    diverged = ids[:37] + prompt(20, seed=3)
    hit = pc.lookup(diverged)
    assert hit.num_tokens == 32 and hit.extras == {}
    assert pc.lookup(diverged, require_extras=True) is None  # no stored length at <= 37
    _, deltas2 = lm.get_rope_index(mx.array([diverged]), None, None, None)
    warm, _ = prefill(qwen, diverged[32:], hit.prompt_cache, deltas2)
    cold, _ = prefill(qwen, diverged)
    assert bits(warm) == bits(cold)


def test_gemma3_mixed_rotating_and_kv_hits_at_any_block_boundary(gemma, uri):
    ids = prompt(100, seed=4)  # past the 64-token window: the rotating layers have wrapped
    _, cache = prefill(gemma, ids)
    assert {type(c) for c in cache} == {RotatingKVCache, KVCache}
    with PrefixCache(uri, model="gemma", block_size=BS) as pc:
        assert pc.store(ids, cache) == 100
        request = ids + prompt(25, seed=5)
        hit = pc.lookup(request)
        assert hit.num_tokens == 100
        assert [type(c) for c in hit.prompt_cache] == [type(c) for c in cache]
        warm, _ = prefill(gemma, request[100:], hit.prompt_cache)
        cold, _ = prefill(gemma, request)
        assert bits(warm) == bits(cold)
        # window layers are stored per block: a branch hits at its last block boundary, and
        # continues as the engine does from its own cache of those 80 tokens (one chunk)
        branched = ids[:90] + prompt(20, seed=6)
        hit = pc.lookup(branched)
        assert hit.num_tokens == 80
        warm, _ = prefill(gemma, branched[80:], hit.prompt_cache)
        _, at80 = prefill(gemma, branched[:80])
        resumed, _ = prefill(gemma, branched[80:], at80)
        assert bits(warm) == bits(resumed) == bits(prefill(gemma, branched)[0])
        assert pc.lookup(ids[:80]).num_tokens == 80


def test_images_count_by_content_and_order(turn1):
    ids, cache = turn1
    a, b, c = b"image-a", b"image-b", b"image-c"
    pc = PrefixCache("memory://", model="qwen", block_size=BS)
    pc.store(ids, cache, images=[a, b])
    assert pc.lookup(ids, images=[a, b]).num_tokens == 40
    assert pc.lookup(ids, images=[b, a]) is None  # swapped
    assert pc.lookup(ids, images=[a, c]) is None  # another image
    assert pc.lookup(ids, images=[a]) is None
    assert pc.lookup(ids) is None  # the same tokens without images
    pc.store(ids, cache)
    assert pc.lookup(ids, images=[b, a]) is None
    assert pc.lookup(ids).num_tokens == 40


def test_image_positions_share_text_before_the_image(qwen):
    img = 999  # the tiny Qwen2-VL's image token
    ids = prompt(40, seed=7) + [img] * 16 + prompt(10, seed=8)  # image run starts at 40
    _, cache = prefill(qwen, ids)
    pc = PrefixCache("memory://", model="qwen", block_size=BS, image_token_id=img)
    pc.store(ids, cache, images=[b"cat"])
    assert pc.lookup(ids, images=[b"cat"]).num_tokens == 66
    # another image: the two whole blocks before the image's block are shared, no more
    assert pc.lookup(ids, images=[b"dog"]).num_tokens == 32
    # a later turn that adds a second image still reuses the whole first turn
    turn2 = ids + prompt(6, seed=9) + [img] * 16
    assert pc.lookup(turn2, images=[b"cat", b"dog"]).num_tokens == 66
    assert pc.lookup(turn2, images=[b"dog", b"cat"]).num_tokens == 32  # swapped
    # explicit positions key the same way as the detected runs
    assert pc.lookup(ids, images=[b"cat"], image_positions=[40]).num_tokens == 66
    # positions unknown (runs do not match the images): every image keys block 0, a miss
    assert pc.lookup(ids + [1, img, img], images=[b"cat"]) is None
    assert pc.lookup(ids, images=[b"cat", b"cat"]) is None


def test_other_model_or_salt_misses(turn1):
    ids, cache = turn1
    backend = MemoryBackend()
    PrefixCache(backend, model="qwen", salt="tenant-a", block_size=BS).store(ids, cache)
    assert PrefixCache(backend, model="qwen", salt="tenant-a", block_size=BS).lookup(ids)
    assert PrefixCache(backend, model="qwen", salt="tenant-b", block_size=BS).lookup(ids) is None
    assert (
        PrefixCache(backend, model="qwen-4bit", salt="tenant-a", block_size=BS).lookup(ids) is None
    )
    assert all(k.startswith("mlxcache/prefix/v1/") for k in backend.keys())


def test_forged_or_broken_records_are_misses_never_wrong_hits(qwen, turn1):
    ids, cache = turn1
    other = prompt(40, seed=10)
    backend = MemoryBackend()
    pc = PrefixCache(backend, model="qwen", block_size=BS, hot_bytes=0)
    pc.store(ids, cache)
    keys_a = set(backend.keys())
    pc.store(other, prefill(qwen, other)[1])
    keys_b = sorted(set(backend.keys()) - keys_a)
    # put turn 1's records under every key of the other prompt: a collision or a foreign entry
    records_a = [backend.get(k) for k in sorted(keys_a)]
    for k in keys_b:
        kind = k.split("/")[-2]
        backend.put(k, next(r for r in records_a if r.meta.get("kind") == rec_kind(kind)))
    assert pc.lookup(other) is None
    assert pc.stats()["rejected"] >= 1
    # a block whose arrays lost a layer stops the hit at the block before it
    pc2 = PrefixCache(MemoryBackend(), model="qwen", block_size=BS, hot_bytes=0)
    pc2.store(ids, cache)
    key1 = pc2._key("b", pc2._plan(np.asarray(ids), [], None).full(2)[1])
    rec = pc2.backend.get(key1)
    broken = {k: v for k, v in rec.arrays.items() if not k.startswith("3.")}
    pc2.backend.put(key1, type(rec)(arrays=broken, meta=rec.meta))
    assert pc2.lookup(ids).num_tokens == 16


def rec_kind(kind: str) -> str:
    return {"b": "block", "t": "tail"}[kind]


def test_vision_embeddings_come_back_even_when_the_tokens_miss(turn1):
    ids, cache = turn1
    emb = mx.random.normal((1, 16, 64)).astype(mx.bfloat16)
    pc = PrefixCache("memory://", model="qwen", block_size=BS)
    pc.store(ids, cache, images=[b"cat"], vision_embeddings=emb)
    hit = pc.lookup(prompt(30, seed=11), images=[b"cat"])
    assert hit.num_tokens == 0 and hit.prompt_cache is None
    assert bits(hit.vision_embeddings) == bits(emb)
    hit = pc.lookup(ids, images=[b"cat"])
    assert hit.num_tokens == 40 and bits(hit.vision_embeddings) == bits(emb)
    assert pc.lookup(ids, images=[b"dog"]) is None
    with pytest.raises(ValueError, match="images"):
        pc.store(ids, cache, vision_embeddings=emb)


def test_no_aliasing_between_caller_store_and_hits(qwen):
    ids = prompt(40, seed=12)
    _, cache = prefill(qwen, ids)
    before = bits(cache[0].keys[..., :40, :])
    pc = PrefixCache("memory://", model="qwen", block_size=BS)
    pc.store(ids, cache)
    cache[0].trim(10)  # the caller reuses its cache: trim and write new tokens
    prefill(qwen, prompt(10, seed=13), cache)
    hit = pc.lookup(ids)
    assert bits(hit.prompt_cache[0].keys) == before
    prefill(qwen, prompt(5, seed=14), hit.prompt_cache)  # the hit is continued...
    hit.prompt_cache[0].trim(20)
    prefill(qwen, prompt(20, seed=15), hit.prompt_cache)
    assert bits(pc.lookup(ids).prompt_cache[0].keys) == before  # ...the store is untouched


def test_quantized_and_concatenate_caches_round_trip_by_block(turn1):
    from mlx_vlm.models.cache import ConcatenateKVCache

    ids, cache = turn1
    quant = [c.to_quantized(group_size=32, bits=4) for c in cache[:2]]
    concat = ConcatenateKVCache()
    concat.update_and_fetch(cache[2].keys[..., :40, :], cache[2].values[..., :40, :])
    mixed = [*quant, concat, cache[3]]
    pc = PrefixCache("memory://", model="qwen-q4", block_size=BS)
    assert pc.store(ids, mixed) == 40
    hit = pc.lookup(ids + [1, 2])
    assert hit.num_tokens == 40
    assert [type(c) for c in hit.prompt_cache] == [type(c) for c in mixed]
    for got, want in zip(hit.prompt_cache, mixed, strict=True):
        gk = tuple(got.keys) if isinstance(got.keys, tuple | list) else (got.keys,)
        wk = tuple(want.keys) if isinstance(want.keys, tuple | list) else (want.keys,)
        assert [bits(a) for a in gk] == [bits(b[..., :40, :]) for b in wk]
        assert got.offset == 40 and getattr(got, "bits", 0) == getattr(want, "bits", 0)


def test_bad_arguments_fail_before_anything_is_written(turn1):
    ids, cache = turn1
    backend = MemoryBackend()
    pc = PrefixCache(backend, model="qwen", block_size=BS)
    with pytest.raises(ValueError, match="holds 40 tokens but token_ids has 39"):
        pc.store(ids[:39], cache)
    with pytest.raises(TypeError):
        pc.store(ids, [*cache, object()])  # a layer the serializer cannot store
    with pytest.raises(ValueError, match="prompt_cache is empty"):
        pc.store(ids, [])  # would later "hit" with an empty cache
    with pytest.raises(ValueError, match="image_positions"):
        pc.lookup(ids, images=[b"a"], image_positions=[99])
    with pytest.raises(ValueError, match="block_size"):
        PrefixCache(backend, model="qwen", block_size=0)
    assert len(backend) == 0


def test_lookup_round_trips(turn1):
    ids, cache = turn1
    backend = CountingBackend()
    pc = PrefixCache(backend, model="qwen", block_size=BS, hot_bytes=0)
    pc.store(ids, cache)
    backend.calls.clear()
    assert pc.lookup(ids).num_tokens == 40
    assert backend.calls == Counter(contains_many=1, get_many=1)
    backend.calls.clear()
    assert pc.lookup(ids + prompt(200, seed=16)).num_tokens == 40
    assert backend.calls == Counter(contains_many=2, get_many=1)


def test_model_identity():
    model, _ = build_model("qwen2_vl")
    ident = model_identity(model)
    assert ident.startswith("qwen2_vl/cfg-") and "/q-none/w-" in ident
    assert model_identity(model) == ident
    assert model_identity(model, revision="abc123").endswith("@abc123")
    cfg = load_config("qwen2_vl")
    assert model_identity(cfg) == model_identity(load_config("qwen2_vl"))
    cfg2 = load_config("qwen2_vl")
    cfg2["text_config"]["rms_norm_eps"] = 1e-5
    assert model_identity(cfg2) != model_identity(cfg)
    cfg["quantization"] = {"group_size": 64, "bits": 4}
    assert "/q-4b64" in model_identity(cfg)
    assert model_identity(model, hash_weights=True) != ident
    model.set_dtype(mx.float16)  # another KV dtype: another identity
    assert model_identity(model) != ident
    gemma, _ = build_model("gemma3")
    assert model_identity(gemma).startswith("gemma3/")


def test_threads_share_one_prefix_cache(turn1):
    from concurrent.futures import ThreadPoolExecutor

    ids, cache = turn1
    pc = PrefixCache("memory://", model="qwen", block_size=BS)
    requests = [ids[:n] for n in (16, 20, 33, 40)] * 3

    def work(req):
        pc.store(req, truncate_prompt_cache(cache, len(req)))
        hit = pc.lookup(req + [3])
        return hit.num_tokens, bits(hit.prompt_cache[0].keys)

    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(work, requests))
    for req, (n, k) in zip(requests, results, strict=True):
        assert n == len(req) and k == bits(cache[0].keys[..., :n, :])
    assert pc.stats()["hits"] == len(requests)


# ---------------------------------------------------------------- across processes

SCRIPT = textwrap.dedent(
    """
    import hashlib, sys
    import mlx.core as mx, numpy as np
    from mlx_vlm.models.cache import make_prompt_cache
    from mlxcache import PrefixCache
    from mlxcache.tiny_models import build_model

    uri, mode = sys.argv[1], sys.argv[2]
    ids = np.random.default_rng(20).integers(1, 900, 50).tolist()
    model = build_model("qwen2_vl")[0]
    lm = model.language_model
    with PrefixCache(uri, model="qwen-xproc", block_size=16) as pc:
        if mode == "store":
            cache = make_prompt_cache(lm)
            mx.eval(lm(mx.array([ids]), cache=cache).logits)
            print(pc.store(ids, cache, extras={"rope_deltas": lm._rope_deltas}))
        else:
            request = ids + [7, 8, 9]
            hit = pc.lookup(request)
            rest = mx.array([request[hit.num_tokens:]])
            deltas = hit.extras["rope_deltas"]
            logits = lm(rest, cache=hit.prompt_cache, rope_deltas=deltas).logits
            mx.eval(logits)
            print(hit.num_tokens, hashlib.sha256(memoryview(logits[0, -1])).hexdigest())
    """
)


def test_two_processes_share_file_and_redis(tmp_path, redis_url, qwen):
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    request = np.random.default_rng(20).integers(1, 900, 50).tolist() + [7, 8, 9]
    cold, _ = prefill(qwen, request)
    import hashlib

    want = hashlib.sha256(memoryview(cold)).hexdigest()
    for uri in (f"file://{tmp_path}/shared", redis_url):

        def run(mode, uri=uri):
            out = subprocess.run([sys.executable, str(script), uri, mode], capture_output=True,
                                 text=True, timeout=120)  # fmt: skip
            assert out.returncode == 0, out.stderr
            return out.stdout.split()

        assert run("store") == ["50"]  # one process stores...
        assert run("lookup") == ["50", want]  # ...a new one (a restart) hits, bit-exact
        assert run("store") == ["0"]
        with PrefixCache(uri, model="qwen-xproc", block_size=16) as pc:  # and so does this one
            assert pc.lookup(request).num_tokens == 50


def test_dead_backend_is_a_miss(turn1):
    ids, cache = turn1
    pc = PrefixCache(
        open_backend("redis://127.0.0.1:1/0?timeout=0.2"), model="q", block_size=BS, hot_bytes=0
    )
    pc.store(ids, cache)
    assert pc.lookup(ids) is None


# ---------------------------------------------------------------- review: edge cases


def _rewrite(backend, kind, change):
    """Rewrite the meta of every stored record of ``kind`` ("block" or "tail") with ``change``."""
    from mlxcache import Record

    for k in list(backend.keys()):
        rec = backend.get(k)
        if rec.meta.get("kind") == kind:
            meta = dict(rec.meta)
            change(meta)
            backend.put(k, Record(arrays=dict(rec.arrays), meta=meta))


@pytest.mark.parametrize(
    "kind, change",
    [
        ("block", lambda m: m.update(params=None)),
        ("block", lambda m: m.update(params=m["params"][:1])),
        ("block", lambda m: m.update(params=["x"] * len(m["params"]))),
        ("block", lambda m: m.update(layout=7)),
        ("block", lambda m: m.update(layout=["b:mlx_vlm.NoSuchCache"] * 4)),
        ("tail", lambda m: m.update(extras=None)),
        ("tail", lambda m: m.update(extras=[3])),
        ("tail", lambda m: m.update(layout="b:mlx_vlm.KVCache")),
    ],
)
def test_malformed_records_are_rejected_never_raised(turn1, kind, change):
    """A record of another format (or a forged one) under our key is a miss, not an exception."""
    ids, cache = turn1
    backend = MemoryBackend()
    pc = PrefixCache(backend, model="qwen", block_size=BS, hot_bytes=0)
    pc.store(ids, cache, extras={"rope_deltas": mx.array([[0]])})
    _rewrite(backend, kind, change)
    for request in (ids, ids + [5, 6]):
        hit = pc.lookup(request)
        if kind == "block":  # block 0 is bad: nothing to build on
            assert hit is None
        else:  # the blocks are fine; the bad tail only loses its extras
            assert hit.num_tokens == 40 and hit.extras == {}
            assert all(c.offset == 40 for c in hit.prompt_cache)
        assert pc.lookup(request, require_extras=True) is None
    assert pc.stats()["rejected"] >= 2


def decoded(model, ids, steps):
    """The cache after prefilling ``ids`` and feeding ``steps`` more tokens one at a time (the
    rotating layers wrap past their 64-token window and keep only its last tokens)."""
    _, cache = prefill(model, ids)
    for t in steps:
        prefill(model, [t], cache)
    return cache


def test_malformed_checkpoint_tail_is_a_miss(gemma):
    ids = prompt(81, seed=30)
    cache = decoded(gemma, ids[:50], ids[50:])  # past the window: block 1 lacks position 16
    backend = MemoryBackend()
    pc = PrefixCache(backend, model="gemma", block_size=BS, hot_bytes=0)
    pc.store(ids, cache)
    assert pc.lookup(ids).num_tokens == 81  # the tail holds the rotating layers whole
    _rewrite(backend, "tail", lambda m: m.update(ckpt=None))
    assert pc.lookup(ids) is None
    _rewrite(backend, "tail", lambda m: m.update(ckpt={"prompt_cache": 5}))
    assert pc.lookup(ids + [1]) is None
    assert pc.stats()["rejected"] >= 2


def test_image_positions_after_the_placeholders_are_refused(qwen):
    """A position later than its image's first placeholder would let another image's KV hit."""
    img = 999
    ids = prompt(10, seed=31) + [img] * 16 + prompt(20, seed=32)  # the run starts at 10
    _, cache = prefill(qwen, ids)
    pc = PrefixCache("memory://", model="qwen", block_size=BS, image_token_id=img)
    with pytest.raises(ValueError, match="image_positions"):
        pc.store(ids, cache, images=[b"cat"], image_positions=[30])
    with pytest.raises(ValueError, match="image_positions"):
        pc.lookup(ids, images=[b"dog"], image_positions=[16])
    assert len(pc.backend) == 0
    # at or before the run is fine (e.g. a vision-start token), and keys the same block
    pc.store(ids, cache, images=[b"cat"], image_positions=[9])
    assert pc.lookup(ids, images=[b"cat"], image_positions=[9]).num_tokens == 46
    assert pc.lookup(ids, images=[b"dog"], image_positions=[9]) is None  # block 0 holds both


def test_store_counts_only_what_the_backend_kept(turn1):
    ids, cache = turn1
    # every block record is larger than this budget: the backend refuses them all
    pc = PrefixCache("memory://?max_bytes=1000", model="qwen", block_size=BS, hot_bytes=0)
    assert pc.store(ids, cache) == 0
    assert pc.stats()["tokens_written"] == 0 and pc.lookup(ids) is None
    dead = open_backend("redis://127.0.0.1:1/0?timeout=0.2")
    assert PrefixCache(dead, model="q", block_size=BS, hot_bytes=0).store(ids, cache) == 0


def test_hash_plan_of_a_long_prompt_is_linear():
    """Block hashes of a very long prompt: one pass, not a copy of the chain per block."""
    import time

    pc = PrefixCache("memory://", model="qwen", block_size=1)
    tokens = np.arange(60_000, dtype=np.int64)
    t0 = time.perf_counter()
    plan = pc._plan(tokens, [], None)
    assert len(plan.full(60_000)) == 60_000
    plan.partial(59_999, 1)
    assert time.perf_counter() - t0 < 2.0  # quadratic: ~3 s here; linear: ~0.2 s
