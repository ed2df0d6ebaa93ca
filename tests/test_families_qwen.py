"""Hits that end inside an image, and text-only prompts, for the families whose language model
aligns per-token image inputs (deepstack rows, visual masks, M-RoPE positions) with its cache
offset (issue 25).

The matrix (test_families.py) only resumes after an image; here a prompt that ends with its
image is stored (its last image token runs alone), then the whole prompt resumes at that stored
length, inside the image; a cached family also resumes a prompt ending in its image at the
block boundary the image spans. Every answer is the engine's, bit for bit.
"""

from __future__ import annotations

import pytest

pytest.importorskip("mlx_vlm")

from families import harness, specs_qwen  # noqa: E402

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


@pytest.mark.parametrize("name", sorted(SPECS))
def test_text_only_prompts_answer_like_the_engine(name, tmp_path):
    """Without an image the same models keep text M-RoPE positions: cold, warm, extended."""
    spec = SPECS[name]
    model = harness.build(spec)
    ids = harness.text(spec, harness.PROMPT, 1)
    cache = harness.open_cache(model, f"file://{tmp_path}")
    got = [harness.check(spec, model, p, None, {}, cache) for p in (ids, ids, ids + ids[:24])]
    assert all(g["exact"] for g in got), got
    assert [g["cached"] for g in got] == [0, harness.PROMPT - 1, harness.PROMPT - 1]
