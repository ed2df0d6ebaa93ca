"""Qwen3-VL, Qwen3.5, GLM-4.xV and PaddleOCR-VL: M-RoPE position state (issue 25).

Dimensions follow mlx-vlm 0.7.10's own tests (``mlx_vlm/tests/test_models.py``), shrunk to
2 layers; each image spans the first block boundary (its tokens run 9..44 with the
``vision_start`` token at ``IMAGE_AT``), so hits end both inside and after an image.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from families.harness import Spec
from mlxcache.tiny_models.vlm_families import QWEN3_5_TEXT, QWEN3_VL_TEXT

VOCAB = 1000
IMAGE, VIDEO, VISION_START, VISION_END = 999, 998, 997, 996
GRID = (1, 12, 12)  # 144 patches, 36 tokens after the 2x2 merge


def _patches(seed: int, dim: int, grid: tuple[int, int, int] = GRID):
    import mlx.core as mx

    n = grid[0] * grid[1] * grid[2]
    pixels = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return mx.array(pixels), {"image_grid_thw": mx.array([list(grid)])}


def _qwen_image(dim: int) -> Any:
    def image(seed: int):
        pixels, kwargs = _patches(seed, dim)
        tokens = GRID[0] * GRID[1] * GRID[2] // 4
        return pixels, kwargs, [VISION_START] + [IMAGE] * tokens

    return image


_TOKENS = {
    "image_token_id": IMAGE,
    "video_token_id": VIDEO,
    "vision_start_token_id": VISION_START,
    "vision_end_token_id": VISION_END,
    "vocab_size": VOCAB,
}

_QWEN3_TEXT = {**copy.deepcopy(QWEN3_VL_TEXT), "vocab_size": VOCAB, "max_position_embeddings": 1000}

_QWEN3_VISION = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "out_hidden_size": 64,
    "num_heads": 2,
    "patch_size": 14,
    "in_channels": 3,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0],  # one deepstack row per image token into layer 0
}

QWEN3_VL = {
    "model_type": "qwen3_vl",
    "text_config": {"model_type": "qwen3_vl_text", **_QWEN3_TEXT},
    "vision_config": {"model_type": "qwen3_vl", **_QWEN3_VISION},
    **_TOKENS,
}

QWEN3_VL_MOE = {
    "model_type": "qwen3_vl_moe",
    "text_config": {
        "model_type": "qwen3_vl_moe_text",
        **_QWEN3_TEXT,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
    },
    "vision_config": {"model_type": "qwen3_vl_moe", **_QWEN3_VISION},
    **_TOKENS,
}

_QWEN3_5_TEXT = {
    **copy.deepcopy(QWEN3_5_TEXT),
    "vocab_size": VOCAB,
    "max_position_embeddings": 1000,
}
_QWEN3_5_VISION = {**_QWEN3_VISION, "deepstack_visual_indexes": []}  # none in Qwen3.5

QWEN3_5 = {
    "model_type": "qwen3_5",
    "text_config": {"model_type": "qwen3_5", **_QWEN3_5_TEXT},
    "vision_config": {"model_type": "qwen3_5", **_QWEN3_5_VISION},
    **_TOKENS,
}

_QWEN3_5_MOE_TEXT = {k: v for k, v in _QWEN3_5_TEXT.items() if k != "intermediate_size"}
QWEN3_5_MOE = {
    "model_type": "qwen3_5_moe",
    "text_config": {
        "model_type": "qwen3_5_moe",
        **_QWEN3_5_MOE_TEXT,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "shared_expert_intermediate_size": 128,
        "moe_intermediate_size": 64,
    },
    "vision_config": {"model_type": "qwen3_5_moe", **_QWEN3_5_VISION},
    **_TOKENS,
}

_GLM_TOKENS = {**_TOKENS, "image_token_index": IMAGE, "video_token_index": VIDEO}
_GLM4V_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 1000,
    "partial_rotary_factor": 0.5,
    "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1]},
    "eos_token_id": [VOCAB - 10],
}
_GLM4V_VISION = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "patch_size": 14,
    "image_size": 112,
    "out_hidden_size": 64,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
GLM4V = {
    "model_type": "glm4v",
    "text_config": {"model_type": "glm4v_text", **_GLM4V_TEXT},
    "vision_config": {"model_type": "glm4v_vision", **_GLM4V_VISION},
    "hidden_size": 64,
    **_GLM_TOKENS,
}

GLM4V_MOE = {
    "model_type": "glm4v_moe",
    "text_config": {
        "model_type": "glm4v_moe",
        **{k: v for k, v in _GLM4V_TEXT.items() if k != "eos_token_id"},
        "head_dim": 16,
        "rope_theta": 10000,
        "moe_intermediate_size": 64,
        "norm_topk_prob": False,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "routed_scaling_factor": 1.0,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,  # a dense layer, then an MoE one
        "rms_norm_eps": 1e-5,
        "use_qk_norm": True,
        "attention_bias": False,
        "tie_word_embeddings": False,
    },
    "vision_config": {"model_type": "glm4v_moe", **_GLM4V_VISION},
    "hidden_size": 64,
    **_GLM_TOKENS,
}

_PADDLEOCR_TEXT = {
    "hidden_size": 1024,  # the width its vision projector is built for (fixed in mlx-vlm)
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB,
    "max_position_embeddings": 1000,
    "hidden_act": "silu",
    "use_bias": False,
    "rope_scaling": {"rope_type": "default", "type": "default", "mrope_section": [4, 2, 2]},
}
PADDLEOCR_VL = {  # text dimensions at the top level too, as in PaddleOCR-VL's config.json
    "model_type": "paddleocr_vl",
    **_PADDLEOCR_TEXT,
    "text_config": {"model_type": "paddleocr_vl", **_PADDLEOCR_TEXT},
    "vision_config": {
        "model_type": "paddleocr_vl",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 112,
        "patch_size": 14,
        "spatial_merge_size": 2,
    },
    **{k: v for k, v in _TOKENS.items() if k != "vocab_size"},
}


def _paddleocr_image(seed: int):
    import mlx.core as mx

    n = GRID[0] * GRID[1] * GRID[2]
    rng = np.random.default_rng(seed)
    pixels = rng.standard_normal((1, n, 3, 14, 14)).astype(np.float32)
    tokens = [VISION_START] + [IMAGE] * (n // 4)
    return mx.array(pixels), {"image_grid_thw": mx.array([list(GRID)])}, tokens


def _qwen(name: str, config: dict, notes: str, image=None, **more) -> Spec:
    """A Qwen-layout family: one image on the 14-pixel grid, text ids below the specials."""
    image = image or _qwen_image(3 * 2 * 14 * 14)
    return Spec(name, config, image, text_ids=(1, 990), notes=notes, **more)


# gated-delta layers: exact against the engine resumed at the same splits, at checkpoints
_RECURRENT = {"expect": "exact", "split_sensitive": True}

SPECS = [
    _qwen(
        "qwen3_vl",
        QWEN3_VL,
        "deepstack rows cached with the image features; aligned by the LM at its offset",
    ),
    _qwen("qwen3_vl_moe", QWEN3_VL_MOE, "as qwen3_vl, with MoE layers"),
    _qwen(
        "qwen3_5",
        QWEN3_5,
        "gated-delta recurrent layers: reused at checkpoints (stride, branch points)",
        **_RECURRENT,
    ),
    _qwen("qwen3_5_moe", QWEN3_5_MOE, "as qwen3_5, with MoE layers", **_RECURRENT),
    _qwen("glm4v", GLM4V, "explicit position_ids are used as given: each chunk gets its slice"),
    _qwen("glm4v_moe", GLM4V_MOE, "as glm4v, with MoE layers"),
    _qwen(
        "paddleocr_vl",
        PADDLEOCR_VL,
        "as glm4v: explicit position_ids used as given",
        _paddleocr_image,
    ),
]
