"""Regression guards: families cached and exact before resumed prompts took the engine's calls.

Tiny configs from the dimensions of mlx-vlm's own tests (``mlx_vlm/tests/test_models.py``:
hidden 16-64, one or two layers, 28-56 px images of 14 px patches), vocabulary 1000 with the
image token at 999, so each image is a few placeholder tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np

from families.harness import IMAGE_AT, Spec

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
    """An image of ``shape`` pixels that becomes ``tokens`` placeholders; ``kwargs``: the
    processor's other model inputs (lists become arrays)."""

    def make(seed: int):
        import mlx.core as mx

        inputs = {k: mx.array(v) if isinstance(v, list) else v for k, v in kwargs.items()}
        return _pixels(seed, shape), inputs, [IMAGE_TOKEN] * tokens

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
    Spec("llava", LLAVA, _image((1, 3, 56, 56), 16)),
    Spec("pixtral", PIXTRAL, _image((1, 3, 56, 56), 16)),
    Spec("mistral3", MISTRAL3, _image((1, 3, 56, 56), 4, image_sizes=[[56, 56]])),
    Spec(
        "ministral3",
        MINISTRAL3,
        _image((1, 3, 56, 56), 4, image_sizes=[[56, 56]]),
    ),
    Spec("idefics3", IDEFICS3, _image((1, 1, 3, 56, 56), 4)),
    Spec("smolvlm", SMOLVLM, _image((1, 1, 3, 56, 56), 4)),
    Spec("internvl_chat", INTERNVL, _image((1, 3, 56, 56), 4)),
    Spec(
        "aya_vision",
        AYA,
        _image((1, 3, 56, 56), 4),
        notes="sliding-window layers: stored per block, rebuilt from the window's blocks",
    ),
]

LLAMA4 = {
    "model_type": "llama4",
    "text_config": _text(
        "llama4_text",
        head_dim=16,
        intermediate_size_mlp=128,
        num_local_experts=2,
        interleave_moe_layer_step=2,
        attention_chunk_size=8192,
        no_rope_layers=[1, 0],
    ),
    "vision_config": {
        **_vision("llama4_vision_model", intermediate_size=128),
        "norm_eps": 1e-5,
        "initializer_range": 0.02,
        "pixel_shuffle_ratio": 0.5,
        "projector_dropout": 0.0,
        "projector_input_dim": 64,
        "projector_output_dim": 64,
        "vision_output_dim": 64,
        "rope_theta": 10000,
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default",
    },
    "image_token_index": IMAGE_TOKEN,
}

SPECS += [
    Spec(
        "llama4",
        LLAMA4,
        _image((1, 3, 56, 56), 4),
        extra=NO_ENCODER,
        notes="chunked-attention layers: rebuilt from the current chunk's blocks",
    )
]

KIMI_VL = {
    "model_type": "kimi_vl",
    "text_config": _text(
        "deepseek_v3",
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        moe_intermediate_size=64,
    ),
    "vision_config": {
        "model_type": "moonvit",
        "depth": 1,
        "embed_dim": 32,
        "hidden_size": 32,
        "num_heads": 2,
        "intermediate_size": 64,
        "patch_size": 14,
        # the image's own 4x4 grid: no bicubic resize (0.4 s a call on CPU)
        "init_pos_emb_height": 4,
        "init_pos_emb_width": 4,
    },
    "vocab_size": VOCAB,
    "media_placeholder_token_id": IMAGE_TOKEN,
}

SPECS += [
    Spec(
        "kimi_vl",
        KIMI_VL,
        _image((16, 3, 14, 14), 4, image_grid_hws=[[4, 4]]),
    )
]

LFM2_VL = {
    "model_type": "lfm2-vl",
    "text_config": {
        **_text("lfm2"),
        "num_heads": 4,
        "layer_types": ["conv", "full_attention"],
        "block_dim": 64,
        "block_ff_dim": 128,
        "conv_dim": 64,
        "conv_dim_out": 64,
    },
    "vision_config": {
        **_vision("lfm2_vl", image_size=64),
        "patch_size": 16,
        "num_patches": 16,
    },
    "image_token_id": IMAGE_TOKEN,
    "projector_hidden_size": 64,
}

SPECS += [
    Spec(
        "lfm2_vl",
        LFM2_VL,
        _image(
            (1, 16, 768),
            4,
            spatial_shapes=[[4, 4]],
            pixel_attention_mask=[[1] * 16],
        ),
        expect="exact",
        notes="short-conv layers: reused at checkpoints (stride, branch points)",
    )
]

MOLMO = {
    "model_type": "molmo",
    "text_config": {
        "model_type": "molmo",
        "d_model": 64,
        "n_heads": 4,
        "n_kv_heads": 2,
        "n_layers": 2,
        "mlp_hidden_size": 256,
        "vocab_size": VOCAB,
        "embedding_size": VOCAB,
        "additional_vocab_size": 128,
    },
    "vision_config": {
        "model_type": "molmo",
        "image_default_input_size": [56, 56],
        "hidden_size": 128,
        "image_emb_dim": 32,
        "image_num_heads": 2,
        "image_num_key_value_heads": 2,
        "image_num_layers": 1,
        "image_head_dim": 16,
        "image_mlp_dim": 64,
        "image_num_pos": 17,
        "d_model": 64,
        "vit_layers": [-1, -1],  # pad_embed assumes two layers
    },
}


def _molmo_image(seed: int):
    """One 56 px crop: 16 patches of 588 values, pooled 2x2 into four features that molmo adds
    to the embeddings at ``image_input_idx`` (absolute prompt positions)."""
    import mlx.core as mx

    positions = list(range(IMAGE_AT, IMAGE_AT + 4))
    kwargs = {"image_input_idx": mx.array([positions]), "image_masks": mx.ones((1, 16))}
    return _pixels(seed, (1, 16, 588)), kwargs, [IMAGE_TOKEN] * 4


SPECS += [Spec("molmo", MOLMO, _molmo_image)]


@contextlib.contextmanager
def _small_phi3_v_clip() -> Iterator[None]:
    """phi3_v builds its vision tower from a class constant, CLIP ViT-L/14-336 (300M weights,
    16 s to build): the same class with one narrow layer while the model is built."""
    from mlx_vlm.models.phi3_v.vision import VisionModel

    large = VisionModel.CLIP_VIT_LARGE_PATCH14_336_CONFIG
    small = dict(vars(large), hidden_size=32, intermediate_size=64, num_attention_heads=2)
    small["num_hidden_layers"] = 1
    VisionModel.CLIP_VIT_LARGE_PATCH14_336_CONFIG = SimpleNamespace(**small)
    try:
        yield
    finally:
        VisionModel.CLIP_VIT_LARGE_PATCH14_336_CONFIG = large


# An image is 313 placeholders for phi3_v (more than the matrix's prompt, and 1024-wide CLIP
# features): the guard covers its language model on text prompts.
PHI3_V = {
    "model_type": "phi3_v",
    "text_config": {},
    "vision_config": _vision("phi3_v"),
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
}

SPECS += [Spec("phi3_v", PHI3_V, building=_small_phi3_v_clip, notes="text prompts (see PHI3_V)")]
