"""What mlxcache knows about mlx-vlm model families: the one table of how each is resumed.

A prompt is resumed from a cached prefix only when the rest of it, run on the restored cache
with the calls mlx-vlm's own chunked prefill makes, gives the engine's answer. Everything a
family needs for that lives in ``FAMILIES``; a family (or a request) that cannot be resumed
safely runs mlx-vlm's own ``generate_step`` unchanged (``engine.py``), with one log line per
model load. docs/models.md is this table in prose, with the tests that hold each row.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxcache.integrations.mlx_vlm import family_encoders as enc
from mlxcache.integrations.mlx_vlm import features_qwen
from mlxcache.integrations.mlx_vlm.expanded import one_placeholder_expanded
from mlxcache.integrations.resume import unsupported_cache_reason

log = logging.getLogger("mlxcache")

Encoder = Callable[[Any, mx.array, dict[str, Any]], "mx.array | None"]
EmbeddingTokens = Callable[[Any, list[int], int], "list[int] | None"]
# cached features -> (what get_input_embeddings takes as cached_image_features, outputs it then
# leaves out that the language model still needs)
Unpack = Callable[[Any, mx.array], "tuple[mx.array, dict[str, Any]]"]


@dataclass(frozen=True)
class Family:
    """How one model family is resumed.

    ``refuse``: why it never is (it runs the engine's own path). ``encoder``: the exact
    computation its ``get_input_embeddings`` runs on ``pixel_values`` when it is not given
    ``cached_image_features``, so image features can be cached. ``prime_positions``: its
    language model keeps position state (``_rope_deltas``/``_position_ids``) that a resumed
    suffix cannot rebuild, so the full prompt's ``position_ids`` and ``rope_deltas`` are
    computed with its ``get_rope_index`` and passed explicitly, as mlx-vlm's own prefix cache
    does. ``token_inputs``: per-token model inputs that follow the prompt's ids and that a
    resumed (chunked) prefill never reads, so they are not part of an image's cache key.
    ``embedding_tokens``: its ``get_input_embeddings`` can return more positions than
    the prompt has ids (an image placeholder becomes the image's rows); this gives the prompt's
    tokens in embedding positions (or None: not mapped), which key and resume it.
    ``slice_positions``: its language model uses an explicit ``position_ids`` as given
    (no slicing at its cache offset), so each chunk gets the engine's positions for its own
    tokens (``positions.py``). ``unpack``: its encoder stores more than the features its
    ``get_input_embeddings`` takes back (Qwen3-VL's deepstack rows): how to split them.
    """

    refuse: str | None = None
    encoder: Encoder | None = None
    prime_positions: bool = False
    token_inputs: tuple[str, ...] = ()
    embedding_tokens: EmbeddingTokens | None = None
    slice_positions: bool = False
    unpack: Unpack | None = None


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


def _gemma4_encoder(model: Any, pixel_values: mx.array, kwargs: dict[str, Any]) -> mx.array:
    # get_input_embeddings casts cached and computed features alike to the embeddings' dtype
    return model.encode_image(pixel_values, kwargs.get("image_position_ids"))


_QWEN3_VL = Family(
    encoder=features_qwen.qwen3_vl_encoder,
    unpack=features_qwen.qwen3_vl_unpack,
    prime_positions=True,
)
_QWEN3_5 = Family(encoder=features_qwen.qwen3_5_encoder, prime_positions=True)

# Gemma 4's processor sends mm_token_type_ids (1 on image tokens) with every prompt; the model
# reads them only for its bidirectional vision overlay, which applies in a one-pass prefill
# alone (mlxcache never resumes those: engine.chunks_prefill).
_GEMMA4 = Family(encoder=_gemma4_encoder, token_inputs=("mm_token_type_ids", "token_type_ids"))

FAMILIES: dict[str, Family] = {
    "qwen2_vl": Family(encoder=_qwen_encoder, prime_positions=True),
    "qwen2_5_vl": Family(encoder=_qwen_encoder, prime_positions=True),
    # image features cached with their deepstack rows; every embedding output goes to each
    # chunk in full and the LM aligns visual_pos_masks and deepstack rows with its cache offset
    "qwen3_vl": _QWEN3_VL,
    "qwen3_vl_moe": _QWEN3_VL,
    # gated-delta layers too: their restored state is exact at a stored length only
    "qwen3_5": _QWEN3_5,
    "qwen3_5_moe": _QWEN3_5,
    # their LMs take an explicit position_ids as given, and rope_deltas past the first chunk
    "glm4v": Family(encoder=_qwen_encoder, prime_positions=True, slice_positions=True),
    "glm4v_moe": Family(encoder=_qwen_encoder, prime_positions=True, slice_positions=True),
    "paddleocr_vl": Family(
        encoder=features_qwen.paddleocr_encoder, prime_positions=True, slice_positions=True
    ),
    "gemma3": Family(encoder=_gemma3_encoder, token_inputs=("token_type_ids",)),  # never read
    "llava": Family(encoder=enc.llava),
    "pixtral": Family(encoder=enc.pixtral),
    "mistral3": Family(encoder=enc.mistral3),
    "lfm2-vl": Family(encoder=enc.lfm2_vl),
    "aya_vision": Family(encoder=enc.aya_vision),
    "internvl_chat": Family(encoder=enc.internvl_chat),
    "kimi_vl": Family(encoder=enc.kimi_vl),
    "molmo": Family(encoder=enc.molmo),
    "idefics3": Family(encoder=enc.idefics3),
    "smolvlm": Family(encoder=enc.idefics3),
    "llava_next": Family(embedding_tokens=one_placeholder_expanded),
    "phi4mm": Family(embedding_tokens=one_placeholder_expanded),
    "falcon_ocr": Family(refuse="reads full-prompt masks a suffix prefill cannot carry"),
    "gemma3n": Family(token_inputs=("token_type_ids",)),  # its language model never reads them
    "gemma4": _GEMMA4,
    "mllama": Family(
        refuse="keeps its images' cross-attention states in its KV cache, "
        "which a token prefix cannot carry"
    ),
}

# ``get_input_embeddings`` outputs that the engine passes to the language model in full on
# every prefill chunk (the model aligns each with its cache offset, as in a chunked prefill).
DEFAULT = Family()


def model_type(model: Any) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", "") or getattr(model, "model_type", "") or "")


def family(model: Any) -> Family:
    """The table's row for ``model`` (the default row for a family it does not name)."""
    return FAMILIES.get(model_type(model), DEFAULT)


def refused_type(mtype: str) -> str | None:
    """Why the family ``mtype`` (a config's ``model_type``) is never resumed, or None."""
    row = FAMILIES.get(mtype)
    return None if row is None or row.refuse is None else f"model type {mtype} {row.refuse}"


def static_unsupported_reason(model: Any, prompt_cache: list[Any]) -> str | None:
    """Why ``model`` with this fresh cache cannot be resumed from a prefix, or None."""
    mtype = model_type(model) or type(model).__name__
    lm = getattr(model, "language_model", None)
    if lm is None or not hasattr(model, "get_input_embeddings"):
        return f"model {mtype} has no language_model/get_input_embeddings"
    refused = refused_type(model_type(model))
    if refused is not None:
        return refused
    row = family(model)
    keeps_positions = hasattr(lm, "_rope_deltas") or hasattr(lm, "_position_ids")
    if keeps_positions and not (row.prime_positions or callable(getattr(lm, "get_rope_index", 0))):
        return f"model type {mtype} keeps position state mlxcache does not know how to resume"
    return unsupported_cache_reason(prompt_cache)


def prime_positions(model: Any, ids: mx.array, mask: Any, kwargs: dict[str, Any]) -> dict:
    """The full prompt's ``position_ids``/``rope_deltas`` for a model that keeps them, else {}.

    What mlx-vlm's prefix cache does before it resumes a suffix
    (``generate/dispatch.py: _prime_cached_prefix_rope_state``): the language model's own
    ``get_rope_index`` over the whole prompt, set on the model and passed explicitly (the model
    slices them at its cache offset).
    """
    lm = model.language_model
    get_rope_index = getattr(lm, "get_rope_index", None)
    if not callable(get_rope_index):
        return {}
    if not (hasattr(lm, "_rope_deltas") or hasattr(lm, "_position_ids")):
        return {}
    position_ids, rope_deltas = get_rope_index(
        ids, kwargs.get("image_grid_thw"), kwargs.get("video_grid_thw"), mask
    )
    if hasattr(lm, "_position_ids"):
        lm._position_ids = position_ids
    if hasattr(lm, "_rope_deltas"):
        lm._rope_deltas = rope_deltas
    return {"position_ids": position_ids, "rope_deltas": rope_deltas}


def key_inputs(model: Any, model_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The model inputs that identify a prompt's images: all but the family's token inputs."""
    skip = family(model).token_inputs
    return {k: v for k, v in model_kwargs.items() if k not in skip}


def encode_images(model: Any, pixel_values: mx.array, kwargs: dict[str, Any]) -> mx.array | None:
    """The image features the model would compute itself, or None if we cannot run its encoder."""
    enc = family(model).encoder
    if enc is None:
        return None
    features = enc(model, pixel_values, kwargs)
    if features is not None:
        mx.eval(features)
    return features


def unpack_features(model: Any, features: mx.array) -> tuple[mx.array, dict[str, Any]]:
    """(the ``cached_image_features`` to pass, outputs to add to ``get_input_embeddings``'s)."""
    unpack = family(model).unpack
    return unpack(model, features) if unpack is not None else (features, {})


def accepts_cached_features(model: Any) -> bool:
    """Whether the model's get_input_embeddings takes ``cached_image_features=``."""
    return family(model).encoder is not None


_told: dict[int, set[str]] = {}  # id(model) -> reasons logged (an mlx Module is unhashable)


def tell_once(model: Any, reason: str, path: str = "uncached") -> None:
    """Log why ``model`` runs the engine's own path: once per model object and reason.

    ``path`` says what mlxcache still reuses of it ("uncached": nothing)."""
    key = id(model)
    if key not in _told:
        _told[key] = set()
        weakref.finalize(model, _told.pop, key, None)
    if reason not in _told[key]:
        _told[key].add(reason)
        log.info("mlxcache: %s runs mlx-vlm's own path, %s: %s", model_type(model), path, reason)
