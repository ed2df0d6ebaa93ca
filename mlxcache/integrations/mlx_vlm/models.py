"""What mlxcache knows about mlx-vlm model families: resume safety and vision encoders.

Kept apart from the generation loop so the rules a model must meet to be resumed from a cached
prefix are in one place. A model that breaks a rule runs uncached, never with a wrong prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlxcache.integrations.resume import unsupported_cache_reason

# Families whose language model keeps M-RoPE state (``_rope_deltas``) and slices full-prompt
# ``position_ids`` at its cache offset: resumable when both are passed explicitly.
MROPE_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})

# Families whose language model reads per-prompt state that a suffix-only prefill would get wrong.
UNSAFE_TYPES = frozenset({"falcon_ocr"})

# Outputs of ``get_input_embeddings`` a suffix prefill can carry: the full-prompt positions
# (sliced by the model at its cache offset) and the M-RoPE delta. ``attention_mask_4d`` is
# ignored by every language model outside UNSAFE_TYPES (it is dropped on resume).
RESUMABLE_KEYS = frozenset({"position_ids", "rope_deltas"})
DROPPED_KEYS = frozenset({"attention_mask_4d"})


def model_type(model: Any) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", "") or getattr(model, "model_type", "") or "")


def static_unsupported_reason(model: Any, prompt_cache: list[Any]) -> str | None:
    """Why ``model`` with this fresh cache cannot be resumed from a prefix, or None."""
    mtype = model_type(model)
    lm = getattr(model, "language_model", None)
    if lm is None or not hasattr(model, "get_input_embeddings"):
        return f"model {mtype or type(model).__name__} has no language_model/get_input_embeddings"
    if mtype in UNSAFE_TYPES:
        return f"model type {mtype} reads full-prompt masks a suffix prefill cannot carry"
    if (hasattr(lm, "_rope_deltas") or hasattr(lm, "_position_ids")) and mtype not in MROPE_TYPES:
        return f"model type {mtype} keeps position state mlxcache does not know how to resume"
    return unsupported_cache_reason(prompt_cache)


def embedding_unsupported_reason(extra: dict[str, Any]) -> str | None:
    """Why these ``get_input_embeddings`` outputs cannot be carried into a suffix, or None."""
    unknown = sorted(set(extra) - RESUMABLE_KEYS - DROPPED_KEYS)
    if unknown:
        return f"get_input_embeddings returned {', '.join(unknown)}, which a suffix cannot carry"
    return None


def _qwen_encoder(model: Any, pixel_values: mx.array, kwargs: dict[str, Any]) -> mx.array | None:
    grid = kwargs.get("image_grid_thw")
    if grid is None:
        return None  # videos: let the model run its own tower
    dtype = model.vision_tower.patch_embed.proj.weight.dtype
    return model.vision_tower(pixel_values.astype(dtype), grid, output_hidden_states=False)


def _gemma3_encoder(model: Any, pixel_values: mx.array, kwargs: dict[str, Any]) -> mx.array:
    # the dtype of the text embeddings (a quantized embedding's weight is uint32)
    dtype = model.language_model.model.embed_tokens(mx.array([[0]])).dtype
    hidden, _, _ = model.vision_tower(
        pixel_values.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True
    )
    return model.multi_modal_projector(hidden)


# The exact computation each family's get_input_embeddings runs when it is not given
# ``cached_image_features``, so features computed here are bit-identical to the model's own.
_ENCODERS: dict[str, Callable[[Any, mx.array, dict[str, Any]], mx.array | None]] = {
    "qwen2_vl": _qwen_encoder,
    "qwen2_5_vl": _qwen_encoder,
    "gemma3": _gemma3_encoder,
}


def encode_images(model: Any, pixel_values: mx.array, kwargs: dict[str, Any]) -> mx.array | None:
    """The image features the model would compute itself, or None if we cannot run its encoder."""
    enc = _ENCODERS.get(model_type(model))
    if enc is None:
        return None
    features = enc(model, pixel_values, kwargs)
    if features is not None:
        mx.eval(features)
    return features


def accepts_cached_features(model: Any) -> bool:
    """Whether the model's get_input_embeddings takes ``cached_image_features=``."""
    return model_type(model) in _ENCODERS
