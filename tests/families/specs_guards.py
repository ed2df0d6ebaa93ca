"""Regression guards: families cached and exact before resumed prompts took the engine's calls.

Tiny configs from the dimensions of mlx-vlm's own tests (``mlx_vlm/tests/test_models.py``:
hidden 16-64, one or two layers, 28-56 px images of 14 px patches), vocabulary 1000 with the
image token at 999, so each image is a few placeholder tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from families.harness import Spec

VOCAB = 1000
IMAGE_TOKEN = 999
NO_ENCODER = {"encoder": False}  # image features are recomputed on a hit (no cached features)


def _pixels(seed: int, shape: tuple[int, ...]) -> Any:
    import mlx.core as mx

    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _text(model_type: str, **more: Any) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5,
        **more,
    }


def _vision(model_type: str, image_size: int = 56, **more: Any) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "num_hidden_layers": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "image_size": image_size,
        "patch_size": 14,
        "num_channels": 3,
        **more,
    }


def _image(shape: tuple[int, ...], tokens: int, **kwargs: Any):
    """An image of ``shape`` pixels that becomes ``tokens`` placeholders."""

    def make(seed: int):
        return _pixels(seed, shape), dict(kwargs), [IMAGE_TOKEN] * tokens

    return make


LLAVA = {
    "model_type": "llava",
    "text_config": _text("llama"),
    "vision_config": _vision("clip_vision_model"),
    "image_token_index": IMAGE_TOKEN,
    "vocab_size": VOCAB,
    "vision_feature_layer": -1,
}

PIXTRAL = {
    "model_type": "pixtral",
    "text_config": _text("mistral"),
    "vision_config": _vision("pixtral", head_dim=16),
    "image_token_index": IMAGE_TOKEN,
    "vocab_size": VOCAB,
    "vision_feature_layer": -1,
}

MISTRAL3 = {
    "model_type": "mistral3",
    "text_config": _text("mistral", head_dim=16, rope_theta=1000000.0),
    "vision_config": _vision("pixtral", head_dim=16),
    "image_token_index": IMAGE_TOKEN,
    "vocab_size": VOCAB,
}

# Ministral 3: a Mistral 3 VLM whose language model is ministral3 (yarn rope, llama-4 scaling)
MINISTRAL3 = {
    **MISTRAL3,
    "text_config": _text(
        "ministral3",
        head_dim=16,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 16.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 256,
        },
    ),
}

IDEFICS3 = {
    "model_type": "idefics3",
    "text_config": _text("idefics3"),
    "vision_config": _vision("idefics3"),
    "image_token_id": IMAGE_TOKEN,
    "vocab_size": VOCAB,
}

SMOLVLM = {**IDEFICS3, "model_type": "smolvlm", "vision_config": _vision("smolvlm_vision")}

INTERNVL = {
    "model_type": "internvl_chat",
    "text_config": _text("qwen2", max_window_layers=2, hidden_act="silu"),
    "vision_config": _vision("intern_vit_6b"),
    "image_token_index": IMAGE_TOKEN,
    "vocab_size": VOCAB,
}

AYA = {
    "model_type": "aya_vision",
    "text_config": _text("aya_vision", head_dim=16, sliding_window_pattern=2, logit_scale=1.0),
    "vision_config": _vision("siglip_vision_model"),
    "image_token_index": IMAGE_TOKEN,
    "alignment_intermediate_size": 64,
}

SPECS = [
    Spec("llava", LLAVA, _image((1, 3, 56, 56), 16), extra=NO_ENCODER),
    Spec("pixtral", PIXTRAL, _image((1, 3, 56, 56), 16), extra=NO_ENCODER),
    Spec("mistral3", MISTRAL3, _image((1, 3, 56, 56), 4, image_sizes=[[56, 56]]), extra=NO_ENCODER),
    Spec(
        "ministral3",
        MINISTRAL3,
        _image((1, 3, 56, 56), 4, image_sizes=[[56, 56]]),
        extra=NO_ENCODER,
    ),
    Spec("idefics3", IDEFICS3, _image((1, 1, 3, 56, 56), 4), extra=NO_ENCODER),
    Spec("smolvlm", SMOLVLM, _image((1, 1, 3, 56, 56), 4), extra=NO_ENCODER),
    Spec("internvl_chat", INTERNVL, _image((1, 3, 56, 56), 4), extra=NO_ENCODER),
    Spec(
        "aya_vision",
        AYA,
        _image((1, 3, 56, 56), 4),
        expect="exact",
        extra=NO_ENCODER,
        notes="sliding-window layers: reused at a stored length only",
    ),
]
