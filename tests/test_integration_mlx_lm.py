"""Cached generation with tiny mlx-lm models: warm equals mlx-lm uncached, bit for bit.

The cold run and the warm run of the main test each happen in a fresh Python process (this file
run as a script) on one ``file://`` cache; the reference is mlx-lm's own ``generate_step`` and
``mlx_lm.generate``. The models are tiny random-weight folders built locally (nothing is
downloaded): the llama of ``mlxcache.tiny_models.build_tiny_lm``, and gemma3_text (its cache
mixes RotatingKVCache and KVCache), lfm2 (ArraysCache + KVCache) and qwen2 (RotatingKVCache
under ``max_kv_size``) written with its tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 200
BLOCK_SIZE = 32
MAX_TOKENS = 6
CHAT = [{"role": "user", "content": "Tell me a story about a cat, a dog and a bird."}]

# tiny configs of other architectures (vocabulary and special tokens come from the tiny llama)
ARCHS = {
    "qwen2": {  # no make_cache of its own: max_kv_size gives it RotatingKVCache layers
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
    },
    "gemma3_text": {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "head_dim": 16,
        "num_key_value_heads": 2,
        "query_pre_attn_scalar": 16,
        "sliding_window": 16,  # shorter than the prompts: the rotating layers wrap
        "sliding_window_pattern": 2,
    },
    "lfm2": {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "intermediate_size": 128,
        "full_attn_idxs": [1, 3],
    },
}


# ---------------------------------------------------------------- helpers (both sides)


def build_folder(family: str, path: Path, config: dict | None = None, **kwargs) -> Path:
    """A model folder ``mlx_lm.load`` opens offline: the tiny llama, or another architecture
    (its ``ARCHS`` entry, or ``config``) with the tiny llama's tokenizer and seeded random
    weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxcache.tiny_models import build_tiny_lm

    out = build_tiny_lm(path, **kwargs)
    if family == "llama":
        return out
    import importlib

    arch = importlib.import_module(f"mlx_lm.models.{family}")
    base = json.loads((out / "config.json").read_text())
    cfg = {"model_type": family, **(ARCHS[family] if config is None else config)}
    cfg.update({k: base[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")})
    mx.random.seed(0)
    model = arch.Model(arch.ModelArgs.from_dict(cfg))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def prompt_ids(n: int, seed: int = 1) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(10, 400, size=n).tolist()


def digest(a) -> str:
    import mlx.core as mx

    return hashlib.sha256(bytes(memoryview(mx.contiguous(a)))).hexdigest()


def logprobs(logits):
    """What mlx-lm's generate_step yields for the first token."""
    import mlx.core as mx

    return (logits - mx.logsumexp(logits, keepdims=True)).squeeze(0)


def reference(model, ids, **kwargs):
    """mlx-lm's uncached generate_step: the tokens and the first step's logprobs digest."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    steps = list(generate_step(mx.array(ids), model, max_tokens=MAX_TOKENS, **kwargs))
    return [t for t, _ in steps], digest(steps[0][1])


# ---------------------------------------------------------------- the script side


def script_main(path: str, uri: str, phase: str) -> dict:
    """One process of the equality test: ``cold`` fills the cache, ``warm`` checks it."""
    import mlx_lm

    from mlxcache.integrations.mlx_lm import (
        cached_generate,
        generate_tokens,
        stream_cached_generate,
    )
    from mlxcache.prefix import PrefixCache
    from mlxcache.prefix.model_id import model_identity

    model, tokenizer = mlx_lm.load(path)
    cache = PrefixCache(uri, model=model_identity(model), block_size=BLOCK_SIZE)
    ids = prompt_ids(PROMPT_TOKENS)
    chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    if phase == "cold":
        r = generate_tokens(model, ids, cache=cache, max_tokens=MAX_TOKENS)
        t = cached_generate(model, tokenizer, chat, cache=cache, max_tokens=MAX_TOKENS)
        return {
            "tokens": r.tokens,
            "cached": r.cached_tokens,
            "stored": r.stored_tokens,
            "text": t.text,
            "text_cached": t.cached_tokens,
        }

    warm = generate_tokens(model, ids, cache=cache, max_tokens=MAX_TOKENS)
    ref_tokens, ref_first = reference(model, ids)
    uncached = generate_tokens(model, ids, max_tokens=MAX_TOKENS)
    steps = list(stream_cached_generate(model, tokenizer, chat, cache=cache, max_tokens=MAX_TOKENS))
    text = steps[-1].result
    ref_text = mlx_lm.generate(model, tokenizer, chat, max_tokens=MAX_TOKENS)

    # turn 2: turn 1 + its answer + a new question
    ids2 = ids + warm.tokens + prompt_ids(24, seed=3)
    turn2 = generate_tokens(model, ids2, cache=cache, max_tokens=MAX_TOKENS)
    ref2_tokens, ref2_first = reference(model, ids2)
    return {
        "warm_tokens": warm.tokens,
        "warm_cached": warm.cached_tokens,
        "warm_logprobs": digest(logprobs(warm.first_logits)),
        "uncached_tokens": uncached.tokens,
        "uncached_logits": digest(uncached.first_logits),
        "warm_logits": digest(warm.first_logits),
        "ref_tokens": ref_tokens,
        "ref_logprobs": ref_first,
        "text": text.text,
        "text_steps": "".join(s.text for s in steps),
        "text_cached": text.cached_tokens,
        "text_prompt": text.prompt_tokens,
        "ref_text": ref_text,
        "turn2_tokens": turn2.tokens,
        "turn2_cached": turn2.cached_tokens,
        "turn2_prompt": turn2.prompt_tokens,
        "turn2_logprobs": digest(logprobs(turn2.first_logits)),
        "ref2_tokens": ref2_tokens,
        "ref2_logprobs": ref2_first,
    }


def run_script(path: Path, uri: str, phase: str) -> dict:
    """One side (``phase``) of the main test in a fresh process: what it measured."""
    from helpers import run_file

    return run_file(__file__, str(path), uri, phase)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    """The tiny llama, loaded: (model, tokenizer, folder)."""
    import mlx_lm

    path = build_folder("llama", tmp_path_factory.mktemp("lm") / "llama")
    model, tokenizer = mlx_lm.load(str(path))
    return model, tokenizer, path


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_warm_cache_in_new_process_equals_mlx_lm_uncached(family, tmp_path):
    path = build_folder(family, tmp_path / family)
    uri = f"file://{tmp_path / 'cache'}"
    cold = run_script(path, uri, "cold")
    assert cold["cached"] == 0 and cold["stored"] == PROMPT_TOKENS - 1
    assert cold["text_cached"] == 0

    r = run_script(path, uri, "warm")
    # the same prompt: everything but the last token restored, and the answer is the same
    assert r["warm_cached"] == PROMPT_TOKENS - 1
    assert r["warm_tokens"] == r["uncached_tokens"] == r["ref_tokens"] == cold["tokens"]
    assert r["warm_logits"] == r["uncached_logits"]  # bit-exact first-step logits
    assert r["warm_logprobs"] == r["ref_logprobs"]  # and equal to mlx-lm's own generate_step
    # the text path: the chat prompt restored from the cold process, mlx_lm.generate's text
    assert r["text_cached"] == r["text_prompt"] - 1
    assert r["text"] == r["text_steps"] == r["ref_text"] == cold["text"]
    # turn 2 reuses turn 1 and still answers like uncached, bit for bit
    assert r["turn2_cached"] >= (PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert r["turn2_cached"] < r["turn2_prompt"]
    assert r["turn2_tokens"] == r["ref2_tokens"]
    assert r["turn2_logprobs"] == r["ref2_logprobs"]


def _resume_case(model, options, *, turn2_exact=True):
    """Cold, warm (the same prompt) and turn 2 on a memory cache against generate_step."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from mlxcache.integrations.mlx_lm import generate_tokens
    from mlxcache.prefix import PrefixCache

    cache = PrefixCache("memory://", model="tiny-mlx-lm-test", block_size=BLOCK_SIZE)
    ids = prompt_ids(PROMPT_TOKENS)
    ref_tokens, ref_first = reference(model, ids, **options)
    cold = generate_tokens(model, ids, cache=cache, max_tokens=MAX_TOKENS, **options)
    warm = generate_tokens(model, ids, cache=cache, max_tokens=MAX_TOKENS, **options)
    assert cold.cached_tokens == 0 and cold.stored_tokens == PROMPT_TOKENS - 1
    assert warm.cached_tokens == PROMPT_TOKENS - 1 and warm.stored_tokens == 0
    assert cold.tokens == warm.tokens == ref_tokens
    assert digest(logprobs(cold.first_logits)) == digest(logprobs(warm.first_logits)) == ref_first

    ids2 = ids + warm.tokens + prompt_ids(24, seed=3)
    hit = cache.lookup(ids2[:-1])  # what turn 2 will restore, as mlx-lm's prompt_cache
    turn2 = generate_tokens(model, ids2, cache=cache, max_tokens=MAX_TOKENS, **options)
    assert 0 < turn2.cached_tokens == hit.num_tokens < len(ids2)
    if turn2_exact:
        assert (turn2.tokens, digest(logprobs(turn2.first_logits))) == reference(
            model, ids2, **options
        )
    # always: equal to mlx-lm resuming from the same restored cache (how its server reuses)
    steps = generate_step(
        mx.array(ids2[hit.num_tokens :]),
        model,
        prompt_cache=hit.prompt_cache,
        max_tokens=MAX_TOKENS,
        **options,
    )
    assert turn2.tokens == [t for t, _ in steps]
    return cache


@pytest.mark.parametrize("kind", ["rotating", "quantized", "hybrid"])
def test_every_cache_kind_resumes_like_mlx_lm(kind, tmp_path):
    """RotatingKVCache (max_kv_size), QuantizedKVCache (kv_bits), ArraysCache + KVCache (lfm2)."""
    import mlx_lm

    if kind == "rotating":
        model, _ = mlx_lm.load(str(build_folder("qwen2", tmp_path / "m")))
        # past its window a rotating cache depends on the prefill chunks (in mlx-lm too): turn 2
        # equals mlx-lm resuming from the same cache, not an uncached run
        cache = _resume_case(model, {"max_kv_size": 64}, turn2_exact=False)
        hit = cache.lookup(prompt_ids(PROMPT_TOKENS)[:-1])
        assert [(type(c).__name__, c.max_size) for c in hit.prompt_cache] == [
            ("RotatingKVCache", 64)
        ] * 2
    elif kind == "quantized":  # head_dim 64: KV quantized in groups of 64 from the start
        path = build_folder("llama", tmp_path / "m", hidden_size=128, num_heads=2, num_kv_heads=1)
        model, _ = mlx_lm.load(str(path))
        options = {"kv_bits": 8, "kv_group_size": 64, "quantized_kv_start": 0}
        cache = _resume_case(model, options, turn2_exact=False)
        hit = cache.lookup(prompt_ids(PROMPT_TOKENS)[:-1])
        assert {type(c).__name__ for c in hit.prompt_cache} == {"QuantizedKVCache"}
    else:
        model, _ = mlx_lm.load(str(build_folder("lfm2", tmp_path / "m")))
        classes = [type(c).__name__ for c in model.make_cache()]
        assert classes == ["ArraysCache", "KVCache", "ArraysCache", "KVCache"]
        _resume_case(model, {})


def test_another_layout_is_never_restored(tmp_path, caplog):
    """A prefix stored with another window size is ignored (a warning), never served."""
    import mlx_lm

    from mlxcache.integrations.mlx_lm import generate_tokens
    from mlxcache.prefix import PrefixCache

    model, _ = mlx_lm.load(str(build_folder("qwen2", tmp_path / "m")))
    cache = PrefixCache("memory://", model="tiny-mlx-lm-test", block_size=BLOCK_SIZE)
    ids = prompt_ids(80)
    generate_tokens(model, ids, cache=cache, max_tokens=2, max_kv_size=32)
    expected = generate_tokens(model, ids, max_tokens=3, max_kv_size=48)
    with caplog.at_level(logging.WARNING, logger="mlxcache"):
        r = generate_tokens(model, ids, cache=cache, max_tokens=3, max_kv_size=48)
    assert r.cached_tokens == 0 and r.tokens == expected.tokens
    assert any("another cache layout" in rec.getMessage() for rec in caplog.records)


def test_text_generation_matches_mlx_lm_with_eos_and_logits_processors(tiny_lm):
    import mlx_lm
    from mlx_lm.sample_utils import make_logits_processors
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from mlxcache.integrations.mlx_lm import cached_generate, stream_cached_generate
    from mlxcache.prefix import PrefixCache

    model, tokenizer, path = tiny_lm
    chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    cache = PrefixCache("memory://", model="tiny-mlx-lm-test", block_size=16)

    # logits processors see the whole prompt, cached part included
    seen: list[list[int]] = []

    def record(tokens, logits):
        seen.append(tokens.tolist())
        return logits

    penalty = make_logits_processors(presence_penalty=2.0, presence_context_size=1000)
    procs = {"logits_processors": [record, *penalty]}
    ref = mlx_lm.generate(model, tokenizer, chat, max_tokens=12, **procs)
    ref_seen, seen[:] = list(seen), []
    plain = mlx_lm.generate(model, tokenizer, chat, max_tokens=12)
    assert ref != plain  # the penalty changes the answer, so the next asserts mean something
    for expect_cached in (False, True):
        r = cached_generate(model, tokenizer, chat, cache=cache, max_tokens=12, **procs)
        assert r.text == ref and (r.cached_tokens > 0) is expect_cached
        assert r.finish_reason == "length" and len(r.tokens) == 12
        # the same token history at every step (mlx-lm's pipelined loop runs one step more)
        assert len(seen) == 12 and seen == ref_seen[:12]
        seen.clear()

    # an EOS token stops generation before its text, as in mlx_lm.stream_generate
    tokens = cached_generate(model, tokenizer, chat, cache=cache, max_tokens=12).tokens
    eos_tok = _load_tokenizer(path)
    eos_tok.eos_token_ids = {tokens[3]}
    assert isinstance(eos_tok, TokenizerWrapper)
    ref = mlx_lm.generate(model, eos_tok, chat, max_tokens=12)
    steps = list(stream_cached_generate(model, eos_tok, chat, cache=cache, max_tokens=12))
    r = steps[-1].result
    assert r.tokens == tokens[:4] and r.finish_reason == "stop" and r.cached_tokens > 0
    assert r.text == "".join(s.text for s in steps) == ref
    assert [s.token for s in steps] == r.tokens
    assert 0 < r.time_to_first_token <= r.total_time


def test_first_token_and_total_time_run_on_one_clock(tiny_lm):
    """Encoding the prompt (here a tokenizer that takes 0.3 s) counts in the time to first
    token and in the total time alike, streamed or not: the total is never the shorter."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from mlxcache.integrations.mlx_lm import cached_generate, stream_cached_generate

    model, tokenizer, path = tiny_lm
    delay = 0.3

    class SlowTokenizer(TokenizerWrapper):
        def encode(self, *args, **kwargs):
            time.sleep(delay)
            return self._tokenizer.encode(*args, **kwargs)

    slow = SlowTokenizer(_load_tokenizer(path)._tokenizer, eos_token_ids=[])
    chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    streamed = list(stream_cached_generate(model, slow, chat, max_tokens=4))[-1].result
    whole = cached_generate(model, slow, chat, max_tokens=4)
    for r in (streamed, whole):
        assert len(r.tokens) == 4
        assert delay <= r.time_to_first_token <= r.total_time
        assert r.total_time - r.time_to_first_token < delay  # both hold the encoding


def _load_tokenizer(path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(Path(path))


def test_token_ids_and_progress(tiny_lm):
    """ids as a list, a (1, n) array or a 1-D array; progress counts cached tokens as done."""
    import mlx.core as mx

    from mlxcache.integrations.mlx_lm import generate_tokens, prefill
    from mlxcache.prefix import PrefixCache

    model, _, _ = tiny_lm
    cache = PrefixCache("memory://", model="tiny-mlx-lm-test", block_size=16)
    ids = prompt_ids(50)
    seen: list[tuple[int, int]] = []
    cold = generate_tokens(
        model,
        ids,
        cache=cache,
        max_tokens=3,
        prefill_step_size=16,
        prompt_progress_callback=lambda a, b: seen.append((a, b)),
    )
    assert seen == [(0, 50), (16, 50), (32, 50), (48, 50), (49, 50), (50, 50)]
    seen.clear()
    warm = generate_tokens(
        model,
        mx.array([ids]),
        cache=cache,
        max_tokens=3,
        prompt_progress_callback=lambda a, b: seen.append((a, b)),
    )
    assert seen == [(49, 50), (50, 50)] and warm.tokens == cold.tokens
    assert prefill(model, mx.array(ids), cache=cache).num_cached_tokens == 49
    with pytest.raises(ValueError, match="one non-empty prompt"):
        generate_tokens(model, [], cache=cache)
    with pytest.raises(ValueError, match="non-zero"):
        from mlxcache.integrations.mlx_lm import cached_generate

        cached_generate(model, tiny_lm[1], "hi", max_tokens=0)


def test_another_prompt_reuses_only_the_shared_blocks(tiny_lm):
    """A prompt that differs at token 40 reuses the two whole blocks before it, nothing more."""
    from mlxcache.integrations.mlx_lm import generate_tokens, stream_generate_tokens
    from mlxcache.prefix import PrefixCache

    model, tokenizer, _ = tiny_lm
    cache = PrefixCache("memory://", model="tiny-mlx-lm-test", block_size=16)
    ids = prompt_ids(60)
    generate_tokens(model, ids, cache=cache, max_tokens=2)
    other = ids[:40] + prompt_ids(20, seed=9)
    expected = generate_tokens(model, other, max_tokens=4)
    steps = list(
        stream_generate_tokens(model, other, cache=cache, max_tokens=4, tokenizer=tokenizer)
    )
    r = steps[-1].result
    assert r.cached_tokens == 32 and r.tokens == expected.tokens == [s.token for s in steps]
    assert r.text == "".join(s.text for s in steps) == tokenizer.decode(r.tokens)
    assert (
        generate_tokens(model, prompt_ids(60, seed=5), cache=cache, max_tokens=1).cached_tokens == 0
    )


def test_unsupported_cache_class_runs_uncached(tmp_path, caplog):
    import mlx_lm
    from mlx_lm.models.cache import KVCache

    from mlxcache.integrations.mlx_lm import generate_tokens
    from mlxcache.prefix import PrefixCache

    class HomeMadeKVCache(KVCache):
        """A cache class the serializers do not know (classes are matched exactly)."""

    model, _ = mlx_lm.load(str(build_folder("llama", tmp_path / "m")))
    ids = prompt_ids(64)
    expected = generate_tokens(model, ids, max_tokens=4)
    model.make_cache = lambda: [HomeMadeKVCache() for _ in model.layers]
    cache = PrefixCache("memory://", model="tiny-mlx-lm-test", block_size=16)
    with caplog.at_level(logging.INFO, logger="mlxcache"):
        for _ in range(2):
            r = generate_tokens(model, ids, cache=cache, max_tokens=4)
            assert not r.cached and r.cached_tokens == 0 and r.stored_tokens == 0
            assert r.tokens == expected.tokens
            assert digest(r.first_logits) == digest(expected.first_logits)
    lines = [rec.getMessage() for rec in caplog.records if "running uncached" in rec.getMessage()]
    assert len(lines) == 2 and "HomeMadeKVCache" in lines[0]
    assert len(cache.backend) == 0


@pytest.mark.parametrize("fail", ["lookup", "store", "stopped-redis"])
def test_a_failing_cache_never_breaks_generation(fail, tiny_lm, caplog):
    """A backend that raises, or a Redis that was stopped: the same tokens, uncached.

    The backend path: the hot tier is off (it would serve what this process stored).
    """
    from helpers import BrokenBackend
    from redis_server import RedisServer

    from mlxcache import open_backend
    from mlxcache.integrations.mlx_lm import cached_generate, generate_tokens
    from mlxcache.prefix import PrefixCache

    model, tokenizer, _ = tiny_lm
    ids = prompt_ids(40)
    expected = generate_tokens(model, ids, max_tokens=3)
    server = None
    if fail == "stopped-redis":
        server = RedisServer()
        backend = open_backend(f"{server.url}?timeout=0.5")
        cache = PrefixCache(backend, model="tiny-mlx-lm-test", block_size=16, hot_bytes=0)
        assert generate_tokens(model, ids, cache=cache, max_tokens=3).stored_tokens == 39
        server.close()  # the server dies under a cache that just worked
    else:
        cache = PrefixCache(
            BrokenBackend(fail), model="tiny-mlx-lm-test", block_size=16, hot_bytes=0
        )
    try:
        with caplog.at_level(logging.WARNING, logger="mlxcache"):
            for _ in range(2):
                r = generate_tokens(model, ids, cache=cache, max_tokens=3)
                assert r.tokens == expected.tokens and r.cached_tokens == 0
                assert r.stored_tokens == 0  # nothing was kept, so nothing is reported stored
                assert digest(r.first_logits) == digest(expected.first_logits)
            text = cached_generate(model, tokenizer, "Hello, how are you", cache=cache)
            assert text.cached_tokens == 0 and text.text
        messages = [rec.getMessage() for rec in caplog.records]
        if fail == "stopped-redis":
            assert any("redis" in m.lower() for m in messages), messages
        else:
            assert any("backend bug" in m for m in messages)
    finally:
        cache.close()
        if server is not None:
            backend.close()


def test_model_identity_of_mlx_lm_models(tmp_path):
    """mlx-lm models carry ``.args`` (a ModelArgs dataclass), not ``.config``."""
    import mlx.nn as nn
    import mlx_lm

    from mlxcache.prefix.model_id import model_identity

    path = build_folder("llama", tmp_path / "a")
    model, _ = mlx_lm.load(str(path))
    ident = model_identity(model)
    assert ident.startswith("llama/cfg-") and "/q-none/w-" in ident
    assert model_identity(mlx_lm.load(str(path))[0]) == ident  # another load, the same model
    deeper, _ = mlx_lm.load(str(build_folder("llama", tmp_path / "b", num_layers=3)))
    assert model_identity(deeper) != ident
    reseeded, _ = mlx_lm.load(str(build_folder("llama", tmp_path / "c", seed=1)))
    assert model_identity(reseeded) == ident  # same shapes: only hash_weights tells them apart
    assert model_identity(reseeded, hash_weights=True) != model_identity(model, hash_weights=True)
    nn.quantize(model, group_size=64, bits=4)
    assert "/q-4b64/" in model_identity(model)
    gemma, _ = mlx_lm.load(str(build_folder("gemma3_text", tmp_path / "g")))
    assert model_identity(gemma).startswith("gemma3_text/cfg-")


if __name__ == "__main__":
    print(json.dumps(script_main(sys.argv[1], sys.argv[2], sys.argv[3])))
