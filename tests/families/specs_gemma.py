"""Gemma 3n, Gemma 4 (E2B/E4B-style, 31B-style, bidirectional vision), PaliGemma and mllama.

Dimensions from mlx-vlm 0.7.10's own tests (``mlx_vlm/tests/test_models.py``), shrunk to two to
four layers and a vocabulary of 1000 so a 96-token prompt of random ids fits.
"""

from __future__ import annotations

import numpy as np

from families.harness import Spec

VOCAB = 1000
IMAGE_TOKEN = 999


def _pixels(seed: int, shape: tuple[int, ...]):
    import mlx.core as mx

    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _gemma3n_config() -> dict:
    return {
        "model_type": "gemma3n",
        "vocab_size": VOCAB + 8,
        "hidden_size": 64,
        "image_token_id": IMAGE_TOKEN,
        "image_token_index": IMAGE_TOKEN,
        "audio_token_id": VOCAB + 5,
        "text_config": {
            "model_type": "gemma3n_text",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": [128, 128],
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "vocab_size": VOCAB + 8,
            "vocab_size_per_layer_input": VOCAB,
            "hidden_size_per_layer_input": 16,
            "altup_num_inputs": 2,
            "laurel_rank": 8,
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window_pattern": 2,
        },
        "vision_config": {"model_type": "gemma3n_vision", "vocab_size": 4, "vocab_offset": VOCAB},
        "audio_config": {"vocab_size": 4, "vocab_offset": VOCAB + 4, "hidden_size": 16},
    }


def _gemma4_config(*, per_layer: int, shared: int = 0, bidirectional: bool = False) -> dict:
    text = {
        "model_type": "gemma4_text",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "global_head_dim": 32,
        "vocab_size": VOCAB,
        "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": per_layer,
        "num_kv_shared_layers": shared,
        "sliding_window": 32,
        "sliding_window_pattern": 2,
        "final_logit_softcapping": 30.0,
    }
    if bidirectional:
        text["use_bidirectional_attention"] = "vision"
    return {
        "model_type": "gemma4",
        "vocab_size": VOCAB,
        "image_token_id": IMAGE_TOKEN,
        "audio_token_id": IMAGE_TOKEN - 1,
        "text_config": text,
        "vision_config": {
            "model_type": "gemma4_vision",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "patch_size": 16,
            "pooling_kernel_size": 2,
            "default_output_length": 4,
            "position_embedding_size": 64,
            "use_clipped_linears": False,
        },
    }


def _gemma4_image(seed: int):
    return _pixels(seed, (1, 3, 64, 64)), {}, [IMAGE_TOKEN] * 4


def _types(ids: list[int]):
    import mlx.core as mx

    return mx.array([[int(i == IMAGE_TOKEN) for i in ids]])


def _gemma4_token_types(ids: list[int]) -> dict:
    """What Gemma 4's processor sends with every prompt: 1 on image tokens, else 0."""
    return {"mm_token_type_ids": _types(ids)}


def _gemma3n_token_types(ids: list[int]) -> dict:
    """What Gemma 3n's processor sends with every prompt (its model never reads them)."""
    return {"token_type_ids": _types(ids)}


SLIDING = "sliding-window layers: stored per block, reused at any block boundary"

SPECS = [
    Spec(
        "gemma3n",
        _gemma3n_config(),
        None,
        text_ids=(1, 990),
        expect="cached",
        notes=SLIDING + "; text only (its MobileNetV5 vision tower has a fixed ~300M size)",
        unbuilt=("vision_tower",),
        token_kwargs=_gemma3n_token_types,
    ),
    Spec(
        "gemma4_e2b",
        _gemma4_config(per_layer=16, shared=2),
        _gemma4_image,
        text_ids=(1, 990),
        expect="cached",
        notes=SLIDING + "; per_layer_inputs, KV-shared layers",
        token_kwargs=_gemma4_token_types,
    ),
    Spec(
        "gemma4_31b",
        _gemma4_config(per_layer=0),
        _gemma4_image,
        text_ids=(1, 990),
        expect="cached",
        notes=SLIDING,
        token_kwargs=_gemma4_token_types,
    ),
    Spec(
        "gemma4_bidi",
        _gemma4_config(per_layer=0, bidirectional=True),
        _gemma4_image,
        text_ids=(1, 990),
        expect="repeat",
        reason="prefills this prompt in one pass",
        token_kwargs=_gemma4_token_types,
        notes="an image prompt is prefilled in one pass by mlx-vlm (bidirectional image tokens)",
    ),
    Spec(
        "gemma4_bidi_text",
        _gemma4_config(per_layer=0, bidirectional=True),
        None,
        text_ids=(1, 990),
        expect="cached",
        token_kwargs=_gemma4_token_types,
        notes=SLIDING + "; text-only prompts of the bidirectional-vision config",
    ),
]


def _paligemma_config() -> dict:
    return {
        "model_type": "paligemma",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "image_token_index": IMAGE_TOKEN,
        "pad_token_id": 0,
        "text_config": {
            "model_type": "gemma",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "vocab_size": VOCAB,
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "image_size": 56,
            "patch_size": 14,
            "projection_dim": 64,
        },
    }


def _paligemma_image(seed: int):
    return _pixels(seed, (1, 3, 56, 56)), {}, [IMAGE_TOKEN] * 16


TILES = 4


def _mllama_config() -> dict:
    return {
        "model_type": "mllama",
        "vocab_size": VOCAB,
        "image_token_index": IMAGE_TOKEN,
        "text_config": {
            "model_type": "mllama",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": VOCAB,
            "cross_attention_layers": [1],
        },
        "vision_config": {
            "image_size": 28,
            "patch_size": 14,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_global_layers": 1,
            "num_attention_heads": 2,
            "max_num_tiles": TILES,
            "vision_output_dim": 96,
            "intermediate_layers_indices": [0, 1],
        },
    }


def _mllama_image(seed: int):
    import mlx.core as mx

    pixels = _pixels(seed, (1, 1, TILES, 3, 28, 28))
    kwargs = {
        "aspect_ratio_ids": mx.array([[1]]),
        "aspect_ratio_mask": mx.ones((1, 1, TILES), dtype=mx.int32),
    }
    return pixels, kwargs, [IMAGE_TOKEN]


def _mllama_cross_mask(ids: list[int]) -> dict:
    """Its processor's cross_attention_mask: text from the image token on sees every tile."""
    import mlx.core as mx

    at = ids.index(IMAGE_TOKEN) if IMAGE_TOKEN in ids else len(ids)
    rows = [[[int(i >= at)] * TILES] for i in range(len(ids))]
    return {"cross_attention_mask": mx.array([rows], dtype=mx.int32)}


SPECS += [
    Spec(
        "paligemma",
        _paligemma_config(),
        _paligemma_image,
        text_ids=(1, 990),
        expect="repeat",
        reason="prefills this prompt in one pass",
        notes="a prefix-LM: mlx-vlm attends the whole prompt bidirectionally in one pass",
    ),
    Spec(
        "mllama",
        _mllama_config(),
        _mllama_image,
        text_ids=(1, 990),
        expect="refused",
        reason="cross-attention states",
        token_kwargs=_mllama_cross_mask,
    ),
]
