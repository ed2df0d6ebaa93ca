"""The families the project started with: Qwen2-VL and Gemma 3 (mlxcache/data/tiny_models)."""

from __future__ import annotations

import numpy as np

from families.harness import Spec
from mlxcache.tiny_models import load_config


def _qwen2_vl_image(seed: int):
    import mlx.core as mx

    pixels = np.random.default_rng(seed).standard_normal((64, 1176)).astype(np.float32)
    return mx.array(pixels), {"image_grid_thw": mx.array([[1, 8, 8]])}, [997] + [999] * 16


def _gemma3_image(seed: int):
    import mlx.core as mx

    pixels = np.random.default_rng(seed).standard_normal((1, 3, 112, 112)).astype(np.float32)
    return mx.array(pixels), {}, [999] * 16


SPECS = [
    Spec("qwen2_vl", load_config("qwen2_vl"), _qwen2_vl_image, text_ids=(1, 990)),
    Spec(
        "gemma3",
        load_config("gemma3"),
        _gemma3_image,
        text_ids=(1, 990),
        notes="sliding-window layers: stored per block, reused at any block boundary",
    ),
]

# mlx-vlm's test_qwen2_5_vl, shrunk (2 layers, width 128; a 2-block windowed vision tower)
QWEN2_5_VL = {
    "model_type": "qwen2_5_vl",
    "image_token_id": 999,
    "video_token_id": 998,
    "vision_start_token_id": 997,
    "vocab_size": 1000,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
    "tie_word_embeddings": True,
    "text_config": {},
    "vision_config": {
        "model_type": "qwen2_5_vl",
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "out_hidden_size": 128,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1],
    },
}
SPECS.append(Spec("qwen2_5_vl", QWEN2_5_VL, _qwen2_vl_image, text_ids=(1, 990)))
