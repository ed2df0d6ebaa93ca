"""Image-feature encoders of llava-style and other families, for the table in ``models.py``.

Each is the exact computation the family's ``get_input_embeddings`` runs on ``pixel_values``
when it is not given ``cached_image_features`` (mlx-vlm 0.7.10), so features computed here and
cached give the same embeddings bit for bit. None: an input form the encoder does not handle
(the model then runs its own tower).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def llava(model: Any, pixel_values: mx.array, kwargs: dict[str, Any]) -> mx.array:
    """llava: the selected CLIP layer(s), CLS dropped under the "default" strategy, projected."""
    *_, hidden = model.vision_tower(pixel_values.transpose(0, 2, 3, 1), output_hidden_states=True)
    layer, default = model.vision_feature_layer, model.vision_feature_select_strategy == "default"
    if isinstance(layer, int):
        selected = hidden[layer][:, 1:] if default else hidden[layer]
    else:
        pool = [hidden[i][:, 1:] if default else hidden[i] for i in layer]
        selected = mx.concatenate(pool, axis=-1)
    return model.multi_modal_projector(selected)


def _pixtral_hidden(model: Any, pixel_values: Any, kwargs: dict[str, Any]) -> mx.array | None:
    if not isinstance(pixel_values, mx.array):
        return None  # a list of images: the model stacks them itself
    if pixel_values.ndim == 3:
        pixel_values = pixel_values[None, ...]
    *_, hidden = model.vision_tower(
        pixel_values.transpose(0, 2, 3, 1),
        output_hidden_states=True,
        image_sizes=kwargs.get("image_sizes"),
    )
    return hidden[model.vision_feature_layer]


def pixtral(model: Any, pixel_values: mx.array, kwargs: dict[str, Any]) -> mx.array | None:
    """pixtral: the selected layer of its vision tower, projected."""
    selected = _pixtral_hidden(model, pixel_values, kwargs)
    return None if selected is None else model.multi_modal_projector(selected)


def mistral3(model: Any, pixel_values: mx.array, kwargs: dict[str, Any]) -> mx.array | None:
    """mistral3 (and Ministral 3): pixtral's tower, then its patch-merging projector."""
    selected = _pixtral_hidden(model, pixel_values, kwargs)
    if selected is None:
        return None
    if selected.ndim == 3 and selected.shape[0] == 1:
        selected = selected.squeeze(0)
    return model.multi_modal_projector(selected, kwargs.get("image_sizes"))


def lfm2_vl(model: Any, pixel_values: mx.array, kwargs: dict[str, Any]) -> mx.array:
    """lfm2_vl: its own ``encode_images`` views, joined as ``get_input_embeddings`` joins them."""
    return mx.concatenate(list(model.encode_images(pixel_values, **kwargs)), axis=0)


def aya_vision(model: Any, pixel_values: mx.array, kwargs: dict[str, Any]) -> mx.array | None:
    """aya_vision: llava's selection on its SigLIP tower (with ``spatial_shapes``), projected."""
    strategy = model.vision_feature_select_strategy
    if strategy not in ("default", "full"):
        return None  # the model raises its own error
    *_, hidden = model.vision_tower(
        pixel_values.transpose(0, 2, 3, 1),
        spatial_shapes=kwargs.get("spatial_shapes"),
        output_hidden_states=True,
    )
    selected = hidden[model.vision_feature_layer]
    return model.multi_modal_projector(selected[:, 1:] if strategy == "default" else selected)


def internvl_chat(model: Any, pixel_values: mx.array, kwargs: dict[str, Any]) -> mx.array:
    """internvl_chat: InternViT without its class token, pixel-shuffled, through ``mlp1``."""
    from mlx_vlm.models.base import pixel_shuffle

    pixel_values = pixel_values.astype(model.vision_model.embeddings.patch_embedding.weight.dtype)
    if pixel_values.ndim == 5:
        pixel_values = pixel_values[0]
    hidden, _, _ = model.vision_model(pixel_values.transpose(0, 2, 3, 1), output_hidden_states=True)
    hidden = pixel_shuffle(hidden[:, 1:, :], shuffle_ratio=model.downsample_ratio)
    for layer in model.mlp1:
        hidden = layer(hidden)
    return hidden


def kimi_vl(model: Any, pixel_values: mx.array, kwargs: dict[str, Any]) -> mx.array | None:
    """kimi_vl: MoonViT on the image grid, projected (videos: the model runs its own tower)."""
    grid = kwargs.get("image_grid_hws")
    if grid is None:
        return None
    hidden = model.vision_tower(
        pixel_values.transpose(0, 2, 3, 1),
        output_hidden_states=True,
        grid_thw=grid,
        grid_shapes=kwargs.get("_grid_shapes"),
    )
    return model.multi_modal_projector(hidden)


def molmo(model: Any, pixel_values: mx.array, kwargs: dict[str, Any]) -> mx.array:
    """molmo: its vision tower's pooled crop features (added at ``image_input_idx`` later)."""
    pixel_values = pixel_values.astype(model.vision_tower.image_vit.patch_embedding.weight.dtype)
    masks = kwargs.get("image_masks")
    if pixel_values.ndim == 3:
        pixel_values = mx.expand_dims(pixel_values, 0)
        masks = mx.expand_dims(masks, 0) if masks is not None else None
    features, _ = model.vision_tower(pixel_values, masks)
    return features


def idefics3(model: Any, pixel_values: mx.array, kwargs: dict[str, Any]) -> mx.array:
    """idefics3 / smolvlm: the real (non-padding) images' patches through the tower and the
    pixel-shuffling connector, one row per feature."""
    import numpy as np

    batch, images, channels, height, width = pixel_values.shape
    pixel_values = pixel_values.reshape(batch * images, channels, height, width)
    per_image = np.prod(pixel_values.shape[1:])
    real = np.where((pixel_values == 0.0).sum(axis=(-1, -2, -3)) != per_image)[0].tolist()
    pixel_values = pixel_values[real, ...]
    mask = kwargs.get("pixel_attention_mask")
    if mask is None:
        mask = mx.ones(
            (pixel_values.shape[0], pixel_values.shape[2], pixel_values.shape[3]), dtype=mx.bool_
        )
    else:
        mask = mask.reshape(batch * images, height, width)[real]
    patch = model.config.vision_config.patch_size
    n, height, width = mask.shape
    rows, cols = height // patch, width // patch
    patches = mask[:, : rows * patch, : cols * patch].reshape(n, rows, patch, cols, patch)
    patch_mask = patches.transpose(0, 1, 3, 2, 4).sum(axis=(-1, -2)) > 0
    pooled, *_ = model.vision_model(
        pixel_values.transpose(0, 2, 3, 1),
        patch_attention_mask=patch_mask,
        output_hidden_states=True,
    )
    features = model.connector(pooled.astype(pixel_values.dtype))
    return features.reshape(-1, features.shape[-1])
