"""Random-weight tiny models built locally (nothing downloaded): VLMs and an mlx-lm text model.

Used by the tests, the demo and the benchmarks. ``build_model("qwen2_vl")`` has 4 layers, width
256 and M-RoPE; ``build_model("gemma3")`` has 6 layers, width 128 and a sliding window, so its
prompt cache mixes RotatingKVCache and KVCache (see ``mlxcache/data/tiny_models/README.md``).
``build_tiny_lm(path)`` writes an mlx-lm model folder and ``build_tiny_vlm(path, family=...)`` a
Qwen2-VL (the default), Qwen3-VL or Gemma 3 folder that ``mlx_vlm.load`` and ``mlx_vlm.server``
open with no download.
"""

from mlxcache.tiny_models.configs import NAMES, build_model, load_config
from mlxcache.tiny_models.lm import LM_CHAT_TEMPLATE, LM_SPECIAL_TOKENS, build_tiny_lm
from mlxcache.tiny_models.vlm import (
    VLM_CHAT_TEMPLATE,
    VLM_SPECIAL_TOKENS,
    build_tiny_vlm,
)

__all__ = [
    "LM_CHAT_TEMPLATE",
    "LM_SPECIAL_TOKENS",
    "NAMES",
    "VLM_CHAT_TEMPLATE",
    "VLM_SPECIAL_TOKENS",
    "build_model",
    "build_tiny_lm",
    "build_tiny_vlm",
    "load_config",
]
