"""Window layers (RotatingKVCache of mlx-lm and mlx-vlm, ChunkedKVCache of Llama 4) hit at any block
boundary: stored per block, rebuilt from the blocks holding their window, and continued bit for
bit like the engine's own layer resumed at the same split. A corrupt block is a miss there; a
store written before window layers (whole-window checkpoints in tails) is a miss at a block
boundary and still a right hit at its stored lengths. State layers (ArraysCache) are
checkpointed at their stride, on the engine's own chunk ends, and at branch points
(tests/test_checkpoints.py has the rule)."""

from __future__ import annotations

import copy
import json
import subprocess

import mlx.core as mx
import mlx_lm.models.cache as lmc
import mlx_vlm.models.cache as vlc
import pytest
from helpers import bits
from test_integration_mlx_lm import build_folder, prompt_ids
from vllm_servers import require_vllm_python

from mlxcache import PrefixCache
from mlxcache.backends.memory import MemoryBackend
from mlxcache.prefix import records as pr
from mlxcache.records.record import Record

BS = 8


# ---------------------------------------------------------------- per cache class


def _layers(lib: str, kind: str) -> list:
    import importlib

    m = importlib.import_module(f"{lib}.models.cache")
    if kind == "rotating":
        return [m.RotatingKVCache(max_size=16, keep=0), m.RotatingKVCache(max_size=12, keep=4)]
    return [m.ChunkedKVCache(12), m.KVCache()]


def _feed(layers: list, chunks: list[int], seed: int, start: int = 0) -> list[bytes]:
    """Feed chunks of keys/values (position-seeded, so every run computes the same values
    at a position) as a model would; returns the bytes of every update's output."""
    out = []
    pos = start
    for n in chunks:
        for j, c in enumerate(layers):
            if hasattr(c, "maybe_trim_front"):
                c.maybe_trim_front()  # Llama 4 trims its chunked layers before each call
            rows = [
                mx.random.normal((1, 2, 1, 8), key=mx.random.key(seed * 7919 + p * 31 + j))
                for p in range(pos, pos + n)
            ]
            k = mx.concatenate(rows, axis=2).astype(mx.float16)
            out += [bits(x) for x in c.update_and_fetch(k, k * 2)]
        pos += n
    mx.eval([c.state for c in layers])
    return out


@pytest.mark.parametrize("lib", ["mlx_lm", "mlx_vlm"])
@pytest.mark.parametrize("kind", ["rotating", "chunked"])
def test_a_branch_hits_at_a_block_boundary_like_the_engine(lib, kind):
    """Stored after a 40-token prefill, a request sharing 29 tokens hits at 24 and continues
    (a chunk, then single tokens) exactly as the engine's layers prefilled with those 24."""
    stored = _layers(lib, kind)
    _feed(stored, [40], seed=1)
    pc = PrefixCache(MemoryBackend(), model="m", block_size=BS, hot_bytes=0)
    assert pc.store(list(range(40)), stored) == 40
    request = list(range(29)) + [99] * 10
    hit = pc.lookup(request)
    assert hit is not None and hit.num_tokens == 24
    engine = _layers(lib, kind)
    _feed(engine, [24], seed=1)
    for chunks in ([7, 1, 1], [1, 1, 1, 5]):
        a, b = copy.deepcopy(engine), copy.deepcopy(hit.prompt_cache)
        assert _feed(a, chunks, seed=2, start=24) == _feed(b, chunks, seed=2, start=24)
    # a restore holds no more than the window needs (the blocks before it are not kept)
    held = [c.keys.shape[-2] for c in hit.prompt_cache]
    assert held == ([16, 12] if kind == "rotating" else [12, 24])


@pytest.mark.parametrize("kind", ["rotating", "chunked"])
def test_a_corrupt_block_ends_the_hit_before_it(tmp_path, kind):
    stored = _layers("mlx_lm", kind)
    _feed(stored, [40], seed=1)
    backend = MemoryBackend()
    pc = PrefixCache(backend, model="m", block_size=BS, hot_bytes=0)
    pc.store(list(range(40)), stored)
    for key in list(backend.keys()):
        rec = backend.get(key)
        if rec.meta.get("kind") == "block" and rec.meta["start"] == 16:
            meta = {**rec.meta, "absent": [5]}  # names a layer that is no window layer
            backend.put(key, Record(arrays=dict(rec.arrays), meta=meta))
    hit = pc.lookup(list(range(40)))
    assert hit is not None and hit.num_tokens == 16 and pc.stats()["rejected"] == 1


@pytest.mark.parametrize("where", ["memory", "file"])
def test_a_layer_that_dropped_a_block_is_rebuilt_from_the_tail_or_a_shorter_boundary(
    where, tmp_path
):
    """Decoded past its window the layer no longer holds its first blocks: they are written
    without it (listed absent), the tail keeps the layer whole, and a branch hits only where
    every block its window needs holds it."""
    stored = _layers("mlx_lm", "rotating")
    _feed(stored, [20] + [1] * 20, seed=1)  # 40 tokens, the last 20 one by one
    uri = "memory://" if where == "memory" else f"file://{tmp_path}/c"  # file://: joined reads
    pc = PrefixCache(uri, model="m", block_size=BS, hot_bytes=0)
    assert pc.store(list(range(40)), stored) == 40
    hit = pc.lookup(list(range(40)) + [7])
    assert hit.num_tokens == 40  # the stored length: from the tail's whole layers
    engine = copy.deepcopy(stored)
    assert _feed(engine, [3, 1], 2, 40) == _feed(hit.prompt_cache, [3, 1], 2, 40)
    # this store came after the decode: the blocks the layers no longer held lack them, and a
    # branch at 32 needs positions 16..32 of the 16-token window (absent there): a miss
    assert pc.lookup(list(range(33)) + [99]) is None


# ---------------------------------------------------------------- through mlx-lm's generation


LLAMA4_TEXT = {  # 3 of 4 layers ChunkedKVCache(48), the 4th KVCache
    "attention_bias": False,
    "attention_chunk_size": 48,
    "head_dim": 16,
    "hidden_size": 64,
    "interleave_moe_layer_step": 2,
    "intermediate_size": 64,
    "intermediate_size_mlp": 128,
    "max_position_embeddings": 4096,
    "model_type": "llama4_text",
    "num_attention_heads": 4,
    "num_experts_per_tok": 1,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 2,
    "rms_norm_eps": 1e-5,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "use_qk_norm": True,
    "vocab_size": 500,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import mlx_lm
    from mlx_lm.models import llama4

    root = tmp_path_factory.mktemp("window_models")
    families = ("gemma3_text", "qwen2", "lfm2")
    out = {f: mlx_lm.load(str(build_folder(f, root / f)))[0] for f in families}
    mx.random.seed(0)
    out["llama4"] = llama4.Model(
        llama4.ModelArgs.from_dict({"model_type": "llama4", "text_config": LLAMA4_TEXT})
    )
    mx.eval(out["llama4"].parameters())
    return out


def _engine_at(model, ids, split, options):
    """mlx-lm's generate_step resumed at ``split``: its chunked prefill stopped there."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model, max_kv_size=options.get("max_kv_size"))
    step = options.get("prefill_step_size", 2048)
    for s in range(0, split, step):
        model(mx.array(ids[s : min(s + step, split)])[None], cache=cache)
        mx.eval([c.state for c in cache])
    steps = list(
        generate_step(mx.array(ids[split:]), model, prompt_cache=cache, max_tokens=4, **options)
    )
    return [t for t, _ in steps], bits(steps[0][1])


@pytest.mark.parametrize(
    "family, options",
    [
        ("gemma3_text", {}),  # RotatingKVCache(16) + KVCache
        ("gemma3_text", {"prefill_step_size": 64}),  # chunks aligned to blocks: all stored
        ("qwen2", {"max_kv_size": 64, "prefill_step_size": 48}),  # keep=4, unaligned chunks
        ("llama4", {}),  # ChunkedKVCache(48) + KVCache
        ("llama4", {"prefill_step_size": 64}),
    ],
)
def test_mlx_lm_branch_reuses_the_shared_blocks_bit_exactly(models, family, options):
    from mlxcache.integrations.mlx_lm import generate_tokens

    model = models[family]
    cache = PrefixCache("memory://", model=family, block_size=32, hot_bytes=0)
    ids = prompt_ids(200)
    cold = generate_tokens(model, ids, cache=cache, max_tokens=4, **options)
    assert cold.stored_tokens == 199  # every block, the window layers' slices in each
    branched = ids[:140] + prompt_ids(60, seed=9)
    r = generate_tokens(model, branched, cache=cache, max_tokens=4, **options)
    assert r.cached_tokens == 128
    assert (r.tokens, bits(r.first_logits - mx.logsumexp(r.first_logits, keepdims=True))) == (
        _engine_at(model, branched, 128, options)
    )


# ---------------------------------------------------------------- records from before


def test_a_store_from_before_window_layers_is_a_miss_at_a_block_boundary(monkeypatch):
    """Written as before this change (window layers as whole checkpoints in tails, tagged
    ``c:``): a branch misses, never an error nor a wrong state; the stored length still hits
    right; a new store over it never mixes the two formats."""
    stored = _layers("mlx_lm", "rotating")
    _feed(stored, [40], seed=1)
    backend = MemoryBackend()
    old_tag = pr.layer_tag

    def before(layer):
        tag = old_tag(layer)
        return "c:" + type(layer).__module__ + "." + type(layer).__name__ if tag[0] == "w" else tag

    with monkeypatch.context() as m:
        m.setattr(pr, "layer_tag", before)
        PrefixCache(backend, model="m", block_size=BS, hot_bytes=0).store(list(range(40)), stored)
    assert all(
        t.startswith("c:")
        for t in json.loads(
            json.dumps(backend.get(next(k for k in backend.keys() if "/t/" in k)).meta["layout"])
        )
    )
    pc = PrefixCache(backend, model="m", block_size=BS, hot_bytes=0)
    assert pc.lookup(list(range(29)) + [99]) is None
    hit = pc.lookup(list(range(40)) + [7])
    assert hit.num_tokens == 40
    assert _feed(copy.deepcopy(stored), [3], 2, 40) == _feed(hit.prompt_cache, [3], 2, 40)
    # a new store of a longer prompt: its old blocks stay, its new tail does not fit them
    longer = _layers("mlx_lm", "rotating")
    _feed(longer, [44], seed=1)
    pc.store(list(range(44)), longer)
    assert pc.lookup(list(range(44)) + [7]) is None
    assert pc.stats()["rejected"] >= 1


def test_state_layers_are_checkpointed_at_their_stride_on_the_engines_chunks(models):
    """lfm2 (ArraysCache + KVCache) on blocks of 32: its stride is the smallest multiple of
    lcm(block, prefill step) (its conv state is small beside its KV): in chunks of 64, tails at
    64, 128 and 192 and a branch at 140 resumes at 128; in chunks of 2048 none inside the
    prompt, the first branch misses and leaves its branch point (128), where the next one
    resumes. Each answer is mlx-lm's resumed there and its uncached one (short-conv state)."""
    from mlxcache.integrations.mlx_lm import generate_tokens

    model = models["lfm2"]
    ids = prompt_ids(200)
    for step, tails, first in ((64, [64, 128, 192, 199], 128), (2048, [199], 0)):
        cache = PrefixCache("memory://", model="lfm2", block_size=32, hot_bytes=0)
        options = {"prefill_step_size": step}
        assert (
            generate_tokens(model, ids, cache=cache, max_tokens=4, **options).stored_tokens == 199
        )
        stored = sorted(
            cache.backend.get(k).meta["length"] for k in cache.backend.keys() if "/t/" in k
        )
        assert stored == tails
        for seed, reused in ((9, first), (10, 128)):
            branched = ids[:140] + prompt_ids(60, seed=seed)
            r = generate_tokens(model, branched, cache=cache, max_tokens=4, **options)
            assert r.cached_tokens == reused
            got = (r.tokens, bits(r.first_logits - mx.logsumexp(r.first_logits, keepdims=True)))
            assert (
                got
                == _engine_at(model, branched, 128, options)
                == _engine_at(model, branched, 0, options)
            )


def test_a_mid_prefill_store_writes_whole_blocks_and_only_checkpoint_tails():
    """``store(mid_prefill=True)``: whole blocks only (no partial block, no tail) for block and
    window layers; with a state layer, a tail only at a block-aligned length."""
    from mlx_lm.models.cache import ArraysCache

    windowed = _layers("mlx_lm", "rotating")
    _feed(windowed, [20], seed=1)
    pc = PrefixCache(MemoryBackend(), model="m", block_size=BS, hot_bytes=0)
    assert pc.store(list(range(20)), windowed, mid_prefill=True) == 16
    assert not any("/t/" in k for k in pc.backend.keys())
    assert pc.lookup(list(range(20)) + [5]).num_tokens == 16

    for n, hit in ((20, None), (16, 16)):  # a tail at 16 = 2 blocks; none at 20
        state = ArraysCache(1)
        state[0] = mx.ones((1, 3, 4))
        hybrid = [_layers("mlx_lm", "chunked")[1], state]  # KVCache + ArraysCache
        _feed(hybrid[:1], [n], seed=1)
        pc = PrefixCache(MemoryBackend(), model="h", block_size=BS, hot_bytes=0)
        assert pc.store(list(range(n)), hybrid, mid_prefill=True) == 16
        got = pc.lookup(list(range(20)) + [5])
        assert (got.num_tokens if got else None) == hit


def test_a_chunked_cache_trimmed_on_its_buffer_width_is_never_restored():
    """mlx-lm 0.31 (vllm-mlx's venv) trims a ChunkedKVCache on its padded buffer's width, so a
    restored one (its buffer exactly the tokens held) would attend to other tokens than the
    engine's: refused there, with the reason; mlx-lm 0.32's and mlx-vlm's classes are served."""
    from mlxcache.integrations.resume import unsupported_cache_reason
    from mlxcache.serializers import adapters

    for cls in (lmc.ChunkedKVCache, vlc.ChunkedKVCache):
        assert adapters.unsafe(cls) is None and adapters.find(cls(8)) is not None
    script = (
        "from mlx_lm.models.cache import ChunkedKVCache\n"
        "from mlxcache.serializers.adapters import find\n"
        "from mlxcache.integrations.resume import unsupported_cache_reason\n"
        "print(find(ChunkedKVCache(8)), unsupported_cache_reason([ChunkedKVCache(8)]))\n"
    )
    out = subprocess.run(
        [require_vllm_python(), "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("None mlx_lm.models.cache.ChunkedKVCache trims on its buffer's"), out
    assert unsupported_cache_reason([lmc.ChunkedKVCache(8)]) is None
