"""Image features of Qwen3-VL, Qwen3.5 and PaddleOCR-VL: the computation each model's
``get_input_embeddings`` runs on ``pixel_values``, so ``models.FAMILIES`` can cache it.

Each returns None for what it does not cover (videos): the model then runs its own tower.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def qwen3_vl_encoder(model: Any, pixel_values: mx.array, kwargs: dict[str, Any]) -> mx.array | None:
    """The tower's features with its deepstack rows (one set per deepstack layer) stacked after
    them: what Qwen3-VL's ``get_input_embeddings`` computes from ``pixel_values``."""
    grid = kwargs.get("image_grid_thw")
    if grid is None or kwargs.get("video_grid_thw") is not None:
        return None  # videos: let the model run its own tower
    dtype = model.vision_tower.patch_embed.proj.weight.dtype
    hidden, deepstack = model.vision_tower(pixel_values.astype(dtype), grid)
    if any(d.dtype != hidden.dtype or d.shape != hidden.shape for d in deepstack):
        return None
    return mx.concatenate([hidden, *deepstack], axis=0)


def qwen3_vl_unpack(model: Any, features: mx.array) -> tuple[mx.array, dict[str, Any]]:
    """(features, {"deepstack_visual_embeds": rows}): given ``cached_image_features``, Qwen3-VL's
    ``get_input_embeddings`` leaves the deepstack rows out, so they are added back."""
    layers = len(model.config.vision_config.deepstack_visual_indexes)
    hidden, *deepstack = mx.split(features, layers + 1, axis=0)
    return hidden, {"deepstack_visual_embeds": deepstack}


def qwen3_5_encoder(model: Any, pixel_values: mx.array, kwargs: dict[str, Any]) -> mx.array | None:
    """Qwen3.5's image features: the tower's hidden states (it has no deepstack rows)."""
    grid = kwargs.get("image_grid_thw")
    if grid is None:
        return None  # videos: let the model run its own tower
    dtype = model.vision_tower.patch_embed.proj.weight.dtype
    hidden, _ = model.vision_tower(pixel_values.astype(dtype), grid)
    return hidden


def paddleocr_encoder(
    model: Any, pixel_values: mx.array, kwargs: dict[str, Any]
) -> mx.array | None:
    """PaddleOCR-VL's image features (its tower is ``model.visual``)."""
    grid = kwargs.get("image_grid_thw")
    if grid is None:
        return None  # videos: let the model run its own tower
    dtype = model.visual.embeddings.patch_embedding.weight.dtype
    return model.visual(mx.array(pixel_values, dtype=dtype), grid, output_hidden_states=False)
