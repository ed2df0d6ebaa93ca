"""Cached generation with tiny mlx-vlm models: warm equals uncached, bit for bit, across processes.

The cold run and the warm run each happen in a fresh Python process (this file run as a
script) on one ``file://`` cache; the reference is mlx-vlm's own uncached ``generate_step``.
"""

from __future__ import annotations

import io
import json
import logging
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_vlm")

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 200
BLOCK_SIZE = 32
MAX_TOKENS = 6


# ---------------------------------------------------------------- the script side


def _inputs(family: str, n: int, seed: int = 1):
    """Seeded prompt ids with one image (per the tiny models' README) and its model inputs."""
    import mlx.core as mx
    import numpy as np

    ids = np.random.default_rng(seed).integers(1, 990, size=n).tolist()
    if family == "qwen2_vl":
        ids[5] = 997  # vision start
        ids[6:22] = [999] * 16
        pixels = np.random.default_rng(2).standard_normal((64, 1176)).astype(np.float32)
        return ids, mx.array(pixels), {"image_grid_thw": mx.array([[1, 8, 8]])}
    ids[6:22] = [999] * 16
    pixels = np.random.default_rng(2).standard_normal((1, 3, 112, 112)).astype(np.float32)
    return ids, mx.array(pixels), {}


def _bytes_hex(a) -> str:
    import hashlib

    import mlx.core as mx

    return hashlib.sha256(bytes(memoryview(mx.contiguous(a)))).hexdigest()


def _reference(model, ids, pixel_values, kwargs):
    """mlx-vlm's uncached greedy generation: tokens and the first step's logprobs digest."""
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step

    x = mx.array([ids])
    tokens, first = [], None
    steps = generate_step(
        x, model, pixel_values, mx.ones_like(x), max_tokens=MAX_TOKENS, temperature=0.0, **kwargs
    )
    for tok, logprobs in steps:
        tokens.append(tok)
        first = logprobs if first is None else first
    return tokens, _bytes_hex(first)


def _run(model, ids, pixel_values=None, **kwargs):
    """mlxcache's generation: (the GenerationResult, the first step's logprobs digest)."""
    from mlxcache.integrations.mlx_vlm import stream_generate_tokens

    steps = list(stream_generate_tokens(model, ids, pixel_values, **kwargs))
    return steps[-1].result, _bytes_hex(steps[0].logprobs)


def _logprobs(logits):
    import mlx.core as mx

    return (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).squeeze(0)


def script_main(family: str, uri: str, phase: str) -> dict:
    """One process of the equality test: ``cold`` fills the cache, ``warm`` checks it."""
    import mlx.core as mx
    import numpy as np

    from mlxcache.integrations.mlx_vlm import generate_tokens
    from mlxcache.prefix import PrefixCache
    from mlxcache.prefix.model_id import model_identity
    from mlxcache.tiny_models import build_model

    model, _ = build_model(family, 0)
    cache = PrefixCache(uri, model=model_identity(model), block_size=BLOCK_SIZE)
    ids, pixel_values, kwargs = _inputs(family, PROMPT_TOKENS)
    if phase == "cold":
        r = generate_tokens(model, ids, pixel_values, cache=cache, max_tokens=MAX_TOKENS, **kwargs)
        return {"tokens": r.tokens, "cached": r.cached_tokens, "stored": r.stored_tokens}

    # count the vision encoder's calls (instrumentation of the real model, not a mock)
    tower = type(model.vision_tower)
    calls = {"n": 0}
    original = tower.__call__

    def counting(self, *a, **k):
        calls["n"] += 1
        return original(self, *a, **k)

    tower.__call__ = counting
    warm = generate_tokens(model, ids, pixel_values, cache=cache, max_tokens=MAX_TOKENS, **kwargs)
    warm_vision_calls = calls["n"]
    from mlxcache.integrations.mlx_vlm import stream_generate_tokens

    uncached_steps = list(
        stream_generate_tokens(model, ids, pixel_values, max_tokens=MAX_TOKENS, **kwargs)
    )
    uncached = uncached_steps[-1].result
    ref_tokens, ref_first = _reference(model, ids, pixel_values, kwargs)

    # turn 2: turn 1 + its answer + a new question
    question = np.random.default_rng(3).integers(1, 990, size=24).tolist()
    ids2 = ids + warm.tokens + question
    turn2 = generate_tokens(model, ids2, pixel_values, cache=cache, max_tokens=MAX_TOKENS, **kwargs)
    ref2_tokens, ref2_first = _reference(model, ids2, pixel_values, kwargs)
    mx.eval(warm.first_logits)
    return {
        "warm_tokens": warm.tokens,
        "warm_cached": warm.cached_tokens,
        "warm_vision_cached": warm.vision_cached,
        "warm_vision_calls": warm_vision_calls,
        "warm_logprobs": _bytes_hex(_logprobs(warm.first_logits)),
        "uncached_tokens": uncached.tokens,
        "uncached_logprobs": _bytes_hex(uncached_steps[0].logprobs),
        "ref_tokens": ref_tokens,
        "ref_logprobs": ref_first,
        "turn2_tokens": turn2.tokens,
        "turn2_cached": turn2.cached_tokens,
        "turn2_prompt": turn2.prompt_tokens,
        "turn2_logprobs": _bytes_hex(_logprobs(turn2.first_logits)),
        "ref2_tokens": ref2_tokens,
        "ref2_logprobs": ref2_first,
    }


def _run_script(family: str, uri: str, phase: str) -> dict:
    """One side (``phase``) of the main test in a fresh process: what it measured."""
    from helpers import run_file

    return run_file(__file__, family, uri, phase)


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3"])
def test_warm_cache_in_new_process_equals_uncached(family, tmp_path):
    uri = f"file://{tmp_path / 'cache'}"
    cold = _run_script(family, uri, "cold")
    assert cold["cached"] == 0 and cold["stored"] == PROMPT_TOKENS - 1

    r = _run_script(family, uri, "warm")
    # the same prompt: everything but the last token restored, and the answer is the same
    assert r["warm_cached"] == PROMPT_TOKENS - 1
    assert r["warm_tokens"] == r["uncached_tokens"] == r["ref_tokens"] == cold["tokens"]
    # bit-exact first-step log-probabilities: warm, uncached (the engine's own path) and
    # mlx-vlm's generate_step called here
    assert r["warm_logprobs"] == r["uncached_logprobs"] == r["ref_logprobs"]
    # the image's embeddings came from the cache: the vision encoder never ran
    assert r["warm_vision_cached"] is True
    assert r["warm_vision_calls"] == 0
    # turn 2 reuses turn 1 (at least its whole blocks) and still answers like uncached
    assert r["turn2_cached"] >= (PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert r["turn2_cached"] < r["turn2_prompt"]
    assert r["turn2_tokens"] == r["ref2_tokens"]
    assert r["turn2_logprobs"] == r["ref2_logprobs"]


def test_unsupported_cache_class_runs_uncached(caplog):
    from mlx_vlm.models.cache import KVCache

    from mlxcache.integrations.mlx_vlm import stream_generate_tokens
    from mlxcache.prefix import PrefixCache
    from mlxcache.tiny_models import build_model

    class HomeMadeKVCache(KVCache):
        """A cache class the serializers do not know (classes are matched exactly)."""

    model, _ = build_model("qwen2_vl", 0)
    ids, pixel_values, kwargs = _inputs("qwen2_vl", 64)
    expected, expected_first = _reference(model, ids, pixel_values, kwargs)
    lm = model.language_model
    lm.make_cache = lambda: [HomeMadeKVCache() for _ in lm.layers]
    cache = PrefixCache("memory://", model="tiny-qwen2-vl-test", block_size=16)
    with caplog.at_level(logging.INFO, logger="mlxcache"):
        for _ in range(2):
            steps = list(
                stream_generate_tokens(
                    model, ids, pixel_values, cache=cache, max_tokens=MAX_TOKENS, **kwargs
                )
            )
            r = steps[-1].result
            assert not r.cached and r.cached_tokens == 0 and r.stored_tokens == 0
            # the engine's own path: its tokens and log-probabilities, bit for bit
            assert r.tokens == expected
            assert _bytes_hex(steps[0].logprobs) == expected_first
    lines = [rec.getMessage() for rec in caplog.records if "own path" in rec.getMessage()]
    assert len(lines) == 1 and "HomeMadeKVCache" in lines[0]  # once per model, not per request
    assert len(cache.backend) == 0


def test_another_image_never_reuses_the_prefix_and_text_only_prompts_work():
    from mlxcache.integrations.mlx_vlm import generate_tokens
    from mlxcache.prefix import PrefixCache
    from mlxcache.tiny_models import build_model

    model, _ = build_model("qwen2_vl", 0)
    ids, pixel_values, kwargs = _inputs("qwen2_vl", 64)
    cache = PrefixCache("memory://", model="tiny-qwen2-vl-test", block_size=16)
    generate_tokens(model, ids, pixel_values, cache=cache, max_tokens=2, **kwargs)
    other = pixel_values[::-1]  # the same prompt with another image
    expected = generate_tokens(model, ids, other, max_tokens=3, **kwargs)
    r = generate_tokens(model, ids, other, cache=cache, max_tokens=3, **kwargs)
    assert r.cached_tokens == 0 and not r.vision_cached and r.tokens == expected.tokens

    text = [t for t in ids if t < 990]  # no image at all
    expected = generate_tokens(model, text, max_tokens=3)
    generate_tokens(model, text, cache=cache, max_tokens=3)
    r = generate_tokens(model, text, cache=cache, max_tokens=3)
    assert r.cached_tokens == len(text) - 1 and r.tokens == expected.tokens


def test_another_video_never_reuses_the_prefix():
    """Pixels passed as another model input (``pixel_values_videos``) key the prefix too."""
    import mlx.core as mx
    import numpy as np

    from mlxcache.integrations.mlx_vlm import stream_generate_tokens
    from mlxcache.prefix import PrefixCache
    from mlxcache.tiny_models import build_model

    model, _ = build_model("qwen2_vl", 0)
    ids = np.random.default_rng(1).integers(1, 990, size=40).tolist()
    ids[5], ids[6:22] = 997, [998] * 16  # vision start, then the video's 16 tokens
    grid = mx.array([[1, 8, 8]])
    v1, v2 = (
        mx.array(np.random.default_rng(s).standard_normal((64, 1176)).astype(np.float32))
        for s in (2, 3)
    )
    cache = PrefixCache("memory://", model="tiny-qwen2-vl-test", block_size=16)
    kw = {"max_tokens": 4, "video_grid_thw": grid}

    def run(**more):
        steps = list(stream_generate_tokens(model, ids, **kw, **more))
        return steps[-1].result, _bytes_hex(steps[0].logprobs)

    run(cache=cache, pixel_values_videos=v1)
    expected, expected_first = run(pixel_values_videos=v2)
    r, _ = run(cache=cache, pixel_values_videos=v2)
    assert r.cached_tokens == 0 and r.tokens == expected.tokens
    again, again_first = run(cache=cache, pixel_values_videos=v2)
    assert again.cached_tokens == 39 and again.tokens == expected.tokens
    assert again_first == expected_first


@pytest.mark.parametrize("fail", ["lookup", "store", "dead-redis"])
def test_a_failing_cache_never_breaks_generation(fail, caplog):
    """A backend that raises, or a dead Redis: the same tokens and logits as uncached."""
    from helpers import BrokenBackend

    from mlxcache import open_backend
    from mlxcache.prefix import PrefixCache
    from mlxcache.tiny_models import build_model

    model, _ = build_model("qwen2_vl", 0)
    ids, pixel_values, kwargs = _inputs("qwen2_vl", 40)
    expected, expected_first = _run(model, ids, pixel_values, max_tokens=3, **kwargs)
    if fail == "dead-redis":
        backend = open_backend("redis://127.0.0.1:1/0?timeout=0.2")
    else:
        backend = BrokenBackend(fail)
    cache = PrefixCache(
        backend, model="tiny-qwen2-vl-test", block_size=16, hot_bytes=0
    )  # the backend path
    with caplog.at_level(logging.WARNING, logger="mlxcache"):
        for _ in range(2):
            r, first = _run(model, ids, pixel_values, cache=cache, max_tokens=3, **kwargs)
            assert r.tokens == expected.tokens and r.cached_tokens == 0
            assert r.stored_tokens == 0  # nothing was kept, so nothing is reported stored
            assert first == expected_first
    if fail != "dead-redis":
        assert any("backend bug" in rec.getMessage() for rec in caplog.records)


def test_cached_generate_with_prepared_inputs_and_a_tokenizer():
    from mlxcache.integrations.mlx_vlm import cached_generate, stream_cached_generate
    from mlxcache.prefix import PrefixCache
    from mlxcache.tiny_models import build_model

    class Letters:
        """A stand-in tokenizer (the real ones come from the hub): token i -> a letter."""

        eos_token_id = None

        def decode(self, tokens):
            return "".join(chr(ord("a") + t % 26) for t in tokens)

    model, _ = build_model("qwen2_vl", 0)
    ids, pixel_values, kwargs = _inputs("qwen2_vl", 96)
    cache = PrefixCache("memory://", model="tiny-qwen2-vl-test", block_size=16)
    inputs = {"input_ids": ids, "pixel_values": pixel_values, **kwargs}
    cold = cached_generate(model, Letters(), cache=cache, max_tokens=5, **inputs)
    steps = list(stream_cached_generate(model, Letters(), cache=cache, max_tokens=5, **inputs))
    warm = steps[-1].result
    assert cold.text == Letters().decode(cold.tokens) and len(cold.text) == 5
    assert "".join(s.text for s in steps) == cold.text == warm.text
    assert warm.tokens == cold.tokens
    assert cold.cached_tokens == 0 and warm.cached_tokens == 95
    assert 0 < warm.time_to_first_token <= warm.total_time


def test_demo_on_a_file_cache(tmp_path):
    from mlxcache.cli.demo import run_demo

    out = io.StringIO()
    code = run_demo(
        f"file://{tmp_path / 'cache'}", prompt_tokens=160, max_tokens=4, block_size=32, out=out
    )
    text = out.getvalue()
    assert code == 0, text
    assert "matches cold" in text and "matches uncached" in text
    assert "159 / 160" in text  # the new process reused all but the last prompt token


if __name__ == "__main__":
    print(json.dumps(script_main(sys.argv[1], sys.argv[2], sys.argv[3])))
