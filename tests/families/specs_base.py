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
