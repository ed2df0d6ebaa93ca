"""The simple-mode VLM takeover samples as mlx-vlm does, for any settings, on a restored prefix.

In this process (mlx-vlm 0.7, as in the vllm-mlx venv): mlxcache's prefill and mlx-vlm's own
sampler and logits processors give the tokens of mlx-vlm's ``generate_step``, cold and
restored from the cache; which settings fall back to vllm-mlx's own path.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcache.integrations.vllm_mlx import vlm_sampling
from mlxcache.prefix import PrefixCache
from mlxcache.tiny_models import build_model

MAX_TOKENS = 8
SEEDED = {"top_p": 0.9, "top_k": 40, "repetition_penalty": 1.3, "seed": 7}
UNSEEDED = {"top_p": 0.9, "min_p": 0.05, "presence_penalty": 0.5, "logit_bias": {3: 2.0}}


class Letters:
    """A stand-in tokenizer (the real ones come from the hub): token i -> a letter."""

    eos_token_id = None

    def decode(self, tokens):
        return "".join(chr(ord("a") + t % 26) for t in tokens)


def _inputs(n: int = 96):
    ids = np.random.default_rng(1).integers(1, 990, size=n).tolist()
    ids[5] = 997  # vision start (the tiny qwen2_vl's README)
    ids[6:22] = [999] * 16
    pixels = np.random.default_rng(2).standard_normal((64, 1176)).astype(np.float32)
    return ids, mx.array(pixels), {"image_grid_thw": mx.array([[1, 8, 8]])}


def _mlx_vlm(model, ids, pixels, kwargs, settings) -> list[int]:
    from mlx_vlm.generate.ar import generate_step

    x = mx.array([ids])
    steps = generate_step(
        x, model, pixels, mx.ones_like(x), max_tokens=MAX_TOKENS, temperature=0.7,
        **settings, **kwargs,
    )  # fmt: skip
    return [int(token) for token, _ in steps]


@pytest.fixture(scope="module")
def model():
    return build_model("qwen2_vl", 0)[0]


@pytest.mark.parametrize("settings", [SEEDED, UNSEEDED], ids=["seeded", "unseeded"])
def test_any_sampling_on_a_restored_prefix_is_mlx_vlms(model, settings):
    ids, pixels, kwargs = _inputs()
    cache = PrefixCache("memory://", model="tiny-qwen2-vl-sampling", block_size=16)
    runs = []
    for _ in range(2):  # cold (stores), then warm (restores all but the last token)
        mx.random.seed(3)
        expected = _mlx_vlm(model, ids, pixels, kwargs, settings)
        mx.random.seed(3)
        out = vlm_sampling.generate(
            model, Letters(), None, None, cache=cache, max_tokens=MAX_TOKENS, temperature=0.7,
            settings=settings, input_ids=ids, pixel_values=pixels, **kwargs,
        )  # fmt: skip
        assert out.tokens == expected[: len(out.tokens)] and out.tokens
        runs.append(out)
    assert (runs[0].cached_tokens, runs[1].cached_tokens) == (0, len(ids) - 1)


def test_only_what_a_prefix_cannot_serve_falls_back():
    assert vlm_sampling.unsupported(0.7, {**SEEDED, **UNSEEDED, "audio": None, "stop": ["x"]}) == []
    assert vlm_sampling.unsupported(0.0, {"tools": [], "verbose": False}) == []
    assert vlm_sampling.unsupported(0.7, {"draft_model": object()}) == ["draft_model"]
    assert vlm_sampling.unsupported(-1, {"audio": ["a.wav"]}) == ["temperature", "audio"]
