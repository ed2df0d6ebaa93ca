"""Opt-in quantized KV storage (PrefixCache(kv_bits=...)): bounded error, own namespace, exact
storage unchanged, real caches of the tiny models."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from helpers import bits
from mlx_vlm.models.cache import KVCache, make_prompt_cache

from mlxcache import PrefixCache, hashing
from mlxcache.backends.memory import MemoryBackend
from mlxcache.serializers import kv_quant
from mlxcache.serializers.kv_quant import KVQuant
from mlxcache.tiny_models import build_model

BS = 16
DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def kv_cache(n: int, dim: int, dtype=mx.bfloat16, seed: int = 0, heads: int = 2) -> KVCache:
    """A KVCache holding ``n`` tokens of random keys/values (outliers per row, like real KV)."""
    mx.random.seed(seed)
    c = KVCache()
    shape = (1, heads, n, dim)
    k = mx.random.normal(shape) * 2 + mx.random.uniform(shape=(1, heads, n, 1)) * 8
    v = mx.random.normal(shape)
    c.update_and_fetch(k.astype(dtype), v.astype(dtype))
    mx.eval(c.keys, c.values)
    return c


def prompt(n: int, seed: int = 0, high: int = 900) -> list[int]:
    return np.random.default_rng(seed).integers(1, high, n).tolist()


def stored_bytes(pc: PrefixCache) -> int:
    return sum(r.nbytes for r in pc.backend.get_many(list(pc.backend.keys(pc.key_prefix))))


# ---------------------------------------------------------------- the quantizer alone


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("q", [KVQuant(8, 64), KVQuant(4, 32), KVQuant(3, 128)], ids=str)
def test_round_trip_within_the_documented_bound(dtype, q):
    a = kv_cache(40, 128, dtype).keys[..., :40, :]
    arrays, marker = kv_quant.quantize({"0.k0": a}, q)
    assert set(arrays) == {"0.k0.qw", "0.k0.qs", "0.k0.qb"}
    assert marker == {
        "mode": "affine",
        "bits": q.bits,
        "group_size": q.group_size,
        "arrays": {"0.k0": {"dtype": str(dtype).rsplit(".", 1)[-1], "dim": 128}},
    }
    back = kv_quant.restore(arrays, marker, q)["0.k0"]
    assert back.dtype == dtype and back.shape == a.shape
    err = mx.abs(back.astype(mx.float32) - a.astype(mx.float32))
    err = err.reshape(*a.shape[:-1], -1, q.group_size).max(axis=-1)
    bound = kv_quant.error_bound(a, arrays["0.k0.qs"], q)
    assert mx.all(err <= bound).item()
    # the bound is tight enough to mean something: one step is 1/(2^bits - 1) of the range
    g = a.astype(mx.float32).reshape(*a.shape[:-1], -1, q.group_size)
    spread = (g.max(axis=-1) - g.min(axis=-1)).max().item()
    assert bound.max().item() < 2.5 * spread / (2**q.bits - 1) + 0.02 * mx.abs(g).max().item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b", kv_quant.BITS)
def test_dequantize_is_mx_dequantize_bit_for_bit(dtype, b):
    q = KVQuant(b, 32)
    a = kv_cache(24, 64, dtype).values[..., :24, :]
    w, s, z = mx.quantize(a, group_size=32, bits=b)
    theirs = mx.dequantize(w, s, z, group_size=32, bits=b)
    mine = kv_quant.dequantize(w, s, z, q)
    assert mine.dtype == theirs.dtype and mine.shape == theirs.shape == a.shape
    assert bits(mine) == bits(theirs)


def test_arrays_that_do_not_fit_stay_exact(caplog):
    q = KVQuant(8, 64)
    odd = kv_cache(8, 80).keys[..., :8, :]  # 80 is not whole groups of 64
    ints = mx.arange(64 * 4).reshape(4, 64)
    with caplog.at_level(logging.WARNING, logger="mlxcache"):
        arrays, marker = kv_quant.quantize({"0.k0": odd, "1.k0": ints}, q)
    assert marker["arrays"] == {}
    assert bits(arrays["0.k0"]) == bits(odd) and bits(arrays["1.k0"]) == bits(ints)
    assert any("not whole groups of 64" in r.getMessage() for r in caplog.records)
    back = kv_quant.restore(arrays, marker, q)
    assert bits(back["0.k0"]) == bits(odd)


def test_restore_refuses_a_marker_of_other_settings():
    a = kv_cache(8, 64).values[..., :8, :]
    arrays, marker = kv_quant.quantize({"0.v0": a}, KVQuant(8, 64))
    for reader in (None, KVQuant(4, 64), KVQuant(8, 32)):
        with pytest.raises(kv_quant.QuantError):
            kv_quant.restore(arrays, marker, reader)
    with pytest.raises(kv_quant.QuantError):  # an exact record for a quantized reader
        kv_quant.restore({"0.v0": a}, None, KVQuant(8, 64))
    bad = {**marker, "arrays": {"0.v0": {"dtype": "bfloat16", "dim": 128}}}
    with pytest.raises(kv_quant.QuantError):  # the marker does not fit the parts
        kv_quant.restore(arrays, bad, KVQuant(8, 64))
    with pytest.raises(kv_quant.QuantError):  # a part missing
        kv_quant.restore({k: v for k, v in arrays.items() if k != "0.v0.qb"}, marker, KVQuant(8))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kv_bits": 1},
        {"kv_bits": 7},
        {"kv_bits": 16},
        {"kv_bits": True},
        {"kv_bits": "8"},
        {"kv_bits": 8, "kv_group_size": 0},
        {"kv_bits": 8, "kv_group_size": 48},
        {"kv_bits": 8, "kv_group_size": 256},
        {"kv_bits": 4, "kv_group_size": -32},
        {"kv_group_size": 0},  # wrong even while quantization is off
    ],
)
def test_bad_options_raise_before_opening_a_backend(kwargs, tmp_path):
    with pytest.raises(ValueError, match="kv_bits|kv_group_size"):
        PrefixCache(f"file://{tmp_path}/never", model="m", **kwargs)
    assert not (tmp_path / "never").exists()


def test_every_supported_setting_builds():
    for b in kv_quant.BITS:
        for g in kv_quant.GROUP_SIZES:
            assert PrefixCache("memory://", model="m", kv_bits=b, kv_group_size=g).kv_quant


# ---------------------------------------------------------------- keys and records


def test_exact_keys_and_records_are_unchanged():
    # the seed of exact storage is the one every earlier release wrote (stored entries stay
    # found); the value is the namespace_seed("qwen", "tenant") of the release before this one
    seed = "5689037447cec2868e62876c0e16058f7abd12e5bbdef447473833e6459c2a0a"
    assert hashing.namespace_seed("qwen", "tenant").hex() == seed
    assert hashing.namespace_seed("qwen", "tenant", kv="").hex() == seed
    pc = PrefixCache("memory://", model="qwen", salt="tenant", block_size=BS)
    assert pc.key_prefix.endswith(f"/{seed[:16]}/")
    cache = kv_cache(40, 64)
    pc.store(prompt(40), [cache])
    recs = pc.backend.get_many(list(pc.backend.keys(pc.key_prefix)))
    blocks = [r for r in recs if r.meta.get("kind") == "block"]
    assert len(blocks) == 3 and all("kvq" not in r.meta for r in blocks)
    assert all(set(r.arrays) == {"0.k0", "0.v0"} for r in blocks)
    hit = pc.lookup(prompt(40))
    assert hit.num_tokens == 40
    assert bits(hit.prompt_cache[0].keys[..., :40, :]) == bits(cache.keys[..., :40, :])
    assert bits(hit.prompt_cache[0].values[..., :40, :]) == bits(cache.values[..., :40, :])


def test_settings_never_share_entries():
    backend = MemoryBackend()
    settings = [(None, 64), (8, 64), (4, 64), (8, 32)]
    caches = [
        PrefixCache(backend, model="m", block_size=BS, kv_bits=b, kv_group_size=g)
        for b, g in settings
    ]
    assert len({pc.key_prefix for pc in caches}) == len({pc._seed for pc in caches}) == 4
    ids = prompt(40)
    caches[1].store(ids, [kv_cache(40, 64)])
    assert caches[1].lookup(ids).num_tokens == 40
    for i in (0, 2, 3):  # an exact reader, other bits, other groups: a plain miss
        assert caches[i].lookup(ids) is None and caches[i].stats()["rejected"] == 0


def test_a_quantized_record_under_an_exact_key_is_a_miss(caplog):
    """A record forged (or copied) into another setting's namespace is rejected, not served."""
    backend = MemoryBackend()
    exact = PrefixCache(backend, model="m", block_size=BS)
    q8 = PrefixCache(backend, model="m", block_size=BS, kv_bits=8)
    q8._seed, q8.key_prefix = exact._seed, exact.key_prefix  # writes into the exact namespace
    ids = prompt(32)
    q8.store(ids, [kv_cache(32, 64)])
    with caplog.at_level(logging.WARNING, logger="mlxcache"):
        assert exact.lookup(ids) is None
    assert exact.stats()["rejected"] == 1
    assert any("exact reader" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefix_cache_restores_normal_caches_within_the_bound(dtype):
    ids = prompt(40)
    cache = kv_cache(40, 128, dtype)
    sizes = {}
    for b in (None, 8, 4):
        pc = PrefixCache("memory://", model="m", block_size=BS, kv_bits=b)
        assert pc.store(ids, [cache], background=b == 4) == 40
        pc.flush()
        sizes[b] = stored_bytes(pc)
        hit = pc.lookup(ids)
        assert hit.num_tokens == 40 and type(hit.prompt_cache[0]) is KVCache
        got = hit.prompt_cache[0]
        assert got.offset == 40
        for name in ("keys", "values"):
            a, x = getattr(cache, name)[..., :40, :], getattr(got, name)[..., :40, :]
            assert x.dtype == dtype and x.shape == a.shape
            if b is None:
                assert bits(x) == bits(a)
                continue
            q = KVQuant(b, 64)
            scales = mx.quantize(a, group_size=64, bits=b)[1]
            err = mx.abs(x.astype(mx.float32) - a.astype(mx.float32))
            err = err.reshape(*a.shape[:-1], -1, 64).max(axis=-1)
            assert mx.all(err <= kv_quant.error_bound(a, scales, q)).item()
        # a prefix that ends inside a block: the partial block comes back too
        part = pc.lookup(ids[:37] + [999])
        assert part.num_tokens == 32
    itemsize = {mx.float32: 4, mx.float16: 2, mx.bfloat16: 2}[dtype]
    per = 2 * 2 * 128 * 40  # values stored (keys + values, 2 heads, dim 128, 40 tokens)
    # payload: packed bits plus a scale and a bias per group of 64, in the dtype
    for b in (8, 4):
        quant_payload = per * b // 8 + per // 64 * 2 * itemsize
        assert sizes[b] - quant_payload < sizes[None] - per * itemsize + 1024  # + the marker
        assert sizes[b] < sizes[None]


def test_head_dims_that_are_not_whole_groups_fall_back_to_exact(caplog):
    ids = prompt(40)
    cache = kv_cache(40, 16)  # the tiny LM's head dim, less than any group
    pc = PrefixCache("memory://", model="m", block_size=BS, kv_bits=8, kv_group_size=32)
    with caplog.at_level(logging.WARNING, logger="mlxcache"):
        assert pc.store(ids, [cache]) == 40
    hit = pc.lookup(ids)
    assert hit.num_tokens == 40
    assert bits(hit.prompt_cache[0].keys[..., :40, :]) == bits(cache.keys[..., :40, :])
    # still its own namespace: an exact reader does not take these records
    assert PrefixCache(pc.backend, model="m", block_size=BS).lookup(ids) is None


def test_a_quantized_kv_cache_is_stored_as_it_is():
    from mlx_lm.models.cache import QuantizedKVCache

    live = QuantizedKVCache(group_size=64, bits=8)
    src = kv_cache(40, 64)
    live.update_and_fetch(src.keys[..., :40, :], src.values[..., :40, :])
    ids = prompt(40)
    pc = PrefixCache("memory://", model="m", block_size=BS, kv_bits=4)
    assert pc.store(ids, [live]) == 40
    got = pc.lookup(ids).prompt_cache[0]
    assert type(got) is QuantizedKVCache and (got.bits, got.group_size) == (8, 64)
    for mine, theirs in zip(got.keys, live.keys, strict=True):
        assert bits(mine[..., :40, :]) == bits(theirs[..., :40, :])


# ---------------------------------------------------------------- the tiny models


def _vlm_logits(model, ids, cache=None):
    lm = model.language_model
    kw = {}
    if hasattr(lm, "_rope_deltas"):
        lm._rope_deltas, lm._position_ids = None, None
        if cache is not None:
            kw["rope_deltas"] = mx.array(0)
    cache = make_prompt_cache(lm) if cache is None else cache
    logits = lm(mx.array([list(ids)]), cache=cache, **kw).logits[0, -1]
    mx.eval(logits)
    return logits, cache


def _greedy(model, ids, cache, n):
    out = []
    logits, cache = _vlm_logits(model, ids, cache)
    first = logits
    for _ in range(n):
        tok = int(mx.argmax(logits).item())
        out.append(tok)
        logits, cache = _vlm_logits(model, [tok], cache)
    return first, out


@pytest.mark.parametrize("name", ["qwen2_vl", "gemma3"])
def test_tiny_vlm_restored_from_8_bit_kv(name):
    """Exact mode restores bit-exact logits; 8-bit gives finite logits close to them.

    Nothing bounds a logit's change tightly (it depends on the weights); the assertion is 5% of
    the exact logits' spread, over 10x what these models show with 8-bit KV (0.04-0.4%,
    `python -m benchmarks --only quant`), so a wrong dequantize (scales, order, dtype) fails it.
    Greedy tokens are not asserted: a near tie may flip (gemma3 does, after 11 tokens).
    """
    model = build_model(name)[0]
    ids = prompt(80, seed=1)
    prefix, rest = ids[:-8], ids[-8:]
    _, cache = _vlm_logits(model, prefix)
    ref_logits, ref_tokens = _greedy(model, rest, _vlm_logits(model, prefix)[1], 4)
    for b in (None, 8):
        pc = PrefixCache("memory://", model=name, block_size=BS, kv_bits=b, kv_group_size=32)
        pc.store(prefix, cache)
        hit = pc.lookup(prefix)
        assert hit.num_tokens == len(prefix)
        logits, _ = _greedy(model, rest, hit.prompt_cache, 4)
        if b is None:
            assert bits(logits) == bits(ref_logits)
            continue
        diff = mx.abs(logits - ref_logits).max().item()
        spread = (ref_logits.max() - ref_logits.min()).item()
        assert np.isfinite(diff) and diff <= 0.05 * spread, (diff, spread)


def test_shared_prompt_cache_passes_the_setting_down():
    from mlxcache.integrations.mlx_lm.prompt_cache import SharedPromptCache

    spc = SharedPromptCache(backend="memory://", kv_bits=4, kv_group_size=32)
    assert spc.prefix_cache(("m", None, None)).kv_quant == KVQuant(4, 32)
    assert SharedPromptCache(backend="memory://").prefix_cache(("m", None, None)).kv_quant is None
    with pytest.raises(ValueError, match="kv_bits"):
        SharedPromptCache(backend="memory://", kv_bits=9)


def test_mlx_lm_generation_resumes_from_8_bit_kv(tmp_path):
    """The mlx-lm integration on quantized storage: the warm run restores everything but the
    last token, and its first logits are finite and near the cold run's (see above)."""
    import mlx_lm

    from mlxcache.integrations.mlx_lm import generate_tokens
    from mlxcache.tiny_models import build_tiny_lm

    path = build_tiny_lm(tmp_path / "lm", hidden_size=256, num_heads=4)  # head dim 64
    model, _ = mlx_lm.load(str(path))
    pc = PrefixCache("memory://", model="tiny-lm-64", block_size=BS, kv_bits=8)
    ids = prompt(70, seed=2, high=400)  # the tiny LM's vocabulary is smaller
    cold = generate_tokens(model, ids, cache=pc, max_tokens=4)
    warm = generate_tokens(model, ids, cache=pc, max_tokens=4)
    assert cold.cached_tokens == 0 and cold.stored_tokens == 69 and warm.cached_tokens == 69
    blocks = [r for r in pc.backend.get_many(list(pc.backend.keys(""))) if "kvq" in r.meta]
    assert blocks and all(len(r.meta["kvq"]["arrays"]) == 4 for r in blocks)  # 2 layers, k+v
    diff = mx.abs(warm.first_logits - cold.first_logits).max().item()
    spread = (cold.first_logits.max() - cold.first_logits.min()).item()
    assert np.isfinite(diff) and diff <= 0.05 * spread, (diff, spread)


def test_the_hot_tier_serves_what_the_backend_would():
    """With kv_bits a prefix decodes the same from the hot tier as from the backend: the tier
    keeps the dequantized hit, never the exact caches ``store`` was given."""
    ids = prompt(40)
    cache = kv_cache(40, 128)
    pc = PrefixCache("memory://", model="m", block_size=BS, kv_bits=8)
    pc.store(ids, [cache])
    first = pc.lookup(ids).prompt_cache[0]
    assert bits(first.keys[..., :40, :]) != bits(cache.keys[..., :40, :])  # really quantized
    assert pc.stats()["hot"]["entries"] == 1
    pc.backend.clear()  # the second answer can only come from the hot tier
    again = pc.lookup(ids, require_extras=False)
    assert again is not None and again.num_tokens == 40
    assert bits(again.prompt_cache[0].keys) == bits(first.keys)
