"""Qwen3-VL, Qwen3.5, GLM-4V and PaddleOCR-VL beyond the matrix: M-RoPE position state and
per-token image inputs (deepstack rows, visual masks) at a resumed cache offset (issue 25).

The matrix (test_families.py) only resumes after an image; here a prompt that ends with its
image is stored (its last image token runs alone), then the whole prompt resumes at that stored
length, inside the image; a cached family also resumes a prompt ending in its image at the
block boundary the image spans, and a two-image prompt one inside its second image. Text-only
prompts follow an image prompt, and the families whose positions depend on mlx-vlm's prefill
chunks run at two step sizes. Every answer is the engine's, bit for bit.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("mlx_vlm")

from families import harness, specs_qwen  # noqa: E402

from mlxcache.integrations.mlx_vlm.models import FAMILIES  # noqa: E402

SPECS = {s.name: s for s in specs_qwen.SPECS if s.image is not None and s.expect != "refused"}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_hit_inside_an_image_answers_like_the_engine(name, tmp_path):
    spec = SPECS[name]
    model = harness.build(spec)
    ids, pixels, kwargs = harness.prompt(spec)
    image_end = harness.IMAGE_AT + len(spec.image(2)[2])
    ends_in_image = ids[:image_end]

    cache = harness.open_cache(model, f"file://{tmp_path / 'short'}")
    first = harness.check(spec, model, ends_in_image, pixels, kwargs, cache)
    whole = harness.check(spec, model, ids, pixels, kwargs, cache)
    assert first["exact"] and whole["exact"], (first, whole)
    assert first["cached"] == 0
    assert whole["cached"] == image_end - 1  # the stored length: before the last image token

    if spec.expect == "cached":  # any block boundary: one inside the image
        assert harness.IMAGE_AT < harness.BLOCK < image_end - 1
        cache = harness.open_cache(model, f"file://{tmp_path / 'long'}")
        whole = harness.check(spec, model, ids, pixels, kwargs, cache)
        short = harness.check(spec, model, ends_in_image, pixels, kwargs, cache)
        assert whole["exact"] and short["exact"], (whole, short)
        assert short["cached"] == harness.BLOCK


# qwen3_5_moe runs qwen3_5's language model code; paddleocr_vl, like glm4v, prefills at the
# positions positions.py gives and decodes at offset + rope_deltas (the step-size test below)
TEXT = sorted(n for n in SPECS if n not in ("qwen3_5_moe", "paddleocr_vl"))


@pytest.mark.parametrize("name", TEXT)
def test_text_only_prompts_answer_like_the_engine(name, tmp_path):
    """Without an image (after one: no position state left over) the same models keep text
    M-RoPE positions: cold, warm, extended."""
    spec = SPECS[name]
    model = harness.build(spec)
    cache = harness.open_cache(model, f"file://{tmp_path}")
    assert harness.check(spec, model, *harness.prompt(spec), cache)["exact"]
    ids = harness.text(spec, harness.PROMPT, 1)
    got = [harness.check(spec, model, p, None, {}, cache) for p in (ids, ids, ids + ids[:24])]
    assert all(g["exact"] for g in got), got
    assert [g["cached"] for g in got] == [0, harness.PROMPT - 1, harness.PROMPT - 1]


@pytest.mark.parametrize("name", ["qwen3_vl", "glm4v"])  # deepstack rows; sliced positions
def test_two_images_and_a_hit_inside_the_second(name, tmp_path):
    """Two images (A at 8, B at 60..96): repeat, extension, and the prompt cut after B's last
    token, whose hit (the block at 96) ends inside B."""
    import mlx.core as mx

    spec = SPECS[name]
    model = harness.build(spec)
    ids = harness.text(spec, 110, 1)
    (pixels_a, kwargs_a, tokens_a), (pixels_b, kwargs_b, tokens_b) = spec.image(2), spec.image(5)
    ids[8 : 8 + len(tokens_a)], ids[60 : 60 + len(tokens_b)] = tokens_a, tokens_b
    pixels = mx.concatenate([pixels_a, pixels_b])
    grids = mx.concatenate([kwargs_a["image_grid_thw"], kwargs_b["image_grid_thw"]])
    cache = harness.open_cache(model, f"file://{tmp_path}")
    prompts = (ids, ids, ids + harness.text(spec, 20, 9), ids[: 60 + len(tokens_b)])
    got = [harness.check(spec, model, p, pixels, {"image_grid_thw": grids}, cache) for p in prompts]
    assert all(g["exact"] for g in got), got
    assert [g["cached"] for g in got] == [0, 109, 109, 96]


def _engine(model, ids, pixels, kwargs, step):
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step

    x = mx.array([ids])
    steps = generate_step(
        x,
        model,
        pixels,
        mx.ones_like(x),
        max_tokens=harness.MAX_TOKENS,
        temperature=0.0,
        prefill_step_size=step,
        **kwargs,
    )
    tokens, logprobs = zip(*((int(t), lp) for t, lp in steps), strict=True)
    return list(tokens), harness.digest(list(logprobs))


def _ours(model, ids, pixels, kwargs, cache, step):
    from mlxcache.integrations.mlx_vlm import stream_generate_tokens

    steps = list(
        stream_generate_tokens(
            model,
            ids,
            pixels,
            cache=cache,
            max_tokens=harness.MAX_TOKENS,
            prefill_step_size=step,
            **kwargs,
        )
    )
    return steps[-1].result.tokens, harness.digest([s.logprobs for s in steps]), steps[-1].result


SLICED = sorted(n for n in SPECS if FAMILIES[SPECS[n].config["model_type"]].slice_positions)


@pytest.mark.parametrize("name", SLICED)
def test_positions_past_the_engines_first_chunk(name, tmp_path, caplog):
    """GLM-4V and PaddleOCR-VL place tokens past mlx-vlm's first prefill chunk at
    ``offset + rope_deltas``: text there is resumed; an image there is not (engine's answer)."""
    spec = SPECS[name]
    model = harness.build(spec)
    ids, pixels, kwargs = harness.prompt(spec)
    cache = harness.open_cache(model, f"file://{tmp_path}")
    cached = []
    with caplog.at_level(logging.INFO, logger="mlxcache"):
        for step in (64, 64, 16, 16):  # the image (8..44) lies in the first 64 tokens, not 16
            tokens, digest, result = _ours(model, ids, pixels, kwargs, cache, step)
            assert (tokens, digest) == _engine(model, ids, pixels, kwargs, step), step
            cached.append((result.cached_tokens, result.cached))
    n = harness.PROMPT
    assert cached == [(0, True), (n - 1, True), (0, False), (0, False)]
    assert [m for m in caplog.messages if "first prefill chunk" in m], caplog.messages
