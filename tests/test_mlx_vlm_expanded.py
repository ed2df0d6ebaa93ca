"""Prompts whose image placeholder expands into the image's rows (llava_next, phi4mm).

One placeholder: keyed in embedding positions (tests/families/specs_expand.py runs the
scenarios). Several placeholders are not mapped: the request runs uncached, with mlx-vlm's
chunked-prefill calls over every embedding, and answers like the engine.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("mlx_vlm")

from families import harness  # noqa: E402
from families.specs_expand import SPECS  # noqa: E402

from mlxcache.integrations.mlx_vlm.expanded import one_placeholder_expanded  # noqa: E402


class _Config:
    image_token_index = 9


class _Model:
    config = _Config()


def test_one_placeholder_is_repeated_once_per_row():
    assert one_placeholder_expanded(_Model(), [1, 9, 2], 6) == [1, 9, 9, 9, 9, 2]
    assert one_placeholder_expanded(_Model(), [1, 9, 2], 3) == [1, 9, 2]


def test_prompts_that_do_not_map_give_none():
    assert one_placeholder_expanded(_Model(), [1, 9, 9, 2], 9) is None  # two placeholders
    assert one_placeholder_expanded(_Model(), [1, 2], 5) is None  # none
    assert one_placeholder_expanded(_Model(), [1, 9, 2], 2) is None  # fewer rows than ids


def test_two_placeholders_run_uncached_and_answer_like_the_engine(tmp_path, caplog):
    spec = next(s for s in SPECS if s.name == "llava_next")
    model = harness.build(spec)
    ids, pixels, kwargs = harness.prompt(spec)
    ids[40] = spec.config["image_token_index"]  # a second placeholder: two rows of features
    cache = harness.open_cache(model, f"file://{tmp_path}")
    with caplog.at_level(logging.INFO, logger="mlxcache"):
        runs = [harness.check(spec, model, ids, pixels, kwargs, cache) for _ in range(2)]
    for got in runs:
        assert got["exact"] and got["cached"] == 0 and not got["cached_flag"], got
        assert got["positions"] > len(ids)  # every embedding ran
    told = [m for m in caplog.messages if "another length" in m]
    assert len(told) == 1, caplog.messages
